# --validate of tools/balance_measure.py: whole ranks run document after document, compared with
# the sum of their per-length values (additivity).

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import mtrain

from .budgets import head_budgets
from .runner import Runner, doc_seed


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
