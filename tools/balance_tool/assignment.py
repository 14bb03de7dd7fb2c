# The assignments tools/balance_measure.py measures: mtrain.balance_batch per method (with the
# mass curves the tuned methods need) and the budget scales a document runs at on its rank.

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import mtrain

from .budgets import base_scale
from .row_pairs import measure_layer
from .runner import Runner


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


def measured_row_pairs(
    a: argparse.Namespace, budgets: list[list[dict[str, Any]]], n: int, runner: Runner
) -> np.ndarray:
    """--spread measured: [layers x heads, levels] pairs per query row of every head's estimated
    pattern at every level's budgets, on structured inputs of n tokens (seed 1000 + layer, as the
    mass curves), for mtrain.balance_batch(row_pairs=): the length-grid table's measurement
    (row_pairs.measure_layer) at the one length n."""
    return np.concatenate(
        [
            measure_layer(row, layer, [n], a.levels, a.granularity, runner)[0]
            for layer, row in enumerate(budgets)
        ],
        axis=0,
    )


def assign(
    a: argparse.Namespace,
    method: str,
    lengths: list[int],
    budget_file: str,
    calibration: Any,
    mass: Any,
    row_pairs: Any = None,
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
        target_s=getattr(a, "target", 0.0) or None,
        budget_context=a.budget_context,
        spread="even" if a.spread == "measured" else a.spread,
        row_pairs=row_pairs,
        row_pairs_file=getattr(a, "row_pairs", None),
        granularity=a.granularity,
        model=model,
        split_above=a.split_above if split else 0.0,
        ring_overhead=a.ring_overhead,
        max_split=a.max_split,
    )


class Scales:
    """A document's head scales at a layer on a rank: the tuned levels of a whole document under
    a +tuned method, else every head at the base level (1 clamped into the bounds)."""

    def __init__(self, a: argparse.Namespace, budgets: list[list[dict[str, Any]]]) -> None:
        self.base = base_scale(a.levels, a.bounds)
        self.heads = a.heads
        self.hoff = [0]
        for layer in budgets:
            self.hoff.append(self.hoff[-1] + len(layer))

    def __call__(
        self, res: mtrain.BalanceResult, method: str, doc: int, rank: int, layer: int
    ) -> tuple:
        hoff = self.hoff
        if method.endswith("+tuned") and len(res.ranks_of[doc]) == 1:
            return tuple(float(x) for x in res.head_scales[rank, hoff[layer] : hoff[layer + 1]])
        return (self.base,) * self.heads
