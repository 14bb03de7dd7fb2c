"""Fits the 3-H100 balance runs' measured per-rank seconds (train-balance/dp3-*.json) on what
each rank was dealt: its tokens, its documents, and the cost predictor's pairs. The deals are
reconstructed from the runs' seeds (the same code as the training program; every step's token
counts are checked against the recorded ones). Prints R^2 and the coefficients of ordinary least
squares with an intercept, over the counted steps of the off, tokens and cost runs together, for
the compute (forward + backward) and the attention seconds; then the training program's own fit
(examples/train/fit.py, --balance-fit: non-negative, on the predictor's pairs, rows, FLOPs and
documents) of the compute seconds, in windows of 10 steps of the off run.

  MTRAIN_LIBRARY=build/libmtrain.so PYTHONPATH=python:. \\
    python docs/device-runs/2026-11-27-h100x4-protocol/fit_rank_times.py [RUNS_DIR]

RUNS_DIR: the folder of the dp3-*.json files (default: train-balance/ beside this file).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from examples.train import dp as DP
from examples.train import fit as FIT
from examples.train.config import RunConfig
from examples.train.train import long_tail

HERE = Path(__file__).resolve().parent
UNIT_PAIRS = {"pair_s": 1.0, "row_s": 0.0, "seq_s": 0.0, "linear_flops": 1e300}


def rows_of(d: dict, scratch: Path) -> list[tuple[float, ...]]:
    """(tokens, documents, pairs, compute s, attention s) per rank and counted step."""
    fields = RunConfig.__dataclass_fields__
    cfg = RunConfig(**{k: v for k, v in d["config"].items() if k in fields})
    m, dp = d["model"], d["dp"]
    v, s = d["arm"]["budgets"]["TopK"]
    bfile = DP.budget_file(cfg.arm, m["heads"], m["layers"], cfg.seq_len, v, s, scratch / "b.json")
    dims = {"hidden": m["hidden"], "intermediate": m["intermediate"], "vocab": 0}
    dims.update(kv_heads=m["kv_heads"], head_dim=m["head_dim"])
    cal = {k: dp["calibration"][k] for k in ("pair_s", "row_s", "seq_s", "linear_flops")}

    def dealer(method: str, table: dict[str, float]) -> DP.Dealer:
        g = dp["granularity"]
        return DP.Dealer(method, 3, bfile, table, g, dims, cfg.sinks, cfg.local_window, "even")

    deal, pairs = dealer(dp["balance"], cal), dealer("off", UNIT_PAIRS)
    units = dealer("off", cal)  # features() prices with the unit tables, whatever the table
    out = []
    for step in d["steps"][3:]:
        lengths = long_tail(cfg).draw(cfg.data_seed, step["step"])
        rank_of, _ = deal.deal(lengths)
        mine = [[n for n, r in zip(lengths, rank_of, strict=True) if r == q] for q in range(3)]
        if [sum(x) for x in mine] != step["dp"]["rank_tokens"]:
            raise RuntimeError(f"step {step['step']}: the reconstructed deal differs")
        for q in range(3):
            p = sum(pairs.seconds(n) for n in mine[q])
            t = step["dp"]
            f = [sum(units.features(n)[k] for n in mine[q]) for k in range(4)]
            out.append((sum(mine[q]), len(mine[q]), p, t["compute_s"][q], t["attention_s"][q], *f))
    return out


def main() -> None:
    runs = ("off", "tokens", "cost")
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "train-balance"
    with tempfile.TemporaryDirectory() as tmp:
        data = {r: rows_of(json.loads((where / f"dp3-mtrain-static-{r}.json")
                                      .read_text()), Path(tmp)) for r in runs}  # fmt: skip
    a = np.array([x for r in runs for x in data[r]])
    print(f"{len(a)} rank-steps ({', '.join(runs)}); documents per rank-step {a[:, 1].mean():.1f}")
    names = ("per token", "per document", "per pair")
    models = ([0], [0, 2], [0, 1], [0, 1, 2])
    for y, name in ((3, "compute"), (4, "attention")):
        for cols in models:
            x = np.c_[np.ones(len(a)), a[:, cols]]
            c, *_ = np.linalg.lstsq(x, a[:, y], rcond=None)
            r2 = 1 - ((a[:, y] - x @ c) ** 2).sum() / ((a[:, y] - a[:, y].mean()) ** 2).sum()
            terms = ["intercept", *(names[i] for i in cols)]
            coef = ", ".join(f"{k} {v:.3g}" for k, v in zip(terms, c, strict=True))
            label = " + ".join(names[i].removeprefix("per ") + "s" for i in cols)
            print(f"{name:9s} ~ {label:26s} R^2 {r2:.3f}  ({coef})")
    print("the program's fit (--balance-fit 10) on the off run:")
    fitted(data["off"])
    for r in runs:
        b = np.array(data[r])
        steps = b.reshape(-1, 3, b.shape[1])
        docs = (steps[:, :, 1].max(1) / steps[:, :, 1].mean(1)).mean()
        print(f"{r:6s}: documents max/mean {docs:.3f}, tokens max/mean "
              f"{(steps[:, :, 0].max(1) / steps[:, :, 0].mean(1)).mean():.3f}")  # fmt: skip


def fitted(data: list[tuple[float, ...]]) -> None:
    """The program's fit in windows of 10 steps (30 samples) of one run."""
    for w in range(0, len(data) // 30 * 30, 30):
        window = data[w : w + 30]
        f = FIT.fit([list(x[5:9]) for x in window], [x[3] for x in window])
        c = dict(zip(FIT.FEATURES, f.coefficients, strict=True))
        print(
            f"  steps {w // 3 + 3}-{w // 3 + 12}: R^2 {f.r2:.3f}, intercept {f.intercept:.3g} s, "
            + ", ".join(f"{k} {v:.3g}" for k, v in c.items())
            + f", dropped {sorted(f.dropped)}, degenerate {f.degenerate}"
        )


if __name__ == "__main__":
    main()
