"""The run's configuration and its command line (python -m examples.train --help)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from .arms import ARMS, BLOCK_METHODS
from .cp import LAYOUTS, MODES
from .dp import BALANCES, MIXES, SPREADS
from .model import SIZES


@dataclass
class RunConfig:
    arm: str = "dense"
    task: str = "mix"  # mqar, passkey, or mix (alternating sequences)
    size: str = "tiny"
    seq_len: int = 1024
    steps: int = 40
    batch: int = 4
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0  # the weights' seed
    data_seed: int = 1  # the training sequences' seed (evaluation uses data_seed + 10**6)
    eval_seqs: int = 64  # per task
    eval_batch: int = 8
    eval_every: int = 0  # 0: at the end only
    rope_theta: float = 10000.0
    init_from: str = ""  # a checkpoint (--save of an earlier run): context extension
    save: str = ""
    resume: str = ""  # checkpoint file: resumed from when it exists, written while training
    ckpt_every: int = 0  # with --resume: also write the checkpoint every k steps (0: never)
    time_limit: float = 0.0  # with --resume: stop (checkpoint written) after this many seconds
    out: str = "results.json"
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # float32, bfloat16 (autocast; weights and optimiser in float32), float64
    threads: int = 0  # torch CPU threads (0: torch's default)
    cp: str = "auto"  # context parallel: auto (when WORLD_SIZE > 1, torchrun), on, off
    cp_layout: str = "striped"  # the layout of the tokens over the ranks (mtrain.dispatch)
    mix: str = "none"  # long-tail: data parallel over packed documents of many lengths
    mix_long_prob: float = 0.1  # --mix long-tail: the probability of a long document
    balance: str = "off"  # --mix: how documents are dealt to the ranks: off, tokens, cost
    balance_calibration: str = ""  # the cost predictor's table ("": by device)
    balance_spread: str = "even"  # the cost predictor's placement of the budgets: even, local
    balance_tune: int = 0  # --balance cost, mtrain-static: tune per-head budgets, curves every M
    balance_tune_bounds: str = ""  # --balance-tune: the scales the tuner may choose, "LO,HI"
    balance_fit: int = 0  # --balance cost: refit the calibration table every K steps (0: off)
    probe_every: int = 0  # probe (attention timing, pattern stats) every k steps; 0: ~8 probes
    granularity: int = 0  # block size G (0: 64 on CPU, 128 on GPU)
    sinks: int = 30
    local_window: int = 100
    last_q: int = 64
    v_frac: float = 1 / 32
    s_frac: float = 1 / 64
    p_v: float = 0.9
    p_s: float = 0.9
    topp_forced: int = 1  # mtrain-topp: 1 forces the sinks and the local window (top_p_forced)
    window_blocks: int = 0
    match: str = ""  # window arm: a results JSON whose measured density the window matches
    block_method: str = "antidiag"  # mtrain-block: antidiag (XAttention) or meanpool (MoBA)
    block_top_p: float = 0.9
    block_top_k: int = 0  # > 0: top-k instead of top-p (meanpool: required)
    block_stride: int = 8
    block_sinks: int = 1
    block_local: int = 1
    mqar_pairs: int = 16
    mqar_queries: int = 16
    passkey_digits: int = 5
    depth_buckets: int = 8
    num_keys: int = 256
    num_values: int = 256
    num_filler: int = 256
    # the block arm's pattern cache (issue 23), MQAR with distinct keys (issue 19)
    block_refresh: int = 0  # mtrain-block: 0 select every call (no cache); K >= 1: the cache
    block_measure_every: int = 1  # --block-refresh K > 1: measure the recall drop every M windows
    block_measure_rows: int = 0  # 0: BlockPatternCache.measure (exact, fp64, CPU); R: R rows
    mqar_distinct: int = 0  # 1: each MQAR pair queried at most once (Q <= P)
    # the estimating arms' dense fallback (mtrain.attention's dense_above, dense_recheck)
    dense_above: str = ""  # "": never; "auto": the device's threshold; or a density in [0, 1]
    dense_recheck: int = 1  # with --dense-above: a layer found dense re-estimates every K calls
    deterministic: int = 1  # mtrain's attention: 1 the deterministic backward, 0 the fused one


HELP = {
    "block_refresh": "mtrain-block: 0 (default) selects the blocks in every attention call, as "
    "before; K >= 1 keeps each layer's (and batch slot's) pattern in mtrain.BlockPatternCache "
    "and selects anew every K training steps (1: every step, through the cache)",
    "block_measure_every": "--block-refresh K > 1: on the last step of every M-th refresh window "
    "measure the cached pattern's recall against a fresh selection (BlockPatternCache.measure, "
    "fp64 on the CPU, O(N^2): costly at long N); 0: never",
    "block_measure_rows": "--block-refresh K > 1: 0 (default) measures with "
    "BlockPatternCache.measure (every query row, fp64 on the CPU); R > 0: the recall of the "
    "cached and the fresh pattern on R query rows spread over the sequence, on the device (the "
    "probe's recall; affordable at 16K-32K tokens)",
    "mqar_distinct": "1: MQAR queries each pair at most once (needs --mqar-queries <= "
    "--mqar-pairs), so a distance bucket is the distance to the only earlier copy of the key",
    "arm": f"attention arm: {', '.join(ARMS)}",
    "task": "training task: mqar, passkey, or mix (alternating sequences; both evaluated)",
    "size": f"model size preset: {', '.join(SIZES)}",
    "seq_len": "tokens per sequence",
    "steps": "optimiser steps",
    "batch": "sequences per step",
    "lr": "AdamW peak learning rate (linear warm-up, then cosine to 10%%)",
    "warmup": "warm-up steps",
    "seed": "seed of the initial weights",
    "data_seed": "seed of the training sequences (evaluation: data_seed + 10**6)",
    "eval_seqs": "evaluation sequences per task",
    "eval_every": "also evaluate every k steps (0: only at the end)",
    "rope_theta": "RoPE base (raise it when continuing at a longer length)",
    "init_from": "start from this checkpoint (written by --save): context extension",
    "save": "write the final weights here",
    "resume": "checkpoint (weights, optimiser, step, RNG, history): continue from it when it "
    "exists, write it at the end, every --ckpt-every steps and at --time-limit",
    "ckpt_every": "with --resume: write the checkpoint every k steps (0: only at the end or limit)",
    "time_limit": "with --resume: stop after the step that passes this many seconds of this call, "
    "write the checkpoint, skip the final evaluation and --out (0: no limit)",
    "out": "the results JSON file",
    "dtype": "float32, bfloat16 (autocast) or float64 (CPU, mtrain's cpu-ref oracle: for exact "
    "comparisons); auto: bfloat16 on GPU, float32 on CPU",
    "threads": "torch CPU threads (0: default)",
    "cp": "context parallel over a process group: auto (when the launcher sets WORLD_SIZE > 1, "
    "torchrun), on (also for one process), off",
    "cp_layout": "context parallel: the layout of every sequence's tokens over the ranks",
    "mix": "long-tail: data parallel; every step's batch is a long-tail mix of documents of many "
    "lengths up to --seq-len (--batch x --seq-len tokens at least), each rank training on its "
    "documents packed into one varlen sequence (docs/TRAINING.md, 'Data parallel with balancing')",
    "mix_long_prob": "--mix long-tail: probability of a long document ([N/4, N]; else [N/32, N/8])",
    "balance": "--mix: how the documents are dealt to the ranks: off (round-robin), tokens "
    "(mtrain.balance_batch on token counts) or cost (on predicted seconds)",
    "balance_calibration": "--mix: the cost predictor's calibration JSON (default: "
    "data/calibration/cpu-2core.json on the CPU, h200-derived.json on a GPU)",
    "balance_spread": "--balance cost: where the predictor places the budgets' verticals and "
    "slashes beyond the sinks and window: even (spread over the sequence) or local (next to them); "
    "measured (with --balance-tune): priced by the pairs each head's estimated pattern computes "
    "at each budget level on the tuner's curve document",
    "balance_tune": "--balance cost with mtrain-static: SparseBalance's bidirectional tuning of "
    "each rank's per-head budgets every step, from the heads' attention-mass curves refreshed "
    "every M steps (0: off; docs/TRAINING.md, 'Tuning in the training program')",
    "balance_tune_bounds": "--balance-tune: lowest and highest budget scale the tuner may "
    "choose, LO,HI (default: every level, 0.25 to 2)",
    "balance_fit": "--balance cost: price the deal by a calibration table fitted every K steps "
    "from the ranks' measured compute seconds (non-negative least squares of seconds = a + x "
    "pairs + y rows + z FLOPs over the last K steps; the given table prices the first K steps; "
    "0: off; docs/TRAINING.md, 'Pricing fitted from the measured times')",
    "probe_every": "time the attention and read the pattern every k steps (0: about 8 probes)",
    "granularity": "mtrain block size G (0: 64 on CPU, 128 on GPU)",
    "sinks": "mtrain estimate: forced sink keys (top-k; mtrain-topp with --topp-forced 1)",
    "local_window": "mtrain estimate: forced local token diagonals (top-k; mtrain-topp with "
    "--topp-forced 1)",
    "last_q": "mtrain estimate: the last queries that vote",
    "v_frac": "mtrain-static: verticals kept = sinks + v_frac * seq_len",
    "s_frac": "mtrain-static: slashes kept = local_window + s_frac * seq_len",
    "p_v": "mtrain-topp: vertical mass kept",
    "p_s": "mtrain-topp: slash mass kept",
    "topp_forced": "mtrain-topp: 1 keeps the --sinks first keys and the --local-window token "
    "diagonals before any other candidate, as top-k does (the estimate's top_p_forced); 0: top-p "
    "forces nothing (the arm before 2026-11-29)",
    "window_blocks": "window arm: block diagonals computed (0: match the static budget's density)",
    "match": "window arm: width matched to the mean density measured in this results JSON "
    "(for example the mtrain-static run's)",
    "block_method": "mtrain-block: how the blocks are scored: antidiag (XAttention's strided "
    "antidiagonal sums) or meanpool (MoBA's mean-pooled gating, top-k only)",
    "block_top_p": "mtrain-block: the share of each query block's scored mass kept (antidiag)",
    "block_top_k": "mtrain-block: > 0: keep this many key blocks per query block besides the "
    "forced ones instead of top-p (required for meanpool)",
    "block_stride": "mtrain-block, antidiag: the stride S (a divisor of the granularity)",
    "block_sinks": "mtrain-block: the first key blocks forced in",
    "block_local": "mtrain-block: the last key blocks forced in (1: the diagonal block)",
    "mqar_pairs": "MQAR key-value pairs",
    "mqar_queries": "MQAR queries per sequence",
    "passkey_digits": "passkey length in digits",
    "dense_above": "mtrain-static, mtrain-topp, mtrain-full: run torch's dense attention for a "
    "layer whose estimated pattern computes more than this share of the causal pairs (a "
    'density in [0, 1], or "auto": the device\'s measured threshold; "": never)',
    "dense_recheck": "with --dense-above: a layer found dense runs dense for K - 1 more calls "
    "without estimating (1: estimate every call)",
    "deterministic": "the arms that run mtrain's attention: 1 (default, the Python API's) its "
    "deterministic backward, bitwise reproducible; 0 the fused backward (on GPUs dQ added with "
    "atomics in the dK/dV kernel: faster, not reproducible bit for bit; docs/USAGE.md)",
    "depth_buckets": "passkey depth buckets",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.train",
        description="Train a small Qwen2 LM on synthetic long-context tasks with one attention "
        "arm; write a results JSON (docs/TRAINING.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        default = RunConfig.__dataclass_fields__[f.name].default
        kind = type(default)
        choices = {
            "arm": ARMS,
            "cp": MODES,
            "cp_layout": LAYOUTS,
            "block_method": BLOCK_METHODS,
            "mix": MIXES,
            "balance": BALANCES,
            "balance_spread": SPREADS,
        }.get(f.name)
        extra = {"choices": list(choices)} if choices else {}
        p.add_argument(flag, type=kind, default=default, help=HELP.get(f.name, f.name), **extra)
    return p


def from_args(argv: list[str] | None = None) -> RunConfig:
    ns = parser().parse_args(argv)
    return RunConfig(**vars(ns))
