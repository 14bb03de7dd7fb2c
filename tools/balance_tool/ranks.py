# The measured rank times of tools/balance_measure.py: a document's seconds from its layers'
# values, and each rank's sum, its split phase replayed in the solver's order.

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

import mtrain


def rank_times(
    a: argparse.Namespace,
    results: dict[str, mtrain.BalanceResult],
    lengths: list[int],
    value: dict[tuple, float],
    key: Callable[..., tuple],
    scales_of: Callable[..., tuple],
    factor: float,
    linear_s: dict[int, float],
) -> dict[str, Any]:
    """Every method's predicted and measured rank seconds, idle times and documents: a split
    document costs each of its k ranks its time / k (the ring's overhead not measured)."""

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
    return out_methods
