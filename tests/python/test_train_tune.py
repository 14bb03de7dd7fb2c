"""SparseBalance's tuning in the training program (--balance-tune, examples/train/tune.py,
docs/TRAINING.md "Tuning in the training program"): 2 gloo processes train the tiny model in
float64 on the long-tail mix dealt by cost. With the tuner held at the untuned level (bounds
1,1) the run is bitwise the untuned one (the per-rank budget files estimate exactly as the
arm's TopK). With the full range every step records a tuning whose scales are levels within the
bounds, the ranks' budget files hold the scaled counts, the predicted slowest rank never grows,
the tuner moves levels, and the ranks still end with equal weights. Bad settings are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from examples.train import tune as TUNE
from examples.train.config import from_args
from examples.train.train import open_cp
from test_train_cp import spawn  # the workers under torchrun's environment (gloo)
from test_train_dp import BASE, STATIC

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)
COST = [*BASE, *STATIC, "--balance", "cost"]
TUNE2 = ["--balance-tune", "2"]
MEASURED = ["--balance-spread", "measured"]


def _out(tmp: Path, name: str) -> list[str]:
    return ["--out", str(tmp / f"{name}.json")]


def test_scaled_matches_the_predictor() -> None:
    """The counts a tuned budget file holds: rounded half up, at least 1, 0 stays 0 (as
    core/balance/predict.c counts them)."""
    assert [TUNE.scaled(x, 0.25) for x in (0, 1, 2, 6, 10)] == [0, 1, 1, 2, 3]
    assert [TUNE.scaled(x, 1.5) for x in (1, 3, 7)] == [2, 5, 11]
    assert TUNE.scaled(14, 1.0) == 14


def test_budget_file(tmp_path: Path) -> None:
    scales = np.array([0.25, 1.0, 2.0, 0.5, 1.5, 0.75])
    f = TUNE.write_budgets(tmp_path / "b.json", 10, 3, scales, 2, 3)
    b = json.loads(f.read_text())
    assert len(b) == 2 and sorted(b[0]) == ["0", "1", "2"]
    assert b[0]["0"] == ["vertical_and_slash", 3, 1, 1.0]
    assert b[0]["2"] == ["vertical_and_slash", 20, 6, 1.0]
    assert b[1]["1"] == ["vertical_and_slash", 15, 5, 1.0]


def test_tuned_training(tmp_path: Path) -> None:
    jobs = [
        {"name": "untuned", "args": [*COST, "--out", str(tmp_path / "u.json")]},
        {
            "name": "held",
            "args": [*COST, *TUNE2, "--balance-tune-bounds", "1,1", *_out(tmp_path, "h")],
        },
        {"name": "tuned", "args": [*COST, *TUNE2, *_out(tmp_path, "t")]},
        {"name": "measured", "args": [*COST, *TUNE2, *MEASURED, *_out(tmp_path, "m")]},
    ]
    ranks = spawn(2, jobs, tmp_path)
    for r in range(2):
        u, h = ranks[r]["untuned"], ranks[r]["held"]
        lu = [s["loss"] for s in u["results"]["steps"]]
        lh = [s["loss"] for s in h["results"]["steps"]]
        assert lu == lh, (r, lu, lh)
        assert all(torch.equal(u["weights"][k], v) for k, v in h["weights"].items()), r
        for s in h["results"]["steps"]:
            t = s["dp"]["tune"]
            assert t["moves_down"] == t["moves_up"] == 0
            assert all(x == 1.0 for row in t["rank_scales"] for x in row)
    res: dict[str, Any] = ranks[0]["tuned"]["results"]
    w0 = ranks[0]["tuned"]["weights"]
    assert all(torch.equal(w0[k], v) for k, v in ranks[1]["tuned"]["weights"].items())
    assert res["dp"]["tune"]["every"] == 2
    summary = res["dp"]["tuned"]
    assert summary["moves_down"] + summary["moves_up"] > 0
    assert 0.0 < summary["recall_after"] <= 1.0
    moves = 0
    for s in res["steps"]:
        t, d = s["dp"]["tune"], s["dp"]
        assert t["curves_refreshed"] == (s["step"] % 2 == 0)
        assert t["curves_step"] == s["step"] - s["step"] % 2
        assert len(t["rank_scales"]) == 2
        assert all(x in TUNE.LEVELS for row in t["rank_scales"] for x in row)
        # the step never lengthens (predicted): the tuned slowest rank is at most the untuned
        assert max(t["predicted_tuned_s"]) <= d["balance_report"]["max_before"] * (1 + 1e-12)
        assert 0.0 <= t["recall_after"] <= 1.0 and 0.0 <= t["worst_recall_after"] <= 1.0
        moves += t["moves_down"] + t["moves_up"]
    assert moves > 0, "the tuner moved no level on any step"
    # measured pricing: the pairs per query row of each head's estimated pattern, at every
    # refresh, nondecreasing with the budget (top-k selections nest) and at most a causal row's
    m = ranks[0]["measured"]["results"]
    assert m["dp"]["tune"]["pricing"].startswith("measured")
    w1 = ranks[1]["measured"]["weights"]
    assert all(torch.equal(ranks[0]["measured"]["weights"][k], v) for k, v in w1.items())
    for s in m["steps"]:
        t = s["dp"]["tune"]
        assert (t["row_pairs"] is not None) == t["curves_refreshed"]
        if t["row_pairs"] is None:
            continue
        rp = np.array(t["row_pairs"])
        assert rp.shape == (2 * 4, len(TUNE.LEVELS)), rp.shape  # tiny: 2 layers x 4 heads
        assert (rp > 0).all() and (np.diff(rp, axis=1) >= 0).all(), rp
        assert (rp <= (512 + 1) / 2).all()


def test_refusals(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "x.json")]
    plain = [a for a in BASE if a not in ("--mix", "long-tail")]
    with pytest.raises(ValueError, match="--balance-tune deal the documents of --mix long-tail"):
        open_cp(from_args([*plain, *STATIC, "--balance-tune", "2", *out]))
    with pytest.raises(ValueError, match="give --balance cost, not tokens"):
        open_cp(from_args([*BASE, *STATIC, "--balance", "tokens", "--balance-tune", "2", *out]))
    with pytest.raises(ValueError, match="the dense arm has none to scale"):
        open_cp(from_args([*BASE, "--arm", "dense", "--balance", "cost", "--balance-tune", "2",
                           *out]))  # fmt: skip
    with pytest.raises(ValueError, match="--balance-tune -1: refresh"):
        open_cp(from_args([*COST, "--balance-tune", "-1", *out]))
    with pytest.raises(ValueError, match="--balance-tune-bounds needs --balance-tune"):
        open_cp(from_args([*COST, "--balance-tune-bounds", "0.5,1.5", *out]))
    for bad, why in (("0.5", "two scales"), ("1.5,2", "0 < LO <= 1 <= HI"), ("0,1", "0 < LO")):
        with pytest.raises(ValueError, match=why):
            open_cp(from_args([*COST, "--balance-tune", "2", "--balance-tune-bounds", bad, *out]))
    with pytest.raises(ValueError, match="--balance-spread measured prices the heads"):
        open_cp(from_args([*COST, *MEASURED, *out]))
    with pytest.raises(ValueError, match="refresh every M >= 1"):
        TUNE.Tuner(0, None, tmp_path, 1, 1, 1, 1, 32, {}, tmp_path)
    assert not (tmp_path / "x.json").exists()
