# The measurement points of tools/balance_measure.py: every distinct (document, length, layer,
# head scales) timed once, and --grid's log-spaced points with their log-log interpolation.

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .budgets import head_budgets
from .pricing import PairCounter
from .runner import Runner, doc_seed
from .workload import scale_length


class Points:
    """The measurements by key (document or -1, length, layer, head scales), in the order taken."""

    def __init__(
        self,
        a: argparse.Namespace,
        runner: Runner,
        budgets: list[list[dict[str, Any]]],
        per_document: bool,
        pairs: PairCounter,
        say: Callable[[str], None],
    ) -> None:
        self.a, self.runner, self.budgets = a, runner, budgets
        self.per_document, self.pairs, self.say = per_document, pairs, say
        self.meas: dict[tuple, dict[str, Any]] = {}
        self.replay: str | None = None  # --replay: the file every point comes from

    def load(self, path: str, records: list[dict[str, Any]]) -> None:
        """--replay: every measured point of an earlier run, by its key; nothing is timed."""
        self.replay = path
        for r in records:
            k = (r["document"], r["tokens"], r["layer"], tuple(float(x) for x in r["scales"]))
            self.meas[k] = r

    def key(self, doc: int, n: int, layer: int, scales: tuple) -> tuple:
        """A (document on a rank, layer)'s measurement key: the document only with top-p."""
        return (doc if self.per_document else -1, n, layer, scales)

    def measure_key(self, k: tuple) -> dict[str, Any]:
        a, meas, per_document = self.a, self.meas, self.per_document
        if k not in meas and self.replay:
            doc, n, layer, scales = k
            raise SystemExit(
                f"balance_measure: --replay {self.replay} has no measurement of layer {layer} "
                f"at {n} tokens" + (f" (document {doc})" if doc >= 0 else "") + " with head "
                f"scales {list(scales)}: run it on the device instead"
            )
        if k not in meas:
            doc, n, layer, scales = k
            hb = head_budgets(self.budgets[layer], scales, n, a.budget_context)
            seed = doc_seed(doc, layer, per_document) if per_document else 1
            r = self.runner.measure(n, hb, seed, per_document, a.reps, a.warmup)
            r.update({"layer": layer, "document": doc, "scales": list(scales)})
            r["computed_pairs"] = r["density"] * n * (n + 1) / 2 * a.heads
            r["predicted_pairs"] = self.pairs.count(n, layer, scales)
            meas[k] = r
            self.say(
                f"  measured layer {layer:3d} N {n:7d}"
                + (f" doc {doc:5d}" if per_document else "")
                + f" density {r['density']:.4f} (computed / predicted pairs "
                f"{r['computed_pairs'] / max(r['predicted_pairs'], 1):.3f}) estimate "
                f"{1e3 * r['estimate_s']:9.2f} ms fwd+bwd {1e3 * r['fwdbwd_s']:9.2f} ms"
            )
        return meas[k]


Grids = dict[tuple, tuple[list[int], list[int], list[int]]]


def plan(a: argparse.Namespace, needed: set[tuple], per_document: bool) -> tuple[set[tuple], Grids]:
    """Every key to measure (with --grid: the grid points and off-grid checks of every group
    (layer, scales) with more than G lengths) and each such group's (lengths, grid, checks)."""
    todo: set[tuple] = set()
    grids: Grids = {}
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
    return todo, grids


def interpolate(
    meas: dict[tuple, dict[str, Any]], needed: set[tuple], grids: Grids
) -> tuple[dict[tuple, float], list[dict[str, Any]]]:
    """Every needed key's seconds (the median, or on a grid the log-log interpolation) and the
    grids' report (their off-grid checks: measured against interpolated)."""
    value: dict[tuple, float] = {k: meas[k]["step_s"] for k in needed if k in meas}
    grid_report: list[dict[str, Any]] = []
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
    return value, grid_report
