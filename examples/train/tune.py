"""SparseBalance's fine balance in the training program (--balance-tune, docs/TRAINING.md, "Tuning
in the training program"): every step the dealt ranks' per-head budget levels are tuned by
mtrain.balance_batch(tune=True) from the heads' attention-mass curves (mtrain.mass_curve on the
model's own q and k, refreshed every M steps), and each rank then runs mtrain-static with its own
per-layer, per-head budget file: straggling ranks lower the budgets of the heads that lose the
least mass per second saved, ranks with idle time raise those that gain the most."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mtrain

from .probe import CAPTURE

LEVELS = mtrain.DEFAULT_LEVELS  # budget scales: 0.25, 0.5, 0.75, 1 (untuned), 1.5, 2


def scaled(x: int, scale: float) -> int:
    """A budget count times a level's scale as the cost predictor counts it: rounded half up,
    at least 1 (0 stays 0); core/balance/predict.c's scaled()."""
    if x <= 0:
        return 0
    return max(1, math.floor(x * scale + 0.5))


def parse_bounds(text: str) -> tuple[float, float] | None:
    """--balance-tune-bounds LO,HI (scales); "" for every level."""
    if not text:
        return None
    parts = text.split(",")
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--balance-tune-bounds {text!r}: two scales LO,HI (e.g. 0.5,1.5)"
        ) from None
    if not (0 < lo <= 1.0 <= hi) or not math.isfinite(hi):
        raise ValueError(
            f"--balance-tune-bounds {text!r}: need 0 < LO <= 1 <= HI (1 is the untuned budget)"
        )
    if not any(lo <= s <= hi for s in LEVELS):
        raise ValueError(f"--balance-tune-bounds {text!r}: holds none of the levels {LEVELS}")
    return lo, hi


def write_budgets(path: Path, v: int, s: int, scales: np.ndarray, layers: int, heads: int) -> Path:
    """A budget file of `layers` x `heads` entries, head (l, h) vertical_and_slash with the
    base counts (v, s) times scales[l * heads + h]."""
    out = []
    for layer in range(layers):
        row = {}
        for h in range(heads):
            sc = float(scales[layer * heads + h])
            row[str(h)] = ["vertical_and_slash", scaled(v, sc), scaled(s, sc), 1.0]
        out.append(row)
    path.write_text(json.dumps(out))
    return path


@dataclass
class Tuner:
    """The tuner's state on one rank. Every rank computes the same result: the mass curves are
    computed on rank 0 and summed over the ranks (zeros elsewhere, so every rank holds rank 0's
    bits), and balance_batch is deterministic."""

    every: int  # refresh the mass curves every `every` steps
    bounds: tuple[float, float] | None
    base_budgets: Path  # the untuned budget file (every layer and head alike)
    v: int
    s: int
    layers: int
    heads: int
    granularity: int
    estimate: dict[str, int]  # last_q, num_sinks, window
    folder: Path
    measure_pairs: bool = False  # also the heads' pairs per query row at every level
    mass: np.ndarray | None = None
    row_pairs: np.ndarray | None = None
    mass_step: int = -1
    curve_s: float = 0.0  # seconds spent on the curves at the last refresh (rank 0)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"--balance-tune {self.every}: refresh every M >= 1 steps (0: off)")

    def due(self, step: int) -> bool:
        return self.mass is None or step % self.every == 0

    def refresh(
        self, step: int, forward: Any, rank: int, all_reduce: Any, device: torch.device
    ) -> None:
        """New mass curves: `forward()` runs the model (no gradient) on one document while the
        attention hands every layer's q and k to CAPTURE, on rank 0; the curves are summed
        over the ranks so that every rank holds rank 0's."""
        t0 = time.perf_counter()
        mass = torch.zeros(self.layers * self.heads, len(LEVELS), dtype=torch.float64)
        pairs = torch.zeros_like(mass)
        if rank == 0:
            with CAPTURE.taking() as taken, torch.no_grad():
                forward()
            missing = [la for la in range(self.layers) if la not in taken]
            if missing:
                raise RuntimeError(f"--balance-tune: no q, k captured for layers {missing}")
            for layer in range(self.layers):
                q, k = taken[layer]
                curve = mtrain.mass_curve(
                    q, k, str(self.base_budgets), layer, levels=LEVELS,
                    granularity=self.granularity, **self.estimate,
                )  # fmt: skip
                mass[layer * self.heads : (layer + 1) * self.heads] = torch.from_numpy(curve)
                if self.measure_pairs:
                    pairs[layer * self.heads : (layer + 1) * self.heads] = self._row_pairs(q, k)
        both = all_reduce(torch.cat([mass, pairs]).to(device)).double().cpu()
        self.mass = both[: len(mass)].numpy()
        if self.measure_pairs:
            self.row_pairs = both[len(mass) :].numpy()
        self.mass_step = step
        self.curve_s = time.perf_counter() - t0

    def _row_pairs(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[heads, levels]: the pairs per query row of each head's estimated pattern on q, k
        (one sequence) at every level's scaled budget (SPEC.md section 1 counts)."""
        n = q.shape[0]
        out = torch.zeros(self.heads, len(LEVELS), dtype=torch.float64)
        for j, sc in enumerate(LEVELS):
            budget = mtrain.TopK(scaled(self.v, sc), scaled(self.s, sc))
            plan = mtrain.estimate_pattern(
                q, k, budget, granularity=self.granularity, **self.estimate
            )
            pattern = plan.patterns[0]
            for h in range(self.heads):
                out[h, j] = pattern.count_pairs(h) / n
        return out

    def rank_budgets(self, scales: np.ndarray, rank: int) -> Path:
        """This rank's tuned budget file (written under the run's scratch folder)."""
        path = self.folder / f"tuned-rank{rank}.json"
        return write_budgets(path, self.v, self.s, scales, self.layers, self.heads)
