"""The training program's mtrain-topp arm with --topp-forced (docs/TRAINING.md, "The arms"): 1,
the default, puts the sinks (keys 0..29) and the local window's block diagonals into every
top-p head's estimated pattern, on the trained model's own q and k; 0 leaves them to the mass
(as the arm did before). The option is recorded in the results JSON, refused unless 0 or 1, and a
checkpoint of the arm written before the option existed resumes only with 0. Two 2-step runs
of the tiny model at 512 tokens on the CPU (seconds)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train.arms import Arm, Budget
from examples.train.config import RunConfig, from_args, parser
from examples.train.model import SIZES
from examples.train.probe import CAPTURE
from examples.train.train import load_checkpoint, run

N, G, SINKS, WINDOW = 512, 64, 30, 100
P = 0.3  # little mass: without forcing, top-p keeps a part of the keys only


def _config(tmp: Path, forced: int) -> RunConfig:
    return RunConfig(
        arm="mtrain-topp", task="mix", size="tiny", seq_len=N, steps=2, batch=2, warmup=1,
        seed=0, data_seed=7, eval_seqs=2, eval_batch=2, probe_every=1, dtype="float32",
        device="cpu", granularity=G, p_v=P, p_s=P, topp_forced=forced,
        out=str(tmp / f"topp-{forced}.json"),
    )  # fmt: skip


def _run(cfg: RunConfig) -> tuple[dict[str, Any], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The run's results and each layer's post-RoPE q, k of its last attention call."""
    with CAPTURE.taking() as taken:
        result = run(cfg, log=lambda *_: None)
    return result, dict(taken)


def test_cli() -> None:
    assert from_args(["--arm", "mtrain-topp"]).topp_forced == 1  # the default
    assert from_args(["--arm", "mtrain-topp", "--topp-forced", "0"]).topp_forced == 0
    assert "--topp-forced" in parser().format_help()


def test_bad_value_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--topp-forced 2: 0 or 1"):
        run(_config(tmp_path, 2), log=lambda *_: None)


def test_pattern_keeps_the_sinks(tmp_path: Path) -> None:
    """On the model's q and k, the arm's estimate (the one its attention makes) keeps keys
    0..29 and the block diagonals of token diagonals 0..99 in every head with --topp-forced 1;
    with 0 the same budgets lose some of them."""
    heads = SIZES["tiny"].heads
    window_blocks = set(range(-(-WINDOW // G) + 1))
    lost = 0
    for forced in (1, 0):
        cfg = _config(tmp_path, forced)
        result, taken = _run(cfg)
        assert result["config"]["topp_forced"] == forced
        assert result["arm"]["estimate"] == {
            "last_q": 64, "num_sinks": SINKS, "window": WINDOW, "top_p_forced": bool(forced),
        }  # fmt: skip
        assert result["arm"]["budgets"] == {"TopP": [P, P, N, N]}
        assert sorted(taken) == list(range(SIZES["tiny"].layers))
        budget = Budget(granularity=G, p_v=P, p_s=P, topp_forced=bool(forced))
        arm = Arm("mtrain-topp", heads, budget)
        arm.set_length(N)
        for layer, (q, k) in taken.items():
            patterns = arm.plan_of(q[None], k[None])
            assert patterns is not None
            for h in range(heads):
                diags, verts = patterns[0].head(h)
                has_sinks = verts[:SINKS] == list(range(SINKS))
                has_window = window_blocks <= set(diags)
                if forced:
                    assert has_sinks and has_window, (layer, h, verts[:SINKS], diags)
                else:
                    lost += not (has_sinks and has_window)
    assert lost > 0, "without forcing every head kept the sinks and the window: a weak test"


def test_old_checkpoint_resumes_with_zero_only(tmp_path: Path) -> None:
    """A checkpoint of the mtrain-topp arm written before --topp-forced (its config has no
    such key) ran without forcing: resuming it with the default 1 is refused, with 0 it loads."""
    cfg = _config(tmp_path, 0)
    saved = asdict(cfg)
    del saved["topp_forced"]
    path = tmp_path / "old.ckpt"
    torch.save({"config": saved}, path)
    cfg.resume = str(path)
    assert load_checkpoint(cfg) is not None
    cfg.topp_forced = 1
    with pytest.raises(ValueError, match="topp_forced: 0 \\(checkpoint\\) != 1"):
        load_checkpoint(cfg)
