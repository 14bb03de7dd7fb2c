"""The training program's dense fallback (--dense-above, --dense-recheck: mtrain.attention's
dense_above and dense_recheck for the estimating arms; docs/TRAINING.md "The arms"). On the CPU,
float32, 6 steps of the tiny model: with --dense-above 0 every layer runs torch's dense attention
after its estimate, so a sparse mtrain-static arm trains as the dense arm does (loss within 1e-5
at every step; the two differ only in how the dense attention is called, while the arm without
the fallback is more than 1e-3 away), with --dense-above 1 never (the run is the arm's own,
bitwise); bad values are refused before training."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train.config import RunConfig
from examples.train.train import run

STEPS = 6


def _train(arm: str, tmp: Path, name: str, **kw: Any) -> dict[str, Any]:
    cfg = RunConfig(
        arm=arm, task="mix", size="tiny", seq_len=512, steps=STEPS, batch=2, warmup=2,
        seed=0, data_seed=7, eval_seqs=2, probe_every=3, dtype="float32", device="cpu",
        out=str(tmp / f"{name}.json"), **kw,
    )  # fmt: skip
    return run(cfg, log=lambda *_: None)


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fallback")
    # mtrain-static without slashes beyond the local window: sparse at 512 tokens
    sparse = {"s_frac": 0.0}
    return {
        "dense": _train("dense", tmp, "dense"),
        "sparse": _train("mtrain-static", tmp, "sparse", **sparse),
        "always": _train("mtrain-static", tmp, "always", dense_above="0", **sparse),
        "never": _train("mtrain-static", tmp, "never", dense_above="1", **sparse),
    }


def test_fallback_everywhere_trains_as_dense(runs: dict[str, dict[str, Any]]) -> None:
    dense, sparse, always = (_losses(runs[k]) for k in ("dense", "sparse", "always"))
    assert runs["always"]["arm"]["dense_above"] == 0.0
    assert runs["always"]["arm"]["dense_recheck"] == 1
    diff = max(abs(a - b) for a, b in zip(always, dense, strict=True))
    assert diff <= 1e-5, f"mtrain-static with --dense-above 0 differs from dense by {diff:.2e}"
    # without the fallback the arm is sparse: the comparison above can fail
    gap = max(abs(a - b) for a, b in zip(sparse, dense, strict=True))
    assert gap > 1e-3, f"the sparse arm is within {gap:.2e} of dense: no test of the fallback"


def test_fallback_never_is_the_arm(runs: dict[str, dict[str, Any]]) -> None:
    assert _losses(runs["never"]) == _losses(runs["sparse"])
    assert "dense_above" not in runs["sparse"]["arm"]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"arm": "window", "dense_above": "0.5"}, "the window arm does not make"),
        ({"arm": "mtrain-topp", "dense_above": "1.5"}, "a density in [0, 1]"),
        ({"arm": "mtrain-topp", "dense_above": "dense"}, "a density in [0, 1]"),
        ({"arm": "mtrain-topp", "dense_recheck": 4}, "--dense-recheck 4 needs --dense-above"),
        ({"arm": "mtrain-topp", "dense_above": "auto", "dense_recheck": 0}, "must be >= 1"),
    ],
)
def test_refusals(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    arm = kw.pop("arm")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _train(arm, tmp_path, "refused", **kw)
