"""The measurement behind test_train_cp.py's tolerances (docs/TRAINING.md, "Context parallel"):
the test's configurations, dense and mtrain-static, for 3 (weight, data) seeds on one process
and on 2 (striped) and 3 (zigzag) gloo ranks; per case the largest relative per-step loss
difference, the largest weight difference, the weights' difference over the update's norm,
and whether the evaluations are equal. As a yardstick, one process's mtrain-full (mtrain's
dense pattern) against SDPA. Not a test (about 3 minutes on 2 cores):

    MTRAIN_LIBRARY=... PYTHONPATH=python python tests/python/train_cp_measure.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import test_train_cp as T
from examples.train import cp as CP
from examples.train.config import from_args
from examples.train.train import run


def seeded(args: list[str], seed: int, data_seed: int) -> list[str]:
    a = list(args)
    a[a.index("--seed") + 1], a[a.index("--data-seed") + 1] = str(seed), str(data_seed)
    return a


def one_process(args: list[str]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    r = run(from_args(args), lambda *_: None, CP.Cp(), state)
    return {"results": r, "weights": state["model"]}


def compare(got: dict[str, Any], ref: dict[str, Any], init: dict[str, Any]) -> str:
    a, b = T._losses(got["results"]), T._losses(ref["results"])
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    gw, rw = got["weights"], ref["weights"]
    w = max((gw[k] - v).abs().max().item() for k, v in rw.items())
    move = max((v - init[k]).abs().max().item() for k, v in rw.items())
    diff = sum(float((gw[k] - v).square().sum()) for k, v in rw.items()) ** 0.5
    update = sum(float((v - init[k]).square().sum()) for k, v in rw.items()) ** 0.5
    same = got["results"]["eval"] == ref["results"]["eval"]
    return (
        f"loss rel {rel:.2e}, weight abs {w:.2e} (largest move {move:.3e}), "
        f"update rel {diff / update:.2e}, eval equal {same}"
    )


def main() -> None:
    for seed, data_seed in [(0, 7), (1, 8), (2, 9)]:
        tmp = Path(tempfile.mkdtemp(prefix=f"train-cp-{seed}-"))
        init = one_process(
            [*seeded(T._args("dense", tmp, "init"), seed, data_seed), "--steps", "0"]
        )
        ref = {
            a: one_process(seeded(T._args(a, tmp, a), seed, data_seed)) for a in ("dense", "static")
        }
        full = seeded(T._args("dense", tmp, "full"), seed, data_seed)
        full[full.index("--arm") + 1] = "mtrain-full"
        got = compare(one_process(full), ref["dense"], init["weights"])
        print(f"seeds {seed}/{data_seed}, one process, mtrain-full against SDPA: {got}")
        for world, layout in ((2, "striped"), (3, "zigzag")):
            jobs = [
                {"name": arm, "args": seeded(
                    T._args(arm, tmp, f"{arm}{world}", "--cp-layout", layout), seed, data_seed)}
                for arm in ("dense", "static")
            ]  # fmt: skip
            ranks = T.spawn(world, jobs, tmp)
            for arm in ("dense", "static"):
                got = compare(ranks[0][arm], ref[arm], init["weights"])
                print(f"seeds {seed}/{data_seed}, world {world} {layout}, {arm}: {got}", flush=True)


if __name__ == "__main__":
    main()
