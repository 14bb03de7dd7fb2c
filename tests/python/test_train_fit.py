"""The cost predictor's table fitted from the measured rank seconds (--balance-fit K,
examples/train/fit.py; docs/TRAINING.md "Pricing fitted from the measured times"): the fit
recovers known coefficients, stays non-negative and is the best feasible subset, handles
degenerate inputs; the unit tables reproduce the predictor; 2 gloo processes train the tiny
model in float64 with the fit every 2 steps (also with --balance-tune and measured pricing, and
resumed after every step), the update equals the run without the fit, both ranks record the
same fits at the expected steps and the fitted tables price the following steps. Bad settings
are refused."""

from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from examples.train import dp as DP
from examples.train import fit as FIT
from examples.train.config import from_args
from examples.train.train import open_cp
from test_train_cp import spawn  # the workers under torchrun's environment (gloo)
from test_train_dp import BASE, LOSS_RTOL, STATIC, UPDATE_RTOL

COST = [*BASE, *STATIC, "--balance", "cost", "--steps", "6"]


def _samples(rng: random.Random, n: int) -> list[list[float]]:
    """Feature rows of the magnitudes the program sees: pairs, rows, FLOPs, documents (x
    layers)."""
    return [
        [rng.uniform(1e3, 1e7), rng.uniform(10.0, 1e4), rng.uniform(1e6, 1e10),
         float(rng.randrange(1, 40))]
        for _ in range(n)
    ]  # fmt: skip


def _rss(feats: list[list[float]], secs: list[float], a: float, coef: list[float]) -> float:
    return sum(
        (s - a - sum(c * v for c, v in zip(coef, f, strict=True))) ** 2
        for f, s in zip(feats, secs, strict=True)
    )


def test_fit_recovers_known_coefficients() -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(20):
        feats = _samples(rng, rng.randrange(6, 40))
        a = rng.uniform(0.0, 0.05)
        coef = [rng.uniform(1e-10, 1e-8), rng.uniform(1e-7, 1e-5), rng.uniform(1e-12, 1e-10),
                rng.uniform(1e-4, 1e-3)]  # fmt: skip
        secs = [a + sum(c * v for c, v in zip(coef, f, strict=True)) for f in feats]
        got = FIT.fit(feats, secs)
        assert got.degenerate is None and got.dropped == {}, (seed, got)
        assert got.samples == len(feats)
        for c, g in zip(coef, got.coefficients, strict=True):
            assert abs(g - c) <= 1e-9 * c, (seed, coef, got.coefficients)
        assert abs(got.intercept - a) <= 1e-9 * max(secs), (seed, a, got.intercept)
        assert got.r2 is not None and got.r2 > 1 - 1e-12
        table = got.table()
        assert table["pair_s"] == got.coefficients[0] and table["row_s"] == got.coefficients[1]
        assert table["seq_s"] == got.coefficients[3]
        assert table["linear_flops"] == 1.0 / got.coefficients[2]


def test_fit_is_the_best_non_negative_one() -> None:
    """A negative true coefficient (and noise): every coefficient of the fit is >= 0, the fit is
    no worse than the least-squares fit (numpy's) on any subset of the columns whose
    coefficients are all >= 0, and no better than the unconstrained fit."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for trial in range(20):
        feats = _samples(rng, 30)
        coef = [3e-8, -3e-6 if trial % 2 else 1e-6, -1e-11 if trial % 3 else 5e-11,
                -2e-3 if trial % 5 == 1 else 1e-3]  # fmt: skip
        secs = [
            0.5 + sum(c * v for c, v in zip(coef, f, strict=True)) + rng.gauss(0.0, 1e-3)
            for f in feats
        ]
        got = FIT.fit(feats, secs)
        assert got.degenerate is None, (seed, got)
        assert all(c >= 0.0 for c in got.coefficients), (seed, got.coefficients)
        rss = _rss(feats, secs, got.intercept, list(got.coefficients))
        assert abs(rss - got.rss) <= 1e-9 * rss, (seed, rss, got.rss)
        x = np.array(feats)
        y = np.array(secs)
        for k in range(5):
            for sub in itertools.combinations(range(4), k):
                design = np.column_stack([np.ones(len(y)), *(x[:, j] / x[:, j].max() for j in sub)])
                beta = np.linalg.lstsq(design, y, rcond=None)[0]
                other = float(((design @ beta - y) ** 2).sum())
                if k == 4:
                    assert other <= rss * (1 + 1e-9), (seed, other, rss)  # the unconstrained
                if (beta[1:] >= 0).all():
                    assert rss <= other * (1 + 1e-9), (seed, sub, rss, other)


def test_fit_degenerate_inputs() -> None:
    rng = random.Random(5)
    feats = _samples(rng, 12)
    # a column all zero (no linear layers): dropped, the others recovered
    zero = [[p, r, 0.0, d] for p, r, _, d in feats]
    secs = [0.01 + 2e-9 * p + 3e-6 * r + 5e-4 * d for p, r, _, d in zero]
    got = FIT.fit(zero, secs)
    assert got.dropped == {"flops": "all zero"} and got.degenerate is None
    assert abs(got.coefficients[0] - 2e-9) <= 1e-9 * 2e-9
    assert abs(got.coefficients[1] - 3e-6) <= 1e-9 * 3e-6 and got.coefficients[2] == 0.0
    assert abs(got.coefficients[3] - 5e-4) <= 1e-9 * 5e-4
    assert got.table()["linear_flops"] == FIT.HUGE_FLOPS
    tiny = FIT.Fit(0.0, (1e-9, 0.0, 1e-320, 0.0), 0.0, None, 4)
    assert tiny.table()["linear_flops"] == FIT.HUGE_FLOPS  # 1 / 1e-320 is not finite
    # rows proportional to the FLOPs (as in the program: both are the tokens'): rows dropped,
    # the same seconds predicted
    coll = [[p, f / 1000.0, f, d] for p, _, f, d in feats]
    secs = [0.01 + 2e-9 * p + 3e-6 * r + 1e-10 * f + 5e-4 * d for p, r, f, d in coll]
    got = FIT.fit(coll, secs)
    assert got.degenerate is None and list(got.dropped) == ["rows"]
    assert got.coefficients[1] == 0.0
    assert abs(got.coefficients[2] - 3.1e-9) <= 1e-9 * 3.1e-9
    assert got.rss <= 1e-12 * sum(s * s for s in secs)
    # every document count the same: the documents column is the intercept's, dropped
    same = [[p, r, f, 8.0] for p, r, f, _ in feats]
    got = FIT.fit(same, [0.01 + 2e-9 * p + 1e-10 * f for p, _, f, _ in same])
    assert got.dropped["documents"].startswith("collinear with the intercept")
    assert got.coefficients[3] == 0.0 and got.degenerate is None
    # fewer samples than unknowns (the intercept and four nonzero columns)
    got = FIT.fit(feats[:4], [1.0, 2.0, 3.0, 4.0])
    assert got.degenerate == "4 samples for 5 unknowns"
    assert got.coefficients == (0.0, 0.0, 0.0, 0.0)
    assert FIT.fit([], []).degenerate == "0 samples for 1 unknowns"
    # seconds that fall as every feature grows: every coefficient 0
    grow = [[float(i), float(i), float(i) ** 1.5, float(i) ** 0.5] for i in range(1, 9)]
    got = FIT.fit(grow, [1.0 / i for i in range(1, 9)])
    assert got.degenerate == "every coefficient is 0" and got.intercept > 0
    with pytest.raises(ValueError, match="finite"):
        FIT.fit([[1.0, 2.0, float("nan"), 1.0]], [1.0])
    with pytest.raises(ValueError, match="feature rows"):
        FIT.fit([[1.0, 2.0]], [1.0])


def test_refit_windows() -> None:
    """A fit after every K steps of the window's samples (ranks dealt no document left out); a
    degenerate fit keeps the table."""
    given = {"pair_s": 1e-9, "row_s": 1e-6, "seq_s": 0.0, "linear_flops": 1e10}
    ref = FIT.Refit(2, given)
    rng = random.Random(3)
    truth = (2e-9, 0.0, 3e-11, 4e-4)
    recs = []
    for step in range(6):
        feats = _samples(rng, 3)
        if step == 1:
            feats[2] = [0.0] * 4  # a rank dealt none
        secs = [0.02 + sum(c * v for c, v in zip(truth, f, strict=True)) if any(f) else 1e-4
                for f in feats]  # fmt: skip
        if step in (2, 3):  # one rank only: 2 samples, degenerate
            feats = [feats[0], [0.0] * 4, [0.0] * 4]
        assert ref.index == [0, 0, 1, 1, 1, 1][step]
        recs.append(ref.observe(step, feats, secs, [1.0, 1.0, 1.0]))
    assert [r is not None for r in recs] == [False, True, False, True, False, True]
    first, kept, third = recs[1], recs[3], recs[5]
    assert first["step"] == 2 and first["samples"] == 5 and first["steps"] == [0, 1]
    assert first["index"] == 1 and first["priced_by"] == [0]
    assert abs(first["coefficients"]["pairs"] - 2e-9) <= 1e-9 * 2e-9
    assert kept["table"] is None and kept["index"] == 1
    assert kept["degenerate"] == "2 samples for 5 unknowns"
    assert third["index"] == 2 and ref.tables[2] == third["table"] and len(ref.fits) == 3
    with pytest.raises(ValueError, match="--balance-fit 0"):
        FIT.Refit(0, given)


def _dealer(tmp: Path, spread: str = "even") -> DP.Dealer:
    f = DP.budget_file("mtrain-static", 4, 2, 2048, 94, 40, tmp / "budgets.json")
    _, cal = DP.calibration_of("", torch.device("cpu"))
    dims = {"hidden": 128, "intermediate": 384, "vocab": 0, "kv_heads": 2, "head_dim": 32}
    return DP.Dealer("cost", 2, f, cal, 64, dims, 30, 100, spread)


def test_unit_tables_reproduce_the_predictor(tmp_path: Path) -> None:
    d = _dealer(tmp_path)
    cal = d.calibration
    lengths = [1, 17, 300, 1024, 2048]
    for n in lengths:
        p, r, f, docs = d.features(n)
        assert p > 0 and r > 0 and f > 0 and docs == 2.0  # one per layer
        got = cal["pair_s"] * p + cal["row_s"] * r + f / cal["linear_flops"] + cal["seq_s"] * docs
        assert abs(got - d.seconds(n)) <= 1e-9 * d.seconds(n), (n, got, d.seconds(n))
    # a new table prices from the next call on (the cached seconds dropped)
    other = {"pair_s": 3e-9, "row_s": 0.0, "seq_s": 1e-3, "linear_flops": 2e9}
    before = d.seconds(1024)
    d.set_calibration(other)
    p, r, f, docs = d.features(1024)
    assert d.seconds(1024) != before
    want = 3e-9 * p + f / 2e9 + 1e-3 * docs
    assert abs(d.seconds(1024) - want) <= 1e-9 * d.seconds(1024)
    rank_of = [0, 1, 1, 0, 1]
    feats = d.rank_features(lengths, rank_of)
    pred = d.predicted(lengths, rank_of)
    for k in range(2):
        got = 3e-9 * feats[k][0] + feats[k][2] / 2e9 + 1e-3 * feats[k][3]
        assert abs(got - pred[k]) <= 1e-9 * pred[k]
    # measured pricing: the pairs follow the row pairs; the features are recomputed
    m = _dealer(tmp_path, "measured")
    m.set_row_pairs(np.full((8, 6), 5.0))
    p5 = m.features(1024)[0]
    m.set_row_pairs(np.full((8, 6), 9.0))
    p9 = m.features(1024)[0]
    assert (p5, p9) == (8 * 5 * 1024, 8 * 9 * 1024)
    _, r, f, _ = m.features(1024)
    got = cal["pair_s"] * p9 + cal["row_s"] * r + f / cal["linear_flops"]
    assert abs(got - m.seconds(1024)) <= 1e-9 * m.seconds(1024)


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_fit_in_training(tmp_path: Path) -> None:
    def out(name: str) -> list[str]:
        return ["--out", str(tmp_path / f"{name}.json")]

    tune = ["--balance-tune", "2", "--balance-spread", "measured"]
    jobs = [
        {"name": "init", "args": [*COST, "--steps", "0", *out("init")]},
        {"name": "cost", "args": [*COST, *out("cost")]},
        {"name": "fit", "args": [*COST, "--balance-fit", "3", *out("fit")]},
        {"name": "tuned", "args": [*COST, "--balance-fit", "3", *tune, *out("tuned")]},
        {
            "name": "cut",
            "args": [*COST, "--balance-fit", "3", "--resume", str(tmp_path / "c.pt"), *out("c")],
            "cut": True,
        },
    ]
    t0 = time.monotonic()
    ranks = spawn(2, jobs, tmp_path)
    print(f"2 ranks: {time.monotonic() - t0:.1f} s")
    w0 = ranks[0]["init"]["weights"]
    ref = ranks[0]["cost"]
    rw = ref["weights"]
    update = sum(float((v - w0[k]).square().sum()) for k, v in rw.items()) ** 0.5
    assert update > 0
    for name in ("fit", "tuned", "cut"):
        runs = [ranks[r][name]["results"] for r in range(2)]
        # the ranks agree: the same fits, deals and predictions, the same weights
        assert runs[0]["dp"]["fit"] == runs[1]["dp"]["fit"], name
        for a, b in zip(runs[0]["steps"], runs[1]["steps"], strict=True):
            for key in ("rank_docs", "rank_tokens", "predicted_s", "fit", "compute_s"):
                assert a["dp"][key] == b["dp"][key], (name, a["step"], key)
        wr = ranks[1][name]["weights"]
        assert all(torch.equal(ranks[0][name]["weights"][k], v) for k, v in wr.items()), name
        res = runs[0]
        fit = res["dp"]["fit"]
        assert fit["every"] == 3 and [f["step"] for f in fit["fits"]] == [3, 6], name
        if name == "cut":
            assert ranks[0][name]["calls"] == 6
        if name != "tuned":
            # the deal never changes the update (float64: up to the sums' order)
            a, b = _losses(res), _losses(ref["results"])
            rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
            assert rel <= LOSS_RTOL, (name, a, b)
            gw = ranks[0][name]["weights"]
            diff = sum(float((gw[k] - v).square().sum()) for k, v in rw.items()) ** 0.5
            assert diff <= UPDATE_RTOL * update, (name, diff / update)
        # each fit is the fit of its window's samples, and its table prices the next steps
        index = 0
        tables = [res["dp"]["calibration"]]
        for s in res["steps"]:
            x = s["dp"]
            assert x["fit"]["table"] == index, (name, s["step"])
            t = tables[index]
            for k in range(2):
                p, r, f, docs = x["fit"]["rank_features"][k]
                got = t["pair_s"] * p + t["row_s"] * r + f / t["linear_flops"] + t["seq_s"] * docs
                assert abs(got - x["predicted_s"][k]) <= 1e-9 * max(x["predicted_s"]), name
            if x["fit"]["refit"] is None:
                continue
            rec = fit["fits"][x["fit"]["refit"]]
            assert rec["step"] == s["step"] + 1
            assert rec["steps"] == [s["step"] - 2, s["step"] - 1, s["step"]]
            window = [y["dp"] for y in res["steps"] if y["step"] in rec["steps"]]
            feats = [f for w in window for f in w["fit"]["rank_features"]]
            secs = [c for w in window for c in w["compute_s"]]
            keep = [i for i, f in enumerate(feats) if any(f)]
            again = FIT.fit([feats[i] for i in keep], [secs[i] for i in keep])
            assert rec["samples"] == len(keep)
            assert list(rec["coefficients"].values()) == list(again.coefficients), name
            assert rec["degenerate"] == again.degenerate
            if rec["table"] is not None:
                assert rec["table"] == again.table() and rec["r2"] == again.r2
                assert set(rec["dropped"]) >= {"rows"}  # the rows and FLOPs are collinear
                tables.append(rec["table"])
                index += 1
            assert rec["index"] == index
        print(name, [(f["step"], f["r2"], f["degenerate"]) for f in fit["fits"]])
        # the table fitted after the last step prices none (cut: every step is its call's first,
        # none counted)
        assert res["dp"]["counted_steps"] == (0 if name == "cut" else 3)
        if name != "cut":
            last = res["steps"][-1]["dp"]["fit"]["table"]
            assert res["dp"]["fitted"]["last_table"] == last
    # tables do get fitted (6 samples a window: the intercept and 4 columns need 5; the rows,
    # collinear with the FLOPs, are then dropped; a fit whose seconds do not grow with the work
    # is degenerate, more often in the cut run, where every step is its call's first)
    made = [f for r in ("fit", "tuned") for f in ranks[0][r]["results"]["dp"]["fit"]["fits"]]
    assert sum(f["table"] is not None for f in made) >= 2, made
    res = ranks[0]["fit"]["results"]
    table = DP.table([("fit", res), ("cost", ref["results"])]).splitlines()
    assert table[0].count("|") == table[2].count("|") == table[3].count("|")
    made_fit = sum(f["table"] is not None for f in res["dp"]["fit"]["fits"])
    assert f"| {made_fit} of 2, " in table[2] and f"| {made_fit} of 2, " not in table[3], table


def test_refusals(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "x.json")]
    plain = [a for a in BASE if a not in ("--mix", "long-tail")]
    with pytest.raises(ValueError, match="--balance-fit -1: refit the pricing every K >= 1"):
        open_cp(from_args([*COST, "--balance-fit", "-1", *out]))
    with pytest.raises(ValueError, match="--balance-fit fits the cost predictor's table: give "
                       "--balance cost, not tokens"):  # fmt: skip
        open_cp(from_args([*BASE, *STATIC, "--balance", "tokens", "--balance-fit", "3", *out]))
    with pytest.raises(
        ValueError, match=r"--balance-fit 4 on 1 rank: a window holds 4 samples .* give K >= 5"
    ):
        open_cp(from_args([*COST, "--balance-fit", "4", *out]))
    with pytest.raises(
        ValueError, match="--balance-fit and --balance-tune deal the documents of --mix "
    ):
        open_cp(from_args([*plain, *STATIC, "--balance-fit", "3", *out]))
    assert not (tmp_path / "x.json").exists()
