"""Resumable training runs (examples/train, --resume; docs/TRAINING.md): a run
cut into calls that each stop at a time limit and resume from the checkpoint
(weights, AdamW state, step counter, RNG, records) gives the same per-step
losses, evaluation and final weights as the same run made in one call; a
checkpoint of another configuration is refused."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train.config import RunConfig
from examples.train.train import run

STEPS = 6


def _cfg(tmp: Path, name: str, arm: str, **kw: Any) -> RunConfig:
    return RunConfig(
        arm=arm, task="mix", size="tiny", seq_len=256, steps=STEPS, batch=2, warmup=2,
        seed=0, data_seed=3, eval_seqs=4, eval_every=3, probe_every=4, dtype="float32",
        device="cpu", threads=1, mqar_pairs=4, mqar_queries=8, out=str(tmp / f"{name}.json"),
        save=str(tmp / f"{name}.pt"), **kw,
    )  # fmt: skip


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


@pytest.mark.parametrize("arm", ["dense", "mtrain-static"])
def test_resume_equals_straight(arm: str, tmp_path: Path) -> None:
    quiet = lambda *_: None  # noqa: E731
    straight = run(_cfg(tmp_path, "straight", arm, s_frac=0.0), log=quiet)
    # a time limit of 1 ns: every call makes one step, writes the checkpoint and stops
    ckpt = tmp_path / "run.ckpt"
    cut = _cfg(tmp_path, "cut", arm, s_frac=0.0, resume=str(ckpt), time_limit=1e-9)
    calls = []
    while True:
        r = run(cut, log=quiet)
        calls.append(r)
        if r.get("complete"):
            break
        assert not (tmp_path / "cut.json").exists()  # no results before the end
        assert len(calls) < STEPS + 1
    assert len(calls) == STEPS and [c["step"] for c in calls[:-1]] == list(range(1, STEPS))
    # measured: bitwise equal on the CPU (one thread, deterministic kernels)
    assert _losses(r) == _losses(straight)
    assert [s["step"] for s in r["steps"]] == list(range(STEPS))
    assert [s["segment"] for s in r["steps"]] == list(range(STEPS))
    assert len(r["segments"]) == STEPS
    assert r["eval"] == straight["eval"] and r["eval_history"] == straight["eval_history"]
    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "cut.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if arm != "dense":
        assert [p["step"] for p in r["probes"]] == [p["step"] for p in straight["probes"]]
        assert r["probes"][0]["layers"] == straight["probes"][0]["layers"]


def test_resume_refuses_another_run(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.ckpt"
    first = run(_cfg(tmp_path, "a", "dense", resume=str(ckpt), time_limit=1e-9), log=print)
    assert first["complete"] is False and ckpt.exists()
    with pytest.raises(ValueError, match="lr"):
        run(_cfg(tmp_path, "a", "dense", resume=str(ckpt), lr=1e-4), log=print)
    # where the results go and how long a call lasts may change
    done = run(_cfg(tmp_path, "b", "dense", resume=str(ckpt)), log=print)
    assert done["complete"] and len(done["steps"]) == STEPS
    assert (tmp_path / "b.json").exists()


def test_steps_zero_evaluates_the_weights(tmp_path: Path) -> None:
    """--steps 0 --init-from W: no training step, the evaluation of W (the device script's
    zeroshot-N runs); it equals the evaluation at the end of the run that wrote W."""
    trained = run(_cfg(tmp_path, "w", "dense"), log=lambda *_: None)
    cfg = _cfg(tmp_path, "zero", "dense", init_from=str(tmp_path / "w.pt"))
    cfg.steps, cfg.save = 0, ""
    r = run(cfg, log=lambda *_: None)
    assert r["steps"] == [] and r["final_loss"] is None and r["tokens_per_s"] is None
    assert r["eval"] == trained["eval"]
