# Measured pricing on a length grid (docs/BALANCE.md, "Pricing on a length grid"): every head's
# pairs per query row of its estimated pattern at every budget level and at several lengths, on
# structured inputs; the table file tools/balance_row_pairs.py writes and the library reads
# (mtrain_balance_predictor_read_row_pairs: balance_measure.py --row-pairs, balance_batch
# row_pairs_file=).

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import mtrain

from .budgets import head_budgets
from .runner import Runner

FORMAT = "mtrain-row-pairs-1"


def measure_layer(
    row: list[dict[str, Any]],
    layer: int,
    lengths: Sequence[int],
    levels: Sequence[float],
    granularity: int,
    runner: Runner,
) -> np.ndarray:
    """[len(lengths), heads, len(levels)]: pairs / n of each head's estimated pattern at each
    level's budgets (counts times the level's scale, as the predictor scales them), on
    structured inputs of n tokens with seed 1000 + layer (the mass curves' inputs)."""
    heads = len(row)
    out = np.zeros((len(lengths), heads, len(levels)))
    for i, n in enumerate(lengths):
        q, k = runner.inputs(n, 1000 + layer, vary=False, keep=False, dout=False)[:2]
        for j, scale in enumerate(levels):
            plan = mtrain.estimate_pattern(
                q, k, head_budgets(row, [scale] * heads, n, 0), granularity=granularity
            )
            pattern = plan.patterns[0]
            for h in range(heads):
                out[i, h, j] = pattern.count_pairs(h) / n
        del q, k
    return out


def measure(
    budgets: list[list[dict[str, Any]]],
    layers: Sequence[int],
    lengths: Sequence[int],
    levels: Sequence[float],
    granularity: int,
    runner: Runner,
    header: dict[str, Any],
    done: dict[int, Any],
    save: Callable[[dict[str, Any]], None],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Measures the layers not in `done` (layer -> [lengths][heads][levels]), saving the table
    after every layer (a long run can be resumed); returns the table."""
    table = dict(header, layers_done={str(k): v for k, v in sorted(done.items())})
    t0 = time.perf_counter()
    for layer in layers:
        if layer in done:
            continue
        t1 = time.perf_counter()
        vals = measure_layer(budgets[layer], layer, lengths, levels, granularity, runner)
        table["layers_done"][str(layer)] = vals.tolist()
        save(table)
        say(
            f"layer {layer}: pairs per row {vals.min():.1f}..{vals.max():.1f}, "
            f"{time.perf_counter() - t1:.1f} s (total {time.perf_counter() - t0:.1f} s)"
        )
    return table
