"""The predicted balance of the three deals (docs/TRAINING.md, "Data parallel with balancing"):
the mean over 40 steps of the long-tail mix (2048 tokens max, data seed 1) of the predicted
max/mean rank seconds, for the tiny model's arms on 2, 4 and 8 ranks and two batch sizes, with
the CPU table (seq_s 0) and both placements of the position model. Run from the repository root:
PYTHONPATH=python:. python docs/cpu-runs/2026-11-27-train-balance/predicted.py"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
from examples.train import dp as DP

N = 2048
_, CAL = DP.calibration_of("", torch.device("cpu"))
DIMS = {"hidden": 128, "intermediate": 384, "vocab": 0, "kv_heads": 2, "head_dim": 32}
TMP = Path(tempfile.mkdtemp())
print(
    "| arm | spread | ranks | tokens a step | off | tokens | cost |\n|---|---|---|---|---|---|---|"
)
for arm, v, s, spread in (
    ("dense", 0, 0, "even"),
    ("mtrain-static", 94, 132, "even"),
    ("mtrain-static", 94, 132, "local"),
):
    f = DP.budget_file(arm, 4, 2, N, v, s, TMP / f"{arm}.json")
    for world in (2, 4, 8):
        for per_rank in (1, 2):
            lt = DP.LongTail(N, per_rank * N * world, 52)
            row = []
            for method in DP.BALANCES:
                d = DP.Dealer(method, world, f, CAL, 64, DIMS, 30, 100, spread)
                ratios = []
                for step in range(40):
                    lengths = lt.draw(1, step)
                    mm = DP.max_over_mean(d.predicted(lengths, d.deal(lengths)[0]))
                    assert mm is not None
                    ratios.append(mm)
                row.append(f"{statistics.mean(ratios):.3f}")
            print(
                f"| {arm} | {spread} | {world} | {per_rank * N * world} | " + " | ".join(row) + " |"
            )
