"""balance_measure.py: measured per-rank times of the assignments mtrain.balance_batch predicts.

SparseBalance (docs/BALANCE.md, "Measured rank times (tool)") deals a global batch's documents
to data-parallel ranks by predicted seconds. This tool runs the attention those assignments give
each rank, for real, on one device (cpu or cuda), and sets the measured rank times beside the
predicted ones.

Method (every figure is on one device, ranks run one after another):
  1. The workload: a length distribution (--long-tail, the generator of `mtrain-balance batch
     --long-tail` reproduced bit for bit; --lengths FILE; or --equal N --count C), each length
     divided by --scale S and rounded up to a multiple of the granularity (S = 1 on a GPU).
  2. The budgets: the file's heads (--heads H of them per layer, evenly spaced, when H is
     smaller than the file's), counts divided by S with --scale-budgets; written to a derived
     budget file that both the predictor and the measurement use.
  3. For each method, mtrain.balance_batch on the (scaled) lengths gives every document's
     rank(s), every rank's per-head budget scales (tuned methods) and the predicted rank seconds.
  4. A document's attention time depends on its length and its layer's budgets (static top-k
     budgets: the pattern's size does not depend on the inputs), so each distinct (length,
     layer, head budgets) is measured once: mtrain.estimate_pattern then mtrain.attention's
     forward and backward through autograd, as a training step calls them, on structured inputs
     (mtrain_generate_structured, one input per length), warm (--warmup), median of --reps.
     With --grid G a group (layer, budgets) with more than G distinct lengths is measured at G
     log-spaced lengths and interpolated in log-log; --grid-check lengths off the grid are
     measured too and the interpolation error is reported. With top-p budgets the pattern
     depends on the inputs: every document is measured on its own inputs (seed and structure
     strengths drawn per document and layer), no deduplication. --fit-calibration first fits
     the cost model's pair_s, row_s and seq_s on these measurements and balances with them.
  5. A document's time = the sum over the measured --layers times (layers / measured layers)
     (the rest extrapolated, printed); plus, with --linear, the model's projection matmuls
     (torch, forward + backward, the predictor's shapes; norms and activations not counted),
     timed at the lengths up to --linear-chunk and in proportion to the tokens above it.
     A rank's time = its split phase replayed in the solver's order (a split document costs
     each of its k ranks its time / k; the ring's overhead is NOT measured) + its whole
     documents.
  6. --validate K runs K ranks' whole workloads (the last method's, measured layers) for real,
     document after document on fresh inputs with one synchronisation at the end, and compares
     the wall time with the sum of the per-length medians (additivity).

usage: python tools/balance_measure.py --budgets FILE --calibration FILE
       (--long-tail | --lengths FILE | --equal N --count C) --world R [--methods LIST]
       [--backend cpu|cuda] [--scale S] [--layers 0,15,31] [--json OUT] (see --help)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import mtrain
from mtrain import _lib as L

METHODS = (
    "tokens",
    "sorted",
    "cost",
    "cost+tuned",
    "tokens+split",
    "cost+split",
    "cost+split+tuned",
)
_M64 = (1 << 64) - 1


class StructuredOptions(ctypes.Structure):
    """mtrain_structured_options_t (include/mtrain/mtrain_inputs.h)."""

    _fields_ = (
        ("seed", ctypes.c_uint64),
        ("rope_base", ctypes.c_double),
        ("mean_strength", ctypes.c_double),
        ("num_sinks", ctypes.c_int32),
        ("num_outliers", ctypes.c_int32),
        ("outlier_strength", ctypes.c_double),
    )


# ---- the workload -----------------------------------------------------------------------------


def _mix64(state: int) -> tuple[int, int]:
    """tools/balance_batch.c's mix64 (splitmix64): the new state and the output."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def long_tail(world: int, tokens_per_rank: int, long_prob: float, seed: int) -> list[int]:
    """`mtrain-balance batch --long-tail`'s lengths, drawn exactly as tools/balance_batch.c does:
    long with probability long_prob, log-uniform in [131072, 524288], else in [1024, 16384],
    rounded up to a multiple of 128, until the batch holds tokens_per_rank * world tokens."""
    total = float(tokens_per_rank) * world
    s, out, acc = seed & _M64, [], 0.0
    while acc < total:
        s, z = _mix64(s)
        is_long = (z >> 11) * 2.0**-53 < long_prob
        lo, hi = (131072.0, 524288.0) if is_long else (1024.0, 16384.0)
        s, z = _mix64(s)
        x = lo * math.exp((z >> 11) * 2.0**-53 * math.log(hi / lo))
        v = (math.ceil(x) + 127) // 128 * 128
        out.append(v)
        acc += float(v)
    return out


def read_lengths(path: str) -> list[int]:
    """One length >= 1 per line; '#' starts a comment (as mtrain-balance batch --lengths)."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not text.isdigit() or int(text) < 1:
                raise SystemExit(f"balance_measure: {path}: line {no}: expected one length >= 1")
            out.append(int(text))
    if not out:
        raise SystemExit(f"balance_measure: {path}: no lengths")
    return out


def scale_length(n: int, scale: int, granularity: int) -> int:
    """n / scale rounded up to a multiple of the granularity."""
    return -(-n // (scale * granularity)) * granularity


# ---- budgets ----------------------------------------------------------------------------------


def read_budgets(path: str) -> list[list[L.HeadBudget]]:
    """Every layer's head budgets, as the library reads the file."""
    lib = L.lib()
    handle = ctypes.c_void_p()
    L.check(lib.budgets_read(os.fsencode(path), ctypes.byref(handle)), f"budgets {path}")
    try:
        layers = []
        for layer in range(int(lib.budgets_num_layers(handle))):
            heads = []
            for h in range(int(lib.budgets_num_heads(handle, layer))):
                hb = L.HeadBudget()
                L.check(lib.budgets_get(handle, layer, h, ctypes.byref(hb)), "budgets")
                heads.append(hb)
            layers.append(heads)
        return layers
    finally:
        lib.budgets_destroy(handle)


def _div(x: int, scale: int) -> int:
    return 0 if x <= 0 else max(1, (x + scale // 2) // scale)


def derive_budgets(
    layers: list[list[L.HeadBudget]], heads: int, divide: int
) -> list[list[dict[str, Any]]]:
    """heads evenly spaced heads of every layer (all when heads is the file's count), counts
    (top-k sizes, top-p caps) divided by `divide` (rounded, at least 1)."""
    out = []
    for li, layer in enumerate(layers):
        if heads > len(layer):
            raise SystemExit(
                f"balance_measure: --heads {heads} but layer {li} of the budgets has {len(layer)}"
            )
        pick = [h * len(layer) // heads for h in range(heads)]
        row = []
        for h in pick:
            b = layer[h]
            if b.kind == L.BUDGET_TOP_K:
                row.append(
                    {"kind": "topk", "v": _div(b.v_size, divide), "s": _div(b.s_size, divide)}
                )
            else:
                row.append(
                    {
                        "kind": "topp",
                        "p_v": b.p_v,
                        "p_s": b.p_s,
                        "cap_v": _div(b.cap_v, divide),
                        "cap_s": _div(b.cap_s, divide),
                    }
                )
        out.append(row)
    return out


def write_budgets(budgets: list[list[dict[str, Any]]], path: str) -> None:
    """The MInference budget format (core/formats/budgets.c)."""
    doc = []
    for layer in budgets:
        row: dict[str, Any] = {}
        for h, b in enumerate(layer):
            if b["kind"] == "topk":
                row[str(h)] = ["vertical_and_slash", b["v"], b["s"], 0.0]
            else:
                row[str(h)] = [
                    "flex_vertical_and_slash",
                    [b["p_v"], b["cap_v"]],
                    [b["p_s"], b["cap_s"]],
                    0.0,
                ]
        doc.append(row)
    with open(path, "w") as f:
        json.dump(doc, f)


def _scaled(x: int, scale: float) -> int:
    """core/balance/predict.c's scaled(): x times a level's scale, rounded, at least 1."""
    if x <= 0:
        return 0
    return max(1, math.floor(x * scale + 0.5))


def _context(x: int, n: int, budget_context: int) -> int:
    """position_model.c's scale(): x * n / budget_context rounded to nearest."""
    return int(x * n / budget_context + 0.5) if budget_context > 0 else x


def head_budgets(
    layer: list[dict[str, Any]], scales: Sequence[float], n: int, budget_context: int
) -> list[Any]:
    """The budgets one call runs with: each head's counts times its level's scale (as the
    predictor scales them), then by n / budget_context when that is set."""
    out: list[Any] = []
    for b, s in zip(layer, scales, strict=True):
        if b["kind"] == "topk":
            v = _context(_scaled(b["v"], s), n, budget_context)
            sl = _context(_scaled(b["s"], s), n, budget_context)
            out.append(mtrain.TopK(v, max(sl, 1)))
        else:
            cv = _context(_scaled(b["cap_v"], s), n, budget_context)
            cs = _context(_scaled(b["cap_s"], s), n, budget_context)
            out.append(mtrain.TopP(b["p_v"], b["p_s"], cv, max(cs, 1)))
    return out


def doc_seed(doc: int, layer: int, per_document: bool) -> int:
    """A document's inputs: seed 1 + document; with top-p budgets (every document measured on
    its own inputs) also a different input per layer."""
    return 1 + doc + (1000003 * layer if per_document else 0)


# ---- timing -----------------------------------------------------------------------------------


class Runner:
    """Builds inputs and times one layer's training-step attention on the chosen device."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.device = torch.device("cuda" if a.backend == "cuda" else "cpu")
        self.dtype = {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }[a.dtype]
        self.hq, self.hkv, self.d = a.heads, a.kv_heads, a.head_dim
        self.granularity = a.granularity
        self.deterministic = a.deterministic
        self._inputs: dict[tuple[int, int], list[torch.Tensor]] = {}
        # wall: time.perf_counter (synchronised); process: this process's CPU seconds (cpu
        # backend: what the work costs, whatever else runs on the machine)
        self.clock: Callable[[], float] = (
            time.process_time if a.clock == "process" else time.perf_counter
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def inputs(self, n: int, seed: int, vary: bool, keep: bool = True) -> list[torch.Tensor]:
        """q, k, v (mtrain_generate_structured, seed; with vary the structure's strengths drawn
        from the seed too) and a dout of normal noise, on the device in the chosen dtype."""
        key = (n, seed if not vary else -seed - 1)
        if key in self._inputs:
            return self._inputs[key]
        if keep:
            self._inputs.clear()  # one input set at a time: device memory
        opts = StructuredOptions(seed, 10000.0, 2.0, 4, 16, 4.0)
        if vary:
            rng = np.random.default_rng(seed)
            opts.mean_strength = float(rng.uniform(0.5, 3.0))
            opts.num_outliers = int(rng.integers(2, 33))
            opts.outlier_strength = float(rng.uniform(2.0, 6.0))
        q = torch.empty(n, self.hq, self.d, dtype=torch.float32)
        k = torch.empty(n, self.hkv, self.d, dtype=torch.float32)
        v = torch.empty(n, self.hkv, self.d, dtype=torch.float32)
        fn = L.lib().dll.mtrain_generate_structured
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4
        ts = [
            L.Tensor(t.data_ptr(), L.F32, 3, (ctypes.c_int64 * 4)(*t.shape, 0)) for t in (q, k, v)
        ]
        L.check(fn(ctypes.byref(opts), *(ctypes.byref(t) for t in ts)), "structured inputs")
        g = torch.Generator().manual_seed(seed + 7)
        do = torch.randn(n, self.hq, self.d, generator=g)
        out = [t.to(device=self.device, dtype=self.dtype) for t in (q, k, v, do)]
        if keep:
            self._inputs[key] = out
        return out

    def forget(self) -> None:
        self._inputs.clear()

    def step(self, inp: list[torch.Tensor], budgets: list[Any]) -> tuple[float, float, int]:
        """One training-step attention: estimate, forward, backward. Returns (estimate s,
        forward+backward s, computed pairs); synchronised on the device."""
        q, k, v, do = inp
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        self.sync()
        t0 = self.clock()
        plan = mtrain.estimate_pattern(
            q, k, budgets, granularity=self.granularity, deterministic=self.deterministic
        )
        self.sync()
        t1 = self.clock()
        out = mtrain.attention(qg, kg, vg, pattern=plan, deterministic=self.deterministic)
        out.backward(do)
        self.sync()
        t2 = self.clock()
        return t1 - t0, t2 - t1, int(plan.computed_pairs)

    def measure(
        self, n: int, budgets: list[Any], seed: int, vary: bool, reps: int, warmup: int
    ) -> dict[str, Any]:
        inp = self.inputs(n, seed, vary)
        runs = [self.step(inp, budgets) for _ in range(warmup + reps)][warmup:]
        tot = [e + f for e, f, _ in runs]
        return {
            "tokens": n,
            "estimate_s": statistics.median(e for e, _, _ in runs),
            "fwdbwd_s": statistics.median(f for _, f, _ in runs),
            "step_s": statistics.median(tot),
            "reps_s": tot,
            "density": runs[-1][2] / (n * (n + 1) / 2 * self.hq),
        }

    def linear(self, n: int, shapes: list[tuple[int, int]], reps: int, warmup: int) -> float:
        """Median seconds of forward + backward of x[n, a] @ W[a, b] for every (a, b)."""
        ws = [torch.randn(a, b, device=self.device, dtype=self.dtype) * a**-0.5 for a, b in shapes]
        xs = {a: torch.randn(n, a, device=self.device, dtype=self.dtype) for a, _ in shapes}

        def once() -> float:
            self.sync()
            t0 = self.clock()
            for (a, _), w in zip(shapes, ws, strict=True):
                x = xs[a].detach().requires_grad_(True)
                wg = w.detach().requires_grad_(True)
                y = x @ wg
                y.backward(torch.ones_like(y))
            self.sync()
            return self.clock() - t0

        times = [once() for _ in range(warmup + reps)][warmup:]
        return statistics.median(times)


# ---- the assignments --------------------------------------------------------------------------


def mass_curves(a: argparse.Namespace, budget_file: str, num_layers: int, runner: Runner) -> Any:
    """Every layer's mass curve on structured inputs (seed 1000 + layer), as mtrain-balance batch
    computes them, with this run's heads and head dim."""
    rows = []
    for layer in range(num_layers):
        q, k, _, _ = (
            t.float().cpu()
            for t in runner.inputs(a.profile_len, 1000 + layer, vary=False, keep=False)
        )
        rows.append(
            mtrain.mass_curve(
                q, k, budget_file, layer, levels=a.levels, budget_context=a.profile_context
            )
        )
    return np.concatenate(rows, axis=0)


def assign(
    a: argparse.Namespace,
    method: str,
    lengths: list[int],
    budget_file: str,
    calibration: Any,
    mass: Any,
) -> mtrain.BalanceResult:
    split = "+split" in method
    tuned = method.endswith("+tuned")
    base = method.split("+", maxsplit=1)[0]
    model = (
        {
            "hidden": a.hidden,
            "intermediate": a.intermediate,
            "vocab": a.vocab,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
        }
        if a.linear
        else {"hidden": 0}
    )
    return mtrain.balance_batch(
        lengths,
        a.world,
        budget_file,
        calibration,
        method=base,
        tune=tuned,
        mass=mass if tuned else None,
        levels=a.levels,
        bounds=a.bounds,
        budget_context=a.budget_context,
        spread=a.spread,
        granularity=a.granularity,
        model=model,
        split_above=a.split_above if split else 0.0,
        ring_overhead=a.ring_overhead,
        max_split=a.max_split,
    )


def linear_flops_per_token(a: argparse.Namespace, layers: int) -> float:
    """The predictor's linear FLOPs per token (docs/BALANCE.md, "The cost predictor")."""
    h, hq, hkv, d, inter = a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate
    return 6.0 * (layers * (2 * h * hq * d + 2 * h * hkv * d + 3 * h * inter) + h * a.vocab)


class PairCounter:
    """The pairs the cost predictor counts (mtrain_balance_head_pairs: the position model's
    pairs for a head at a level) for one call: a length, a layer and its heads' scales."""

    def __init__(self, a: argparse.Namespace, budget_file: str) -> None:
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
        pm = B._PositionModel(30, 100, B._SPREADS[a.spread], 0, int(a.budget_context))
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
    a: argparse.Namespace, budget_file: str, points: list[tuple[int, int]]
) -> dict[tuple[int, int], int]:
    """PairCounter.count at the untuned level for each (length, layer)."""
    pc = PairCounter(a, budget_file)
    try:
        return {(n, layer): pc.count(n, layer, (1.0,) * a.heads) for n, layer in points}
    finally:
        pc.close()


def fit_calibration(
    a: argparse.Namespace,
    lengths: list[int],
    measure_key: Callable[[tuple], dict[str, Any]],
    linear_s: dict[int, float],
    layers: int,
    budget_file: str,
    say: Callable[[str], None],
) -> tuple[dict[str, float], dict[str, Any]]:
    """--fit-calibration: a calibration fitted on this run's own measurements, as
    mtrain-balance-calibrate fits one: one call (estimate + forward + backward of one layer) at
    --fit-points lengths (log-spaced among the workload's distinct ones, the shortest and the
    longest included) at every measured layer, untuned budgets; seconds = pair_s * pairs (the
    predictor's own count: the position model's allowed pairs, as the predictor will multiply
    them; the estimated plan's computed pairs are reported beside them) + row_s * N * heads +
    seq_s, least squares on the
    relative error, non-negative (the best subset of the three terms). linear_flops: the
    measured linear layers at the longest length (with --linear), else the file's."""
    ns = sorted(set(lengths))
    c = min(a.fit_points, len(ns))
    pick = sorted({ns[round(j * (len(ns) - 1) / max(c - 1, 1))] for j in range(c)})
    rows, ys, pts = [], [], []
    counted = predictor_pairs(a, budget_file, [(n, layer) for n in pick for layer in a.layers])
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
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 8):  # every non-empty subset of the three terms
        cols = [t for t in range(3) if mask >> t & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols] / y[:, None], np.ones_like(y), rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        res = float(np.sum((x @ full / y - 1) ** 2))
        if best is None or res < best[0]:
            best = (res, full)
    assert best is not None  # one term alone always fits with a non-negative coefficient
    coef = best[1]
    with open(a.calibration) as f:
        flops = float(json.load(f).get("linear_flops", 0.0))
    if a.linear and linear_s:
        n = max(linear_s)
        flops = linear_flops_per_token(a, layers) * n / linear_s[n]
    cal = {"pair_s": coef[0], "row_s": coef[1], "seq_s": coef[2], "linear_flops": flops}
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
        f"{coef[2]:.4g} s, linear_flops {flops:.4g}; in-sample error max "
        f"{100 * float(np.abs(err).max()):.1f}%, mean {100 * float(np.abs(err).mean()):.1f}%"
    )
    return cal, {"points": pts, "calibration": cal, "replaces": a.calibration}


def base_scale(levels: Sequence[float], bounds: tuple[float, float] | None) -> float:
    """The level a split document runs at: 1 clamped into the bounds (as the solver does)."""
    if bounds is None or bounds[0] <= 1.0 <= bounds[1]:
        return 1.0
    inside = [s for s in levels if bounds[0] <= s <= bounds[1]]
    return inside[0] if bounds[0] > 1.0 else inside[-1]


# ---- main -------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="balance_measure.py",
        description=__doc__.split("\n\n")[0] if __doc__ else "",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]) if __doc__ else None,
    )
    w = ap.add_argument_group("workload (as mtrain-balance batch)")
    w.add_argument("--budgets", required=True, help="MInference budget file (every layer)")
    w.add_argument("--calibration", required=True, help="calibration JSON (data/calibration/)")
    src = w.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--long-tail", action="store_true", help="mtrain-balance batch's long-tail mix"
    )
    src.add_argument("--lengths", help="file of lengths, one per line")
    src.add_argument("--equal", type=int, metavar="N", help="--count documents of N tokens each")
    w.add_argument("--count", type=int, default=0, help="documents with --equal")
    w.add_argument("--tokens-per-rank", type=int, default=1048576, help="long-tail (1048576)")
    w.add_argument("--long-prob", type=float, default=0.02, help="long-tail (0.02)")
    w.add_argument("--seed", type=int, default=1, help="long-tail generator seed (1)")
    w.add_argument("--world", type=int, required=True, help="data-parallel ranks R")
    w.add_argument(
        "--methods",
        default="tokens,cost,cost+tuned",
        help=f"comma list of {', '.join(METHODS)}; tokens is always added (the baseline)",
    )
    w.add_argument("--split-above", type=float, default=1.0, help="split methods' X (1)")
    w.add_argument("--ring-overhead", type=float, default=1.01, help="split methods' F (1.01)")
    w.add_argument("--max-split", type=int, default=0, help="most ranks per document (0: R)")
    w.add_argument(
        "--levels",
        default="0.25,0.5,0.75,1,1.5,2",
        help="tuning's budget scales (0.25,0.5,0.75,1,1.5,2)",
    )
    w.add_argument("--bounds", help="LO,HI: the scales the tuner may choose (default all)")
    w.add_argument("--budget-context", type=int, default=0, help="scale budgets by N / C (0)")
    w.add_argument("--spread", default="even", choices=("even", "local"), help="position model")
    w.add_argument("--granularity", type=int, default=128, help="block size G (128)")
    w.add_argument("--profile-len", type=int, default=2048, help="mass curves' tokens (2048)")
    w.add_argument(
        "--profile-context",
        type=int,
        default=None,
        help="mass curves' budget context (131072, divided by S with --scale-budgets)",
    )
    m = ap.add_argument_group("measurement")
    m.add_argument("--backend", default="cpu", help="cpu (default) or cuda")
    m.add_argument("--dtype", default=None, help="float32 (cpu default), bfloat16 (cuda default)")
    m.add_argument("--heads", type=int, default=16, help="query heads per layer (16)")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads (2)")
    m.add_argument("--head-dim", type=int, default=128, help="head dimension (128)")
    m.add_argument(
        "--layers", default="0,15,31", help="layers measured, the rest extrapolated (0,15,31)"
    )
    m.add_argument("--scale", type=int, default=1, help="divide every length by S (1)")
    m.add_argument(
        "--scale-budgets",
        action="store_true",
        help="divide the budget counts by S too (the density of the full-size run)",
    )
    m.add_argument("--reps", type=int, default=3, help="timed repetitions, median (3)")
    m.add_argument("--warmup", type=int, default=1, help="untimed runs first (1)")
    m.add_argument("--grid", type=int, default=0, help="G > 1: measure G lengths, interpolate")
    m.add_argument("--grid-check", type=int, default=3, help="off-grid lengths measured (3)")
    m.add_argument(
        "--validate",
        type=int,
        default=0,
        help="the last method's first K ranks run whole (additivity)",
    )
    m.add_argument(
        "--validate-reps", type=int, default=1, help="whole runs per validated rank, median (1)"
    )
    m.add_argument("--deterministic", action="store_true", help="deterministic backward")
    m.add_argument(
        "--clock",
        default="wall",
        help="wall (default) or process: CPU seconds of this process (cpu backend; use with "
        "--threads 1 on a shared machine: the other jobs' load does not count)",
    )
    m.add_argument(
        "--threads",
        type=int,
        default=0,
        help="T >= 1: MTRAIN_NUM_THREADS and torch's threads (cpu; 0: as the environment says)",
    )
    m.add_argument(
        "--linear",
        action="store_true",
        help="also time (and predict) the linear layers; else attention only",
    )
    m.add_argument(
        "--linear-chunk",
        type=int,
        default=16384,
        help="the linear layers are timed at the lengths up to this (on the --grid's points when "
        "set; log-log between them) and longer documents' scaled in proportion (16384)",
    )
    m.add_argument("--hidden", type=int, default=2048, help="--linear: hidden size (2048)")
    m.add_argument("--intermediate", type=int, default=11008, help="--linear: MLP (11008)")
    m.add_argument("--vocab", type=int, default=151936, help="--linear: vocabulary (151936)")
    m.add_argument(
        "--fit-calibration",
        action="store_true",
        help="fit pair_s, row_s, seq_s (and linear_flops) on this run's measurements first and "
        "balance with that table (in-sample: the best the cost model can do here)",
    )
    m.add_argument("--fit-points", type=int, default=8, help="lengths of the fit (8)")
    m.add_argument("--json", help="write everything here")
    return ap


def check_args(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Every bad option named; ap.error exits with status 2."""
    methods = [x.strip() for x in a.methods.split(",") if x.strip()]
    bad = [x for x in methods if x not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: unknown {bad or methods} (known: {', '.join(METHODS)})")
    a.methods = ["tokens"] + [x for x in methods if x != "tokens"]
    if a.world < 1:
        ap.error(f"--world {a.world} must be >= 1")
    if a.scale < 1:
        ap.error(f"--scale {a.scale} must be >= 1")
    if a.backend not in ("cpu", "cuda"):
        ap.error(f"--backend {a.backend!r} is not cpu or cuda")
    if a.backend == "cuda" and not torch.cuda.is_available():
        ap.error("--backend cuda: torch sees no CUDA device")
    if a.backend not in mtrain.backends():
        ap.error(f"--backend {a.backend}: the library has {mtrain.backends()}")
    a.dtype = a.dtype or ("bfloat16" if a.backend == "cuda" else "float32")
    if a.dtype not in ("float32", "bfloat16", "float16"):
        ap.error(f"--dtype {a.dtype!r} is not float32, bfloat16 or float16")
    for name in (
        "heads",
        "kv_heads",
        "head_dim",
        "reps",
        "granularity",
        "profile_len",
        "linear_chunk",
        "validate_reps",
        "fit_points",
    ):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.heads % a.kv_heads:
        ap.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.clock not in ("wall", "process"):
        ap.error(f"--clock {a.clock!r} is not wall or process")
    if a.clock == "process" and a.backend != "cpu":
        ap.error("--clock process times the host only: use it with --backend cpu")
    if a.threads < 0:
        ap.error(f"--threads {a.threads} must be >= 0")
    if a.warmup < 0 or a.validate < 0 or a.grid < 0 or a.grid_check < 0:
        ap.error("--warmup, --validate, --grid and --grid-check must be >= 0")
    if a.grid == 1:
        ap.error("--grid needs at least 2 lengths (0: measure every distinct length)")
    if a.validate > a.world:
        ap.error(f"--validate {a.validate} exceeds --world {a.world}")
    if a.equal is not None and (a.equal < 1 or a.count < 1):
        ap.error("--equal N needs N >= 1 and --count C >= 1")
    if a.equal is None and a.count:
        ap.error("--count goes with --equal")
    if a.tokens_per_rank < 1 or not 0 <= a.long_prob <= 1:
        ap.error("--tokens-per-rank must be >= 1 and --long-prob in [0, 1]")
    try:
        a.levels = [float(x) for x in a.levels.split(",")]
        a.bounds = tuple(float(x) for x in a.bounds.split(",")) if a.bounds else None
        a.layers = _ints(a.layers)
    except ValueError as e:
        ap.error(f"bad number: {e}")
    if a.bounds is not None and len(a.bounds) != 2:
        ap.error("--bounds takes LO,HI")
    if a.profile_context is None:
        a.profile_context = 131072 // a.scale if a.scale_budgets else 131072
    for path in (a.budgets, a.calibration, a.lengths):
        if path and not os.path.isfile(path):
            ap.error(f"{path}: no such file")


def _stats(xs: Sequence[float]) -> dict[str, float]:
    mx, mean = max(xs), sum(xs) / len(xs)
    return {"max": mx, "mean": mean, "max_over_mean": mx / mean if mean > 0 else float("nan")}


def run(argv: Sequence[str] | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Parses argv, measures, prints the tables, returns (and with --json writes) the result."""
    say = log or (lambda s: print(s, flush=True))
    ap = parser()
    a = ap.parse_args(argv)
    check_args(a, ap)
    t_start = time.perf_counter()
    if a.threads:
        os.environ["MTRAIN_NUM_THREADS"] = str(a.threads)
        torch.set_num_threads(a.threads)
    if a.long_tail:
        full = long_tail(a.world, a.tokens_per_rank, a.long_prob, a.seed)
        source = f"long-tail (seed {a.seed}, {a.tokens_per_rank} tokens per rank, p {a.long_prob})"
    elif a.lengths:
        full = read_lengths(a.lengths)
        source = f"lengths from {a.lengths}"
    else:
        full = [a.equal] * a.count
        source = f"{a.count} documents of {a.equal} tokens"
    lengths = [scale_length(n, a.scale, a.granularity) for n in full]
    file_layers = read_budgets(a.budgets)
    nl = len(file_layers)
    if any(not 0 <= x < nl for x in a.layers):
        ap.error(f"--layers {a.layers}: the budgets have layers 0..{nl - 1}")
    budgets = derive_budgets(file_layers, a.heads, a.scale if a.scale_budgets else 1)
    per_document = any(b["kind"] == "topp" for layer in a.layers for b in budgets[layer])
    if per_document and a.fit_calibration:
        ap.error("--fit-calibration needs top-k budgets (top-p patterns depend on the inputs)")
    runner = Runner(a)
    tmp = tempfile.TemporaryDirectory(prefix="balance_measure_")
    budget_file = os.path.join(tmp.name, "budgets.json")
    write_budgets(budgets, budget_file)
    say(
        f"balance_measure: {source}: {len(lengths)} documents, {sum(full)} tokens; scale 1/"
        f"{a.scale}: {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}, "
        f"{len(set(lengths))} distinct"
    )
    say(
        f"device {a.backend} ({_device_name(a.backend)}), {a.dtype}, {a.heads}:{a.kv_heads} heads, "
        f"d {a.head_dim}, layers {a.layers} measured of {nl} (the rest extrapolated: x "
        f"{nl / len(a.layers):.3g}), budgets {a.budgets}"
        + (f" counts / {a.scale}" if a.scale_budgets and a.scale > 1 else "")
        + f", {'attention + linear layers' if a.linear else 'attention only'}, median of "
        f"{a.reps} after {a.warmup} warm-up, clock {a.clock}"
    )
    meas: dict[tuple, dict[str, Any]] = {}
    grid_report: list[dict[str, Any]] = []
    pairs = PairCounter(a, budget_file)

    def measure_key(k: tuple) -> dict[str, Any]:
        if k not in meas:
            doc, n, layer, scales = k
            hb = head_budgets(budgets[layer], scales, n, a.budget_context)
            seed = doc_seed(doc, layer, per_document) if per_document else 1
            r = runner.measure(n, hb, seed, per_document, a.reps, a.warmup)
            r.update({"layer": layer, "document": doc, "scales": list(scales)})
            r["computed_pairs"] = r["density"] * n * (n + 1) / 2 * a.heads
            r["predicted_pairs"] = pairs.count(n, layer, scales)
            meas[k] = r
            say(
                f"  measured layer {layer:3d} N {n:7d}"
                + (f" doc {doc:5d}" if per_document else "")
                + f" density {r['density']:.4f} (computed / predicted pairs "
                f"{r['computed_pairs'] / max(r['predicted_pairs'], 1):.3f}) estimate "
                f"{1e3 * r['estimate_s']:9.2f} ms fwd+bwd {1e3 * r['fwdbwd_s']:9.2f} ms"
            )
        return meas[k]

    linear_s: dict[int, float] = {}
    if a.linear:
        h, hq, hkv, d = a.hidden, a.heads, a.kv_heads, a.head_dim
        per_layer = [(h, hq * d), (h, hkv * d), (h, hkv * d), (hq * d, h), (h, a.intermediate)]
        per_layer += [(h, a.intermediate), (a.intermediate, h)]
        ns = sorted(set(lengths))
        top = min(ns[-1], a.linear_chunk)
        pts = [n for n in ns if n <= top] + ([top] if ns[-1] > top else [])
        if a.grid and len(pts) > a.grid:  # log-spaced, as the attention's grid
            lo, hi = math.log(pts[0]), math.log(top)
            ticks = (lo + (hi - lo) * j / (a.grid - 1) for j in range(a.grid))
            pts = sorted({scale_length(round(math.exp(x)), 1, a.granularity) for x in ticks})
            pts = sorted(set(pts) | {ns[0], top})
        lin = {}
        for n in pts:
            one = runner.linear(n, per_layer, a.reps, a.warmup)
            head = runner.linear(n, [(h, a.vocab)], a.reps, a.warmup)
            lin[n] = nl * one + head
            say(f"  linear N {n:7d}: {nl} x {1e3 * one:.2f} ms + LM head {1e3 * head:.2f} ms")
        gx = np.log(np.array(pts, dtype=np.float64))
        gy = np.log(np.array([lin[n] for n in pts]))
        for n in ns:  # log-log between the points; proportional to the tokens above the chunk
            t = lin[n] if n in lin else float(np.exp(np.interp(math.log(min(n, top)), gx, gy)))
            linear_s[n] = t * n / top if n > top else t
    calibration: Any = a.calibration
    fit_report: dict[str, Any] | None = None
    if a.fit_calibration:
        calibration, fit_report = fit_calibration(
            a, lengths, measure_key, linear_s, nl, budget_file, say
        )
    mass = None
    if any(m.endswith("+tuned") for m in a.methods):
        t0 = time.perf_counter()
        mass = mass_curves(a, budget_file, nl, runner)
        say(f"mass curves: {nl} layers at {a.profile_len} tokens, {time.perf_counter() - t0:.1f} s")
    results: dict[str, mtrain.BalanceResult] = {}
    for method in a.methods:
        t0 = time.perf_counter()
        results[method] = assign(a, method, lengths, budget_file, calibration, mass)
        say(f"assignment {method}: {time.perf_counter() - t0:.2f} s")
    base = base_scale(a.levels, a.bounds)
    hoff = [0]
    for layer in budgets:
        hoff.append(hoff[-1] + len(layer))

    def scales_of(res: mtrain.BalanceResult, method: str, doc: int, rank: int, layer: int) -> tuple:
        if method.endswith("+tuned") and len(res.ranks_of[doc]) == 1:
            return tuple(float(x) for x in res.head_scales[rank, hoff[layer] : hoff[layer + 1]])
        return (base,) * a.heads

    # every (document on a rank, layer) of every method -> a measurement key
    def key(doc: int, n: int, layer: int, scales: tuple) -> tuple:
        return (doc if per_document else -1, n, layer, scales)

    needed: set[tuple] = set()
    for method, res in results.items():
        for i, ranks in enumerate(res.ranks_of):
            for layer in a.layers:
                needed.add(key(i, lengths[i], layer, scales_of(res, method, i, ranks[0], layer)))
    t_meas = time.perf_counter()
    # plan every measurement first (grid points, off-grid checks), then measure in order of
    # length, so that one input set at a time is on the device
    todo: set[tuple] = set()
    grids: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
    if a.grid and not per_document:
        groups: dict[tuple, set[int]] = {}
        for _, n, layer, scales in needed:
            groups.setdefault((layer, scales), set()).add(n)
        for (layer, scales), group in sorted(groups.items()):
            ns = sorted(group)
            if len(ns) <= a.grid:
                todo.update((-1, n, layer, scales) for n in ns)
                continue
            lo, hi = math.log(ns[0]), math.log(ns[-1])
            ticks = (lo + (hi - lo) * j / (a.grid - 1) for j in range(a.grid))
            pts = sorted({scale_length(round(math.exp(x)), 1, a.granularity) for x in ticks})
            pts = sorted(set(pts) | {ns[0], ns[-1]})
            off = [n for n in ns if n not in pts]
            c = min(a.grid_check, len(off))
            checks = [off[int((j + 0.5) * len(off) / c)] for j in range(c)]
            grids[(layer, scales)] = (ns, pts, checks)
            todo.update((-1, n, layer, scales) for n in pts + checks)
    else:
        todo = set(needed)
    for k in sorted(todo, key=lambda k: (k[1], k[0], k[2], k[3])):
        measure_key(k)
    value: dict[tuple, float] = {k: meas[k]["step_s"] for k in needed if k in meas}
    for (layer, scales), (ns, pts, checks) in sorted(grids.items()):
        gx = np.log(np.array(pts, dtype=np.float64))
        gy = np.log(np.array([meas[(-1, n, layer, scales)]["step_s"] for n in pts]))
        interp = {n: float(np.exp(np.interp(math.log(n), gx, gy))) for n in ns}
        for n in ns:
            value[(-1, n, layer, scales)] = interp[n]
        grid_report.append(
            {
                "layer": layer,
                "scales": list(scales),
                "grid": pts,
                "lengths": len(ns),
                "checks": [
                    {
                        "tokens": n,
                        "measured_s": meas[(-1, n, layer, scales)]["step_s"],
                        "interpolated_s": interp[n],
                        "rel_error": interp[n] / meas[(-1, n, layer, scales)]["step_s"] - 1,
                    }
                    for n in checks
                ],
            }
        )
    runner.forget()
    t_meas = time.perf_counter() - t_meas
    say(f"measurement: {len(meas)} (length, layer, budgets) points, {t_meas:.1f} s")
    noise = None
    if a.reps >= 2:
        spread_r = sorted(max(m["reps_s"]) / min(m["reps_s"]) for m in meas.values())
        noise = {
            "median": statistics.median(spread_r),
            "max": spread_r[-1],
            "share_above_1.2": sum(x > 1.2 for x in spread_r) / len(spread_r),
        }
        say(
            f"repetition spread (max/min of the {a.reps} timed runs of a point): median "
            f"{noise['median']:.3f}x, max {noise['max']:.3f}x, "
            f"{100 * noise['share_above_1.2']:.0f}% of the points above 1.2x"
        )
    ratios = [
        m["computed_pairs"] / m["predicted_pairs"] for m in meas.values() if m["predicted_pairs"]
    ]
    say(
        f"pairs: the plans computed {min(ratios):.3f}-{max(ratios):.3f}x the pairs the predictor "
        "counts (every measured point)"
    )
    factor = nl / len(a.layers)

    def doc_seconds(method: str, res: mtrain.BalanceResult, i: int, rank: int) -> float:
        s = sum(
            value[key(i, lengths[i], layer, scales_of(res, method, i, rank, layer))]
            for layer in a.layers
        )
        return s * factor + linear_s.get(lengths[i], 0.0)

    out_methods: dict[str, Any] = {}
    for method, res in results.items():
        tuned = method.endswith("+tuned")
        pred = np.asarray(res.rank_seconds_after if tuned else res.rank_seconds_before, dtype=float)
        free = [0.0] * a.world
        idle = [0.0] * a.world
        docs_of: list[list[dict[str, Any]]] = [[] for _ in range(a.world)]
        for i in res.split_order:  # the split phase, replayed in the solver's order
            ranks = res.ranks_of[i]
            share = doc_seconds(method, res, i, ranks[0]) / len(ranks)
            start = max(free[r] for r in ranks)
            for r in ranks:
                idle[r] += start - free[r]
                free[r] = start + share
                docs_of[r].append(
                    {"document": i, "tokens": lengths[i], "ranks": len(ranks), "seconds": share}
                )
        for i, ranks in enumerate(res.ranks_of):
            if len(ranks) == 1:
                r = ranks[0]
                t = doc_seconds(method, res, i, r)
                free[r] += t
                docs_of[r].append({"document": i, "tokens": lengths[i], "ranks": 1, "seconds": t})
        measured = np.asarray(free)
        out_methods[method] = {
            "predicted_s": pred.tolist(),
            "measured_s": measured.tolist(),
            "measured_idle_s": idle,
            "predicted_idle_s": np.asarray(res.rank_idle_seconds).tolist(),
            "documents": [len(x) for x in docs_of],
            "tokens": [sum(d["tokens"] // d["ranks"] for d in x) for x in docs_of],
            "rank_documents": docs_of,
            "split_documents": len(res.split_order),
            "report": res.report,
        }
    tok_meas = max(out_methods["tokens"]["measured_s"])
    tok_pred = max(out_methods["tokens"]["predicted_s"])
    for m in out_methods.values():
        pred, meas_s = np.asarray(m["predicted_s"]), np.asarray(m["measured_s"])
        err = pred / meas_s - 1
        shape_err = (pred / pred.mean()) / (meas_s / meas_s.mean()) - 1
        m.update(
            {
                "predicted": _stats(pred.tolist()),
                "measured": _stats(meas_s.tolist()),
                "predicted_step_ratio_vs_tokens": tok_pred / pred.max(),
                "measured_step_ratio_vs_tokens": tok_meas / meas_s.max(),
                "rel_error": err.tolist(),
                "rel_error_max_abs": float(np.abs(err).max()),
                "rel_error_mean_abs": float(np.abs(err).mean()),
                "shape_error_max_abs": float(np.abs(shape_err).max()),
            }
        )
    say("")
    say(
        "per rank: predicted seconds (mtrain.balance_batch, all layers) | measured seconds "
        f"(layers {a.layers} x {factor:.3g}"
        + (" + linear" if a.linear else ", attention only")
        + ") | prediction error = predicted / measured - 1"
    )
    for method, m in out_methods.items():
        say(f"{method}:")
        for r in range(a.world):
            say(
                f"  rank {r:3d}: {m['documents'][r]:5d} docs {m['tokens'][r]:9d} tokens  predicted "
                f"{m['predicted_s'][r]:10.4f} s  measured {m['measured_s'][r]:10.4f} s  error "
                f"{100 * m['rel_error'][r]:+7.1f}%"
            )
    say("")
    say(
        "| method | predicted max/mean | predicted step ratio | measured max/mean | measured step "
        "ratio | error mean abs | error max abs | shape error max abs | split documents |"
    )
    say("|---|---|---|---|---|---|---|---|---|")
    for method, m in out_methods.items():
        say(
            f"| {method} | {m['predicted']['max_over_mean']:.3f} | "
            f"{m['predicted_step_ratio_vs_tokens']:.3f}x | {m['measured']['max_over_mean']:.3f} | "
            f"{m['measured_step_ratio_vs_tokens']:.3f}x | {100 * m['rel_error_mean_abs']:.1f}% | "
            f"{100 * m['rel_error_max_abs']:.1f}% | {100 * m['shape_error_max_abs']:.1f}% | "
            f"{m['split_documents']} |"
        )
    if any(m["split_documents"] for m in out_methods.values()):
        say(
            "split documents: each of their k ranks is charged the document's measured time / k; "
            "the ring's overhead (transfers, waits inside the ring) is NOT measured by this tool"
        )
    for g in grid_report:
        for c in g["checks"]:
            say(
                f"grid layer {g['layer']} ({g['lengths']} lengths, {len(g['grid'])} measured): "
                f"N {c['tokens']} interpolated {c['interpolated_s']:.4g} s measured "
                f"{c['measured_s']:.4g} s error {100 * c['rel_error']:+.1f}%"
            )
    spread = None
    if per_document:
        spread = {}
        for layer in a.layers:
            ts = [r["step_s"] for k, r in meas.items() if k[2] == layer]
            ds = [r["density"] for k, r in meas.items() if k[2] == layer]
            spread[str(layer)] = {
                "documents": len(ts),
                "seconds_min": min(ts),
                "seconds_median": statistics.median(ts),
                "seconds_max": max(ts),
                "seconds_cv": statistics.pstdev(ts) / statistics.mean(ts),
                "density_min": min(ds),
                "density_median": statistics.median(ds),
                "density_max": max(ds),
                "pearson_seconds_density": float(np.corrcoef(ts, ds)[0, 1])
                if len(ts) > 1 and np.std(ds) > 0 and np.std(ts) > 0
                else float("nan"),
            }
            s = spread[str(layer)]
            say(
                f"per-document spread, layer {layer}: {len(ts)} documents, seconds "
                f"{s['seconds_min']:.4g} / {s['seconds_median']:.4g} / {s['seconds_max']:.4g} "
                f"(min / median / max, cv {s['seconds_cv']:.3f}), density {s['density_min']:.4f} / "
                f"{s['density_median']:.4f} / {s['density_max']:.4f}; Pearson(seconds, density) "
                f"{s['pearson_seconds_density']:.2f}"
            )
    validation = validate(
        a, runner, results, out_methods, lengths, budgets, scales_of, key, value, per_document, say
    )
    result = {
        "tool": "balance_measure",
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "device": _device_name(a.backend),
        "backend": a.backend,
        "dtype": a.dtype,
        "torch": torch.__version__,
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "layers_measured": a.layers,
        "layers_total": nl,
        "extrapolation_factor": factor,
        "linear": a.linear,
        "scale": a.scale,
        "scale_budgets": a.scale_budgets,
        "workload": source,
        "lengths_full": full,
        "lengths": lengths,
        "per_document": per_document,
        "reps": a.reps,
        "warmup": a.warmup,
        "clock": a.clock,
        "threads": a.threads,
        "grid": a.grid,
        "grid_checks": grid_report,
        "repetition_spread": noise,
        "measurements": list(meas.values()),
        "linear_s": {str(n): s for n, s in linear_s.items()},
        "calibration": calibration,
        "calibration_fit": fit_report,
        "methods": out_methods,
        "per_document_spread": spread,
        "validation": validation,
        "notes": [
            "predicted: mtrain.balance_batch with the calibration, all layers",
            f"measured: layers {a.layers} timed, times {factor:.6g} for the other layers",
            "split documents: measured time / k per rank; the ring's overhead is not measured",
            "linear layers "
            + ("timed (matmuls only)" if a.linear else "neither timed nor predicted"),
        ],
        "seconds": time.perf_counter() - t_start,
    }
    pairs.close()
    tmp.cleanup()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    say(f"total {result['seconds']:.1f} s")
    return result


def validate(
    a: argparse.Namespace,
    runner: Runner,
    results: dict[str, mtrain.BalanceResult],
    out_methods: dict[str, Any],
    lengths: list[int],
    budgets: list[list[dict[str, Any]]],
    scales_of: Callable[..., tuple],
    key: Callable[..., tuple],
    value: dict[tuple, float],
    per_document: bool,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """--validate K: the first K ranks of the last method run their documents (whole, at the
    measured layers) one after another on their own inputs (seed 1 + document), timed once
    end to end; compared with the sum of those documents' per-key values (medians or grid
    interpolations) at the same layers."""
    out: list[dict[str, Any]] = []
    if not a.validate:
        return out
    method = a.methods[-1]
    res = results[method]
    for r in range(a.validate):
        docs = [i for i, ranks in enumerate(res.ranks_of) if r in ranks]
        if not docs:
            out.append({"method": method, "rank": r, "documents": 0})
            continue
        work = []
        for layer in a.layers:
            for i in docs:
                sc = scales_of(res, method, i, r, layer)
                work.append(
                    (i, layer, head_budgets(budgets[layer], sc, lengths[i], a.budget_context))
                )
        summed = sum(
            value[key(i, lengths[i], layer, scales_of(res, method, i, r, layer))]
            for layer in a.layers
            for i in docs
        )
        seeds = {(i, layer): doc_seed(i, layer, per_document) for i, layer, _ in work}
        inputs = {
            s: runner.inputs(lengths[i], s, per_document, keep=False)
            for (i, _), s in sorted(seeds.items())
        }
        wholes = []
        for _ in range(a.validate_reps):
            runner.sync()
            t0 = runner.clock()
            for i, layer, hb in work:
                runner.step(inputs[seeds[(i, layer)]], hb)
            runner.sync()
            wholes.append(runner.clock() - t0)
        whole = statistics.median(wholes)
        del inputs
        out.append(
            {
                "method": method,
                "rank": r,
                "documents": len(docs),
                "tokens": sum(lengths[i] for i in docs),
                "whole_s": whole,
                "whole_runs_s": wholes,
                "summed_s": summed,
                "rel_diff": whole / summed - 1,
            }
        )
        say(
            f"validate {method} rank {r}: {len(docs)} documents x {len(a.layers)} layers run one "
            f"after another {whole:.4f} s (median of {a.validate_reps}), summed per-length "
            f"values {summed:.4f} s, {100 * (whole / summed - 1):+.1f}%"
        )
    return out


def _device_name(backend: str) -> str:
    if backend == "cuda":
        return torch.cuda.get_device_name()
    threads = os.environ.get("MTRAIN_NUM_THREADS", "unset")
    return f"cpu ({os.cpu_count()} logical cores, MTRAIN_NUM_THREADS={threads})"


def main() -> None:
    run()


if __name__ == "__main__":
    main()
