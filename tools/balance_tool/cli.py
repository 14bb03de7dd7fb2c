# The command line of tools/balance_measure.py: the parser (its --help text from usage.py) and
# the checks that name every bad option.

from __future__ import annotations

import argparse
import os

import torch

import mtrain

from .objectives import OBJECTIVES
from .usage import TEXT

METHODS = (
    "tokens",
    "sorted",
    "cost",
    "cost+tuned",
    "tokens+split",
    "cost+split",
    "cost+split+tuned",
)


def _ints(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="balance_measure.py",
        description=TEXT.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(TEXT.split("\n\n")[1:]),
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
    w.add_argument(
        "--target",
        type=float,
        default=0.0,
        help="the tuner's step target in predicted seconds (0: the mean rank time, the default): "
        "below the balanced mean, the tuned methods trade recall for a shorter step",
    )
    w.add_argument("--budget-context", type=int, default=0, help="scale budgets by N / C (0)")
    w.add_argument(
        "--spread",
        default="even",
        choices=("even", "local", "measured"),
        help="the predictor's pricing: the position model's even or local placement, or "
        "measured: every head's pairs per query row from its estimated pattern at each level on "
        "structured inputs of the longest (scaled) length (balance_batch row_pairs; even)",
    )
    w.add_argument(
        "--row-pairs",
        metavar="FILE",
        help="price by a measured table on a length grid (tools/balance_row_pairs.py): every "
        "head's pairs per query row at every level, interpolated in log N between the table's "
        "lengths (balance_batch row_pairs_lengths); replaces --spread",
    )
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
    m.add_argument(
        "--fit-objective",
        default="relative",
        choices=OBJECTIVES,
        help="what --fit-calibration's least squares minimise: relative (x/y - 1, the default), "
        "log (log(x/y)), seconds (x - y) or share (x/y - 1 weighted by each call's share of the "
        "workload's time); also the linear layers' fit",
    )
    m.add_argument(
        "--replay",
        metavar="JSON",
        help="take every measurement (attention calls, linear layers) from the --json of an "
        "earlier run of the same workload, shape and layers instead of timing anything: new "
        "calibrations or methods are evaluated on those measured values; a point the file "
        "lacks is an error (no device needed; --validate and --spread measured refused)",
    )
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
    if a.replay:
        if not os.path.isfile(a.replay):
            ap.error(f"--replay {a.replay}: no such file")
        if a.validate:
            ap.error("--replay runs nothing: --validate needs real runs")
        if a.spread == "measured":
            ap.error("--replay runs nothing: --spread measured needs real estimates")
    else:
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
    if not a.target >= 0 or a.target == float("inf"):
        ap.error(f"--target {a.target} must be finite and >= 0 (0: the mean rank time)")
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
    if a.spread == "measured" and a.budget_context:
        ap.error(
            "--spread measured prices budgets of fixed counts (pairs per query row); "
            "--budget-context scales them with the length"
        )
    if a.row_pairs:
        if a.spread != "even":
            ap.error(f"--row-pairs prices by its table: --spread {a.spread} does not apply")
        if a.budget_context or (a.scale_budgets and a.scale > 1):
            ap.error(
                "--row-pairs holds the budgets as given at full size: --budget-context and "
                "--scale-budgets change them"
            )
        if not os.path.isfile(a.row_pairs):
            ap.error(f"--row-pairs {a.row_pairs}: no such file")
    a.row_pairs_lengths = None
    if a.profile_context is None:
        a.profile_context = 131072 // a.scale if a.scale_budgets else 131072
    for path in (a.budgets, a.calibration, a.lengths):
        if path and not os.path.isfile(path):
            ap.error(f"{path}: no such file")
