# The cost model's side of tools/balance_measure.py: the pairs the predictor counts, the linear
# FLOPs per token, and --fit-calibration's least-squares fits of pair_s, row_s and seq_s, and of
# the linear layers' linear_flops and linear_seq_s.

from __future__ import annotations

import argparse
import ctypes
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mtrain import _lib as L

from .objectives import nonneg_lstsq, shares


def linear_flops_per_token(a: argparse.Namespace, layers: int) -> float:
    """The predictor's linear FLOPs per token (docs/BALANCE.md, "The cost predictor")."""
    h, hq, hkv, d, inter = a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate
    return 6.0 * (layers * (2 * h * hq * d + 2 * h * hkv * d + 3 * h * inter) + h * a.vocab)


class PairCounter:
    """The pairs the cost predictor counts (mtrain_balance_head_pairs: the position model's
    pairs for a head at a level, or the measured ones with --spread measured or --row-pairs)
    for one call: a
    length, a layer and its heads' scales."""

    def __init__(self, a: argparse.Namespace, budget_file: str, row_pairs: Any = None) -> None:
        from mtrain import balance as B  # the predictor's ctypes structures

        self.dll = B._dll()
        self.fn = self.dll.mtrain_balance_head_pairs
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.POINTER(ctypes.c_int64),
        ]
        self.levels = list(a.levels)
        self.heads = a.heads
        scales = np.ascontiguousarray(np.asarray(a.levels, dtype=np.float64))
        cal = B._Calibration(1.0, 0.0, 0.0, 0.0)
        mdl = B._Model(0, 0, 0, 0, 0)
        spread = B._SPREADS["even" if a.spread == "measured" else a.spread]
        pm = B._PositionModel(30, 100, spread, 0, int(a.budget_context))
        handle = B._read_budgets(budget_file)
        self.pred = ctypes.c_void_p()
        try:
            L.check(
                self.dll.mtrain_balance_predictor_create(
                    handle,
                    scales.ctypes.data_as(B._DP),
                    len(scales),
                    self.levels.index(1.0),
                    ctypes.byref(pm),
                    int(a.granularity),
                    ctypes.byref(cal),
                    ctypes.byref(mdl),
                    ctypes.byref(self.pred),
                ),
                "predictor",
            )
        finally:
            L.lib().budgets_destroy(handle)
        table = getattr(a, "row_pairs", None)
        if table:  # --row-pairs FILE: a length grid, read and checked by the library
            L.check(
                self.dll.mtrain_balance_predictor_read_row_pairs(self.pred, os.fsencode(table)),
                "predictor",
            )
        elif row_pairs is not None:  # --spread measured: the predictor's pricing, as balance_batch
            rp = np.ascontiguousarray(np.asarray(row_pairs, dtype=np.float64))
            L.check(
                self.dll.mtrain_balance_predictor_set_row_pairs(
                    self.pred, rp.ctypes.data_as(B._DP)
                ),
                "predictor",
            )

    def count(self, n: int, layer: int, scales: Sequence[float]) -> int:
        v = ctypes.c_int64()
        total = 0
        for h, sc in enumerate(scales):
            level = self.levels.index(sc)
            L.check(self.fn(self.pred, n, layer * self.heads + h, level, ctypes.byref(v)))
            total += v.value
        return total

    def close(self) -> None:
        if self.pred:
            self.dll.mtrain_balance_predictor_destroy(self.pred)
            self.pred = ctypes.c_void_p()


def predictor_pairs(
    a: argparse.Namespace, budget_file: str, points: list[tuple[int, int]], row_pairs: Any = None
) -> dict[tuple[int, int], int]:
    """PairCounter.count at the untuned level for each (length, layer)."""
    pc = PairCounter(a, budget_file, row_pairs)
    try:
        return {(n, layer): pc.count(n, layer, (1.0,) * a.heads) for n, layer in points}
    finally:
        pc.close()


def _cols(mask: int, n: int) -> list[int]:
    """The columns of a subset mask of n terms."""
    return [t for t in range(n) if mask >> t & 1]


def fit_calibration(
    a: argparse.Namespace,
    lengths: list[int],
    measure_key: Callable[[tuple], dict[str, Any]],
    linear_s: dict[int, float],
    layers: int,
    budget_file: str,
    say: Callable[[str], None],
    row_pairs: Any = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """--fit-calibration: a calibration fitted on this run's own measurements, as
    mtrain-balance-calibrate fits one: one call (estimate + forward + backward of one layer) at
    --fit-points lengths (log-spaced among the workload's distinct ones, the shortest and the
    longest included) at every measured layer, untuned budgets; seconds = pair_s * pairs (the
    predictor's own count: the position model's allowed pairs, as the predictor will multiply
    them; the estimated plan's computed pairs are reported beside them) + row_s * N * heads +
    seq_s, least squares on --fit-objective (objectives.OBJECTIVES; relative by default),
    non-negative (the best subset of the three terms). linear_flops and linear_seq_s: fitted on
    the measured linear layers (with --linear, fit_linear, the same objective), else the
    file's."""
    objective = getattr(a, "fit_objective", "relative")
    ns = sorted(set(lengths))
    c = min(a.fit_points, len(ns))
    pick = sorted({ns[round(j * (len(ns) - 1) / max(c - 1, 1))] for j in range(c)})
    rows, ys, pts = [], [], []
    counted = predictor_pairs(
        a, budget_file, [(n, layer) for n in pick for layer in a.layers], row_pairs
    )
    for n in pick:
        for layer in a.layers:
            r = measure_key((-1, n, layer, (1.0,) * a.heads))
            pairs = counted[(n, layer)]
            computed = r["density"] * n * (n + 1) / 2 * a.heads
            rows.append([pairs, n * a.heads, 1.0])
            ys.append(r["step_s"])
            pts.append(
                {
                    "tokens": n,
                    "layer": layer,
                    "pairs": pairs,
                    "computed_pairs": computed,
                    "seconds": r["step_s"],
                }
            )
    x, y = np.asarray(rows), np.asarray(ys)
    w = shares([p["tokens"] for p in pts], ys, lengths)
    coef = nonneg_lstsq(x, y, [_cols(m, 3) for m in range(1, 8)], objective, w)  # every subset
    with open(a.calibration) as f:
        file_cal = json.load(f)
    flops = float(file_cal.get("linear_flops", 0.0))
    lin_seq = float(file_cal.get("linear_seq_s", 0.0))
    lin_report: dict[str, Any] | None = None
    if a.linear and linear_s:
        flops, lin_seq, lin_report = fit_linear(a, linear_s, layers, lengths)
        say(
            f"linear layers fitted on {lin_report['points']} lengths up to {lin_report['top']} "
            f"tokens: {1e3 * lin_seq:.4g} ms per sequence + FLOPs at {flops:.4g} FLOP/s; error "
            f"max {100 * lin_report['max_abs_rel_error']:.1f}% (FLOPs alone at the longest "
            f"length's rate: {100 * lin_report['flops_only_max_abs_rel_error']:.1f}%)"
        )
    cal = {
        "pair_s": coef[0],
        "row_s": coef[1],
        "seq_s": coef[2],
        "linear_flops": flops,
        "linear_seq_s": lin_seq,
    }
    err = x @ coef / y - 1
    for p, e in zip(pts, err, strict=True):
        p["rel_error_fit"] = float(e)
    ratio = [p["computed_pairs"] / p["pairs"] for p in pts if p["pairs"] > 0]
    say(
        f"pairs: the estimated plans computed {min(ratio):.3g}-{max(ratio):.3g}x the pairs the "
        "predictor counts at these points (block-granular kernels, estimated selection)"
    )
    say(
        f"calibration fitted on {len(pts)} measured calls ({len(pick)} lengths x "
        f"{len(a.layers)} layers): pair_s {coef[0]:.4g} s, row_s {coef[1]:.4g} s, seq_s "
        f"{coef[2]:.4g} s, linear_flops {flops:.4g} (objective {objective}); in-sample error max "
        f"{100 * float(np.abs(err).max()):.1f}%, mean {100 * float(np.abs(err).mean()):.1f}%"
    )
    report = {"points": pts, "calibration": cal, "replaces": a.calibration, "linear": lin_report}
    return cal, {**report, "objective": objective}


def fit_linear(
    a: argparse.Namespace,
    linear_s: dict[int, float],
    layers: int,
    workload: Sequence[int] | None = None,
) -> tuple[float, float, dict[str, Any]]:
    """The linear layers' seconds at the workload's lengths up to --linear-chunk (timed, or
    log-log between timed ones: linear_seconds) as c0 + c1 * N, on --fit-objective (workload:
    the document lengths, for its share weights; by default one document per length):
    c0 the per-sequence constant (linear_seq_s: small matrix products run below the rate of
    large ones), c1 the seconds per token, so linear_flops = FLOPs per token / c1; least
    squares (the relative error by default), non-negative (c0 = 0 when the data say so). Also
    reports the error of the FLOPs-only model at the longest timed length's rate (the earlier
    fit)."""
    top = min(max(linear_s), a.linear_chunk)
    ns = sorted(n for n in linear_s if n <= top)
    y = np.array([linear_s[n] for n in ns])
    x = np.array([[1.0, float(n)] for n in ns])
    fpt = linear_flops_per_token(a, layers)
    objective = getattr(a, "fit_objective", "relative")
    w = shares(ns, list(y), workload if workload is not None else list(linear_s))
    coef = nonneg_lstsq(x, y, [[0, 1], [1]], objective, w)
    c0, c1 = float(coef[0]), float(coef[1])
    err = x @ coef / y - 1
    ref = ns[-1]  # the longest length of the workload at or below the chunk
    only = np.array([linear_s[ref] * n / ref for n in ns]) / y - 1
    report = {
        "points": len(ns),
        "top": ref,
        "linear_seq_s": c0,
        "seconds_per_token": c1,
        "max_abs_rel_error": float(np.abs(err).max()),
        "flops_only_max_abs_rel_error": float(np.abs(only).max()),
    }
    return fpt / c1, c0, report


class ProxyPrices:
    """The predictor's seconds of what the tool measures (the proxy prediction): one layer's call
    of a document (pair_s * its heads' pairs at their scales + row_s * N * heads + seq_s, the
    pairs counted as the predictor counts them) and a document's linear layers (FLOPs at
    linear_flops + linear_seq_s, with --linear). Summed over the measured layers x the
    extrapolation factor, it is what mtrain.balance_batch predicts for the measured proxy; over
    every layer, its own prediction."""

    def __init__(
        self,
        a: argparse.Namespace,
        calibration: str | os.PathLike[str] | dict[str, float],
        pairs: PairCounter,
        layers: int,
    ) -> None:
        from mtrain import balance as B

        self.cal = B._calibration(calibration)  # a file or the fitted table, read as balance_batch
        self.pairs, self.heads = pairs, a.heads
        self.flops_per_token = linear_flops_per_token(a, layers) if a.linear else 0.0
        self._calls: dict[tuple[int, int, tuple[float, ...]], float] = {}

    def call(self, n: int, layer: int, scales: Sequence[float]) -> float:
        k = (n, layer, tuple(scales))
        if k not in self._calls:
            c = self.cal
            pairs = self.pairs.count(n, layer, scales)
            self._calls[k] = c.pair_s * pairs + c.row_s * n * self.heads + c.seq_s
        return self._calls[k]

    def linear(self, n: int) -> float:
        if not self.flops_per_token:
            return 0.0
        return self.flops_per_token * n / self.cal.linear_flops + self.cal.linear_seq_s
