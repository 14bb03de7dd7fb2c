# What tools/balance_measure.py does, in order: the workload and budgets, the assignments, the
# measurements, the rank sums, the tables, --validate, and the result (--json).

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import mtrain

from .assignment import Scales, assign, mass_curves, measured_row_pairs
from .budgets import derive_budgets, read_budgets, write_budgets
from .cli import check_args, parser
from .points import Points, interpolate, plan
from .pricing import PairCounter, ProxyPrices, fit_calibration
from .ranks import rank_times
from .report import (
    _device_name,
    add_stats,
    per_document_spread,
    print_tables,
    repetition_spread,
)
from .runner import Runner, linear_seconds
from .validate import validate
from .workload import long_tail, read_lengths, scale_length


def _workload(a: argparse.Namespace) -> tuple[list[int], str]:
    """The full-size lengths and a line naming where they come from."""
    if a.long_tail:
        full = long_tail(a.world, a.tokens_per_rank, a.long_prob, a.seed)
        source = f"long-tail (seed {a.seed}, {a.tokens_per_rank} tokens per rank, p {a.long_prob})"
    elif a.lengths:
        full = read_lengths(a.lengths)
        source = f"lengths from {a.lengths}"
    else:
        full = [a.equal] * a.count
        source = f"{a.count} documents of {a.equal} tokens"
    return full, source


def _say_setup(
    a: argparse.Namespace,
    source: str,
    full: list[int],
    lengths: list[int],
    nl: int,
    say: Callable[[str], None],
    device: str,
) -> None:
    say(
        f"balance_measure: {source}: {len(lengths)} documents, {sum(full)} tokens; scale 1/"
        f"{a.scale}: {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}, "
        f"{len(set(lengths))} distinct"
    )
    say(
        f"device {a.backend} (" + device + f"), {a.dtype}, {a.heads}:{a.kv_heads} heads, "
        f"d {a.head_dim}, layers {a.layers} measured of {nl} (the rest extrapolated: x "
        f"{nl / len(a.layers):.3g}), budgets {a.budgets}"
        + (f" counts / {a.scale}" if a.scale_budgets and a.scale > 1 else "")
        + f", {'attention + linear layers' if a.linear else 'attention only'}, median of "
        f"{a.reps} after {a.warmup} warm-up, clock {a.clock}"
    )


def _assignments(
    a: argparse.Namespace,
    lengths: list[int],
    budget_file: str,
    calibration: Any,
    nl: int,
    runner: Runner,
    say: Callable[[str], None],
    row_pairs: Any = None,
) -> dict[str, mtrain.BalanceResult]:
    """mtrain.balance_batch for every method (the mass curves first when a method tunes)."""
    mass = None
    if any(m.endswith("+tuned") for m in a.methods):
        t0 = time.perf_counter()
        mass = mass_curves(a, budget_file, nl, runner)
        say(f"mass curves: {nl} layers at {a.profile_len} tokens, {time.perf_counter() - t0:.1f} s")
    results: dict[str, mtrain.BalanceResult] = {}
    for method in a.methods:
        t0 = time.perf_counter()
        results[method] = assign(a, method, lengths, budget_file, calibration, mass, row_pairs)
        say(f"assignment {method}: {time.perf_counter() - t0:.2f} s")
    return results


def _measure(
    a: argparse.Namespace,
    points: Points,
    results: dict[str, mtrain.BalanceResult],
    lengths: list[int],
    scales_of: Scales,
    say: Callable[[str], None],
) -> tuple[dict[tuple, float], list[dict[str, Any]]]:
    """Every (document on a rank, layer) of every method -> a key; all of them planned first
    (grid points, off-grid checks), then measured in order of length, so that one input set at
    a time is on the device. Returns every needed key's seconds and the grids' report."""
    needed: set[tuple] = set()
    for method, res in results.items():
        for i, ranks in enumerate(res.ranks_of):
            for layer in a.layers:
                needed.add(
                    points.key(i, lengths[i], layer, scales_of(res, method, i, ranks[0], layer))
                )
    t_meas = time.perf_counter()
    todo, grids = plan(a, needed, points.per_document)
    for k in sorted(todo, key=lambda k: (k[1], k[0], k[2], k[3])):
        points.measure_key(k)
    value, grid_report = interpolate(points.meas, needed, grids)
    points.runner.forget()
    t_meas = time.perf_counter() - t_meas
    say(f"measurement: {len(points.meas)} (length, layer, budgets) points, {t_meas:.1f} s")
    return value, grid_report


def _replayed_device(a: argparse.Namespace, replayed: dict[str, Any]) -> str:
    return f"{replayed.get('device')} (replayed from {a.replay})"


def _replay(
    a: argparse.Namespace,
    ap: argparse.ArgumentParser,
    r: dict[str, Any],
    lengths: list[int],
    points: Points,
    say: Callable[[str], None],
) -> dict[int, float]:
    """--replay: the earlier run's measurements and linear layers (r, its --json), after
    checking that it measured the same thing (workload, shape, dtype, layers, linear layers,
    grid)."""
    if r.get("tool") != "balance_measure":
        ap.error(f"--replay {a.replay}: not a balance_measure --json file")
    checks = {
        "lengths": (r.get("lengths"), lengths),
        "backend": (r.get("backend"), a.backend),
        "dtype": (r.get("dtype"), a.dtype),
        "heads": (r.get("heads"), a.heads),
        "kv_heads": (r.get("kv_heads"), a.kv_heads),
        "head_dim": (r.get("head_dim"), a.head_dim),
        "layers_measured": (r.get("layers_measured"), a.layers),
        "linear": (r.get("linear"), a.linear),
        "scale_budgets": (r.get("scale_budgets"), a.scale_budgets),
        "grid": (r.get("grid"), a.grid),
    }
    bad = [k for k, (theirs, ours) in checks.items() if theirs != ours]
    if bad:
        ap.error(
            f"--replay {a.replay}: measured another setting ("
            + "; ".join(f"{k}: file {checks[k][0]!r}, here {checks[k][1]!r}" for k in bad[:3])
            + ")"
        )
    points.load(a.replay, r["measurements"])
    say(
        f"replay: {len(r['measurements'])} measured points and the linear layers of "
        f"{a.replay} ({r.get('device')}); nothing is timed in this run"
    )
    return {int(n): float(t) for n, t in r["linear_s"].items()}


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
    full, source = _workload(a)
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
    replayed: dict[str, Any] = {}
    if a.replay:  # read once: its device names this run, its measurements stand in below
        with open(a.replay) as f:
            replayed = json.load(f)
    device = _replayed_device(a, replayed) if a.replay else _device_name(a.backend)
    _say_setup(a, source, full, lengths, nl, say, device)
    row_pairs = None
    if a.row_pairs:
        try:  # the library reads and checks the table (levels, granularity, layers, heads)
            PairCounter(a, budget_file).close()
        except mtrain.MtrainError as e:
            ap.error(f"--row-pairs: {e}")
        with open(a.row_pairs) as f:
            a.row_pairs_lengths = json.load(f)["lengths"]
        say(
            f"pricing: measured pairs per query row of {a.row_pairs} at {a.row_pairs_lengths} "
            "tokens, interpolated in log N"
        )
    elif a.spread == "measured":
        t0 = time.perf_counter()
        row_pairs = measured_row_pairs(a, budgets, max(lengths), runner)
        say(
            f"measured pricing: {nl} layers x {len(a.levels)} levels at {max(lengths)} tokens, "
            f"pairs per query row {row_pairs.min():.1f}..{row_pairs.max():.1f}, "
            f"{time.perf_counter() - t0:.1f} s"
        )
    pairs = PairCounter(a, budget_file, row_pairs)
    points = Points(a, runner, budgets, per_document, pairs, say)
    if a.replay:
        linear_s = _replay(a, ap, replayed, lengths, points, say)
    else:
        linear_s = linear_seconds(a, runner, lengths, nl, say) if a.linear else {}
    calibration: Any = a.calibration
    fit_report: dict[str, Any] | None = None
    if a.fit_calibration:
        calibration, fit_report = fit_calibration(
            a, lengths, points.measure_key, linear_s, nl, budget_file, say, row_pairs
        )
    results = _assignments(a, lengths, budget_file, calibration, nl, runner, say, row_pairs)
    scales_of = Scales(a, budgets)
    value, grid_report = _measure(a, points, results, lengths, scales_of, say)
    noise = repetition_spread(a, points.meas, say)
    factor = nl / len(a.layers)
    prices = ProxyPrices(a, calibration, pairs, nl)
    out_methods = rank_times(
        a, results, lengths, value, points.key, scales_of, factor, linear_s, prices
    )
    add_stats(out_methods)
    print_tables(a, out_methods, factor, grid_report, say)
    spread = per_document_spread(a, points.meas, say) if per_document else None
    validation = validate(
        a, runner, results, out_methods, lengths, budgets, scales_of, points.key, value,
        per_document, say,
    )  # fmt: skip
    result = {
        "tool": "balance_measure",
        "replay": a.replay,
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "device": device,
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
        "measurements": list(points.meas.values()),
        "linear_s": {str(n): s for n, s in linear_s.items()},
        "calibration": calibration,
        "calibration_fit": fit_report,
        "pricing": (
            f"measured pairs per query row on a length grid ({a.row_pairs})"
            if a.row_pairs
            else "measured pairs per query row"
            if row_pairs is not None
            else a.spread
        ),
        "row_pairs": row_pairs.tolist() if row_pairs is not None else None,
        "row_pairs_lengths": a.row_pairs_lengths,
        "methods": out_methods,
        "per_document_spread": spread,
        "validation": validation,
        "notes": [
            "predicted: mtrain.balance_batch with the calibration, all layers",
            f"proxy: the predictor's seconds of layers {a.layers} times {factor:.6g} (+ the "
            "linear layers) at each document's head scales on its rank: what is measured",
            "rel_error, shape_error: proxy / measured; all_layers_*: predicted / measured",
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
