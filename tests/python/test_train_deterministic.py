"""The training program's --deterministic (docs/TRAINING.md, "The arms"): 1, the default, keeps
mtrain's deterministic backward (the Python API's default); 0 gives every arm that runs mtrain's
attention the fused backward. The option reaches every mtrain.register_transformers call of the
arms, is recorded in the results JSON, is refused unless 0 or 1, and a checkpoint written before
it existed (the deterministic backward) resumes only with 1. Runs of the tiny model at 512
tokens on the CPU (seconds)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import examples.train.arms as arms_mod
from examples.train.arms import Arm, Budget
from examples.train.config import RunConfig, from_args, parser
from examples.train.model import SIZES
from examples.train.train import load_checkpoint, run

N, G = 512, 64


def _config(tmp: Path, deterministic: int, arm: str = "mtrain-static") -> RunConfig:
    return RunConfig(
        arm=arm, task="mix", size="tiny", seq_len=N, steps=2, batch=2, warmup=1, seed=0,
        data_seed=7, eval_seqs=2, eval_batch=2, probe_every=1, dtype="float32", device="cpu",
        granularity=G, deterministic=deterministic,
        out=str(tmp / f"{arm}-{deterministic}.json"),
    )  # fmt: skip


def test_cli() -> None:
    assert from_args(["--arm", "mtrain-static"]).deterministic == 1  # the default
    assert from_args(["--arm", "mtrain-static", "--deterministic", "0"]).deterministic == 0
    assert "--deterministic" in parser().format_help()


def test_bad_value_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--deterministic 2: 0 or 1"):
        run(_config(tmp_path, 2), log=lambda *_: None)


@pytest.mark.parametrize("deterministic", [True, False])
def test_every_arm_passes_it_on(monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """Each arm that runs mtrain's attention registers it with the budget's deterministic."""
    calls: list[dict[str, Any]] = []
    real = arms_mod.mtrain.register_transformers

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(arms_mod.mtrain, "register_transformers", spy)
    heads = SIZES["tiny"].heads
    for name in ("mtrain-full", "mtrain-static", "mtrain-topp", "window", "mtrain-block"):
        budget = Budget(granularity=G, deterministic=deterministic, window_blocks=2)
        before = len(calls)
        Arm(name, heads, budget).set_length(N)
        assert len(calls) == before + 1, name
        assert calls[-1]["deterministic"] is deterministic, (name, calls[-1])
    # the dense arm over a ring or a packed batch runs mtrain's dense pattern
    before = len(calls)
    Arm("dense", heads, Budget(granularity=G, deterministic=deterministic), packed=True).set_length(
        N
    )
    assert len(calls) == before + 1 and calls[-1]["deterministic"] is deterministic


def test_run_records_it(tmp_path: Path) -> None:
    """Both settings train the same model alike (the CPU's fused schedule only reorders sums)
    and the results JSON records the setting."""
    losses = {}
    for deterministic in (1, 0):
        result = run(_config(tmp_path, deterministic), log=lambda *_: None)
        assert result["config"]["deterministic"] == deterministic
        assert result["arm"]["deterministic"] is bool(deterministic)
        losses[deterministic] = [s["loss"] for s in result["steps"]]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_old_checkpoint_resumes_with_one_only(tmp_path: Path) -> None:
    """A checkpoint written before --deterministic (its config has no such key) ran the
    deterministic backward: resuming it with 1 loads, with 0 is refused."""
    cfg = _config(tmp_path, 1)
    saved = asdict(cfg)
    del saved["deterministic"]
    path = tmp_path / "old.ckpt"
    torch.save({"config": saved}, path)
    cfg.resume = str(path)
    assert load_checkpoint(cfg) is not None
    cfg.deterministic = 0
    with pytest.raises(ValueError, match="deterministic: 1 \\(checkpoint\\) != 0"):
        load_checkpoint(cfg)
