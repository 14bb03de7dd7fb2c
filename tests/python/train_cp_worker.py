"""One rank of the training program's multi-process tests (test_train_cp.py: context parallel;
test_train_dp.py: data parallel with balancing, --mix), started as a
process with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
it opens the process group as ``python -m examples.train`` does (examples.train.train.open_cp),
runs the given jobs one after another on it, and saves each job's results and this rank's final
weights to OUT_DIR/<job>_<rank>.pt, so that the test can compare the ranks with each other and
with one process. A job is {"name", "args" (the command line), "cut": bool}; a cut job is run
with --time-limit 1e-9 (one step per call, a checkpoint between calls) until complete.

    python tests/python/train_cp_worker.py OUT_DIR JOBS_JSON
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train import cp as CP
from examples.train.config import from_args
from examples.train.train import open_cp, run


def run_job(cp: CP.Cp, job: dict[str, Any]) -> dict[str, Any]:
    cfg = from_args(job["args"])
    # the group is the first job's; each job its own layout, checked as open_cp checks it
    # (--mix jobs are data parallel: no layout)
    if cfg.mix == "none":
        CP.check(cfg.arm, cfg.seq_len, cfg.granularity, cfg.cp_layout, cp.world)
    cp = dataclasses.replace(cp, layout=cfg.cp_layout)
    state: dict[str, Any] = {}
    quiet = lambda *_: None  # noqa: E731
    if not job.get("cut"):
        return {"results": run(cfg, quiet, cp, state), "weights": state["model"], "calls": 1}
    cfg.time_limit = 1e-9
    calls = 0
    while True:
        calls += 1
        r = run(cfg, quiet, cp, state)
        if r.get("complete"):
            return {"results": r, "weights": state["model"], "calls": calls}
        if calls > cfg.steps:
            raise RuntimeError(f"{job['name']}: not complete after {calls} calls")


def main() -> None:
    out, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    rank = int(os.environ["RANK"])
    cp = open_cp(from_args(jobs[0]["args"]))
    rc = 0
    try:
        for job in jobs:
            try:
                res = run_job(cp, job)
            except BaseException:
                res = {"error": traceback.format_exc()}
                rc = 1
            torch.save(res, out / f"{job['name']}_{rank}.pt")
            if rc:
                break
    finally:
        CP.finish(cp, rc)  # as the program's main(): teardown, then os._exit


if __name__ == "__main__":
    main()
