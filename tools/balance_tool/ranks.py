# The measured rank times of tools/balance_measure.py: a document's seconds from its layers'
# values, and each rank's sum, its split phase replayed in the solver's order; and the same sums
# of the predictor's prices of the measured layers (the proxy prediction).

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

import mtrain

from .pricing import ProxyPrices

DocSeconds = Callable[[mtrain.BalanceResult, int, int], float]


def _rank_sums(
    world: int, res: mtrain.BalanceResult, lengths: list[int], doc_seconds: DocSeconds
) -> tuple[list[float], list[float], list[list[dict[str, Any]]]]:
    """Every rank's finish time, split-phase waits and documents when a document costs
    doc_seconds(res, document, rank): a split document costs each of its k ranks its time / k
    (the ring's overhead not counted), its group starting when its last member is free."""
    free = [0.0] * world
    idle = [0.0] * world
    docs_of: list[list[dict[str, Any]]] = [[] for _ in range(world)]
    for i in res.split_order:  # the split phase, replayed in the solver's order
        ranks = res.ranks_of[i]
        share = doc_seconds(res, i, ranks[0]) / len(ranks)
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
            t = doc_seconds(res, i, r)
            free[r] += t
            docs_of[r].append({"document": i, "tokens": lengths[i], "ranks": 1, "seconds": t})
    return free, idle, docs_of


def rank_times(
    a: argparse.Namespace,
    results: dict[str, mtrain.BalanceResult],
    lengths: list[int],
    value: dict[tuple, float],
    key: Callable[..., tuple],
    scales_of: Callable[..., tuple],
    factor: float,
    linear_s: dict[int, float],
    prices: ProxyPrices,
) -> dict[str, Any]:
    """Every method's predicted (all layers), proxy-predicted and measured rank seconds, idle
    times and documents. The proxy prices exactly what is measured: the measured layers at the
    document's head scales on its rank, times factor, plus the linear layers, summed per rank as
    the measured seconds are (prices: the predictor's per-call and linear seconds)."""
    out_methods: dict[str, Any] = {}
    for method, res in results.items():
        tuned = method.endswith("+tuned")
        pred = np.asarray(res.rank_seconds_after if tuned else res.rank_seconds_before, dtype=float)

        def measured(res: mtrain.BalanceResult, i: int, rank: int, method: str = method) -> float:
            s = sum(
                value[key(i, lengths[i], layer, scales_of(res, method, i, rank, layer))]
                for layer in a.layers
            )
            return s * factor + linear_s.get(lengths[i], 0.0)

        def proxy(res: mtrain.BalanceResult, i: int, rank: int, method: str = method) -> float:
            s = sum(
                prices.call(lengths[i], layer, scales_of(res, method, i, rank, layer))
                for layer in a.layers
            )
            return s * factor + prices.linear(lengths[i])

        free, idle, docs_of = _rank_sums(a.world, res, lengths, measured)
        proxy_s, _, _ = _rank_sums(a.world, res, lengths, proxy)
        out_methods[method] = {
            "predicted_s": pred.tolist(),
            "proxy_s": proxy_s,
            "measured_s": free,
            "measured_idle_s": idle,
            "predicted_idle_s": np.asarray(res.rank_idle_seconds).tolist(),
            "documents": [len(x) for x in docs_of],
            "tokens": [sum(d["tokens"] // d["ranks"] for d in x) for x in docs_of],
            "rank_documents": docs_of,
            "split_documents": len(res.split_order),
            "head_scales": np.asarray(res.head_scales, dtype=float).tolist() if tuned else None,
            "report": res.report,
        }
    return out_methods
