"""The mtrain-block arm through the library's pattern cache (--block-refresh K,
examples/train/arms.py BlockRefresh; issue 23, docs/TRAINING.md "The arms"): with
K = 1 the cache selects every step and the run is bitwise the arm without the
cache (losses, evaluation, probes); with K > 1 each layer's and batch slot's
pattern changes only at the refresh steps (multiples of K), where it is the
fresh selection of that step's q and k, and is reused unchanged in between; the
results JSON holds the refreshes and the recall drops measured on the last step
of every M-th window; bad values are refused before anything runs; on 2 gloo
ranks (context parallel, the cache's ring form) the run matches one process's."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mtrain

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train import arms as A
from examples.train import cp as CP
from examples.train.config import RunConfig, from_args, parser
from examples.train.train import check_options, run

STEPS = 9
K = 3  # windows: steps 0-2, 3-5, 6-8
M = 2  # measured: windows 0 and 2, on their last steps (2 and 8)
G = 64


def _cfg(tmp: Path, name: str, **kw: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        arm="mtrain-block", task="mix", size="tiny", seq_len=512, steps=STEPS, batch=2,
        warmup=3, seed=0, data_seed=7, eval_seqs=4, eval_every=6, probe_every=4,
        dtype="float32", device="cpu", granularity=G, block_top_p=0.5,
        out=str(tmp / f"{name}.json"),
    )  # fmt: skip
    return RunConfig(**{**base, **kw})


def _masks(p: mtrain.Pattern) -> torch.Tensor:
    return torch.stack([p.block_mask(h) for h in range(p.num_heads)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The arm without the cache, with K = 1, and with K = 3 (M = 2), the last with every
    training call's patterns recorded beside a fresh selection of the call's q and k."""
    tmp = tmp_path_factory.mktemp("refresh")
    calls: list[dict[str, Any]] = []
    choose = A.BlockRefresh.choose

    def spy(self: A.BlockRefresh, module: Any, query: Any, key: Any, scale: Any, kw: Any) -> None:
        choose(self, module, query, key, scale, kw)
        if not (module.training and torch.is_grad_enabled()):
            return
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2).contiguous()
        fresh = mtrain.select_blocks(q, k, softmax_scale=scale, granularity=G, **self.blocks)
        used = self.by_layer[int(module.layer_idx)]
        calls.append({
            "step": self.step, "layer": int(module.layer_idx),
            "used": [_masks(p) for p in used], "fresh": [_masks(p) for p in fresh],
        })  # fmt: skip

    quiet = lambda *_: None  # noqa: E731
    out: dict[str, Any] = {
        "plain": run(_cfg(tmp, "plain"), quiet),
        "k1": run(_cfg(tmp, "k1", block_refresh=1), quiet),
    }
    A.BlockRefresh.choose = spy  # type: ignore[method-assign]
    try:
        out["k3"] = run(_cfg(tmp, "k3", block_refresh=K, block_measure_every=M), quiet)
    finally:
        A.BlockRefresh.choose = choose  # type: ignore[method-assign]
    out["calls"] = calls
    # the same run measured on sampled rows: all 512 of them, so that it must agree with the
    # exact measure (fp32 on the rows against fp64)
    out["rows"] = run(
        _cfg(tmp, "rows", block_refresh=K, block_measure_every=M, block_measure_rows=512), quiet
    )
    return out


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


def test_refresh_1_is_the_arm_without_cache(runs: dict[str, Any]) -> None:
    plain, k1 = runs["plain"], runs["k1"]
    assert _losses(k1) == _losses(plain)  # bitwise
    assert k1["eval"] == plain["eval"] and k1["eval_history"] == plain["eval_history"]
    for p, q in zip(k1["probes"], plain["probes"], strict=True):
        for layer, x in q["layers"].items():
            assert p["layers"][layer]["density"] == x["density"]
            assert p["layers"][layer]["recall"] == x["recall"]
    assert plain["block_cache"] is None and plain["arm"]["block_refresh"] == 0
    c = k1["block_cache"]
    assert c["refresh_every"] == 1 and c["refreshes"] == STEPS == c["steps"]
    assert c["measures"] == [] and c["drop_mean"] is None and c["drop_max"] is None


def test_pattern_changes_only_at_refresh_steps(runs: dict[str, Any]) -> None:
    calls = runs["calls"]
    assert sorted({c["step"] for c in calls}) == list(range(STEPS))
    assert len(calls) == 2 * STEPS  # one call per layer and step
    changed_at_refresh = stale = 0
    for layer in (0, 1):
        seq = sorted((c for c in calls if c["layer"] == layer), key=lambda c: c["step"])
        for prev, cur in zip([None, *seq[:-1]], seq, strict=True):
            t = cur["step"]
            for b in range(2):
                used, fresh = cur["used"][b], cur["fresh"][b]
                if t % K == 0:
                    # a refresh: this step's own selection
                    assert torch.equal(used, fresh), (layer, t, b)
                    if prev is not None and not torch.equal(used, prev["used"][b]):
                        changed_at_refresh += 1
                else:
                    # reused: the pattern of the step before, unchanged
                    assert prev is not None and torch.equal(used, prev["used"][b]), (layer, t, b)
                    stale += not torch.equal(used, fresh)
    # the checks above are not vacuous: the patterns do change at refreshes, and a reused
    # pattern is not what a fresh selection would have chosen
    assert changed_at_refresh > 0 and stale > 0
    r = runs["k3"]
    assert r["block_cache"]["refresh_steps"] == list(range(0, STEPS, K))
    assert [s["block_cache"]["refresh"] for s in r["steps"]] == [t % K == 0 for t in range(STEPS)]
    # the first step selects as the arm without the cache does; reuse changes the run later
    assert _losses(r)[0] == _losses(runs["plain"])[0]
    assert _losses(r) != _losses(runs["plain"])


def test_metrics_hold_the_recall_drop(runs: dict[str, Any]) -> None:
    r = runs["k3"]
    c = r["block_cache"]
    assert c["refresh_every"] == K and c["measure_every"] == M
    assert c["steps"] == STEPS and c["refreshes"] == math.ceil(STEPS / K)
    measures = c["measures"]
    # the last step of windows 0 and 2 (M = 2), every layer, batch slot 0
    assert [(m["step"], m["layer"]) for m in measures] == [(2, 0), (2, 1), (8, 0), (8, 1)]
    for m in measures:
        assert m["age"] == K - 1 and m["batch_index"] == 0
        assert 0 < m["cached_recall"] <= 1 and 0 < m["fresh_recall"] <= 1
        assert m["drop"] == pytest.approx(m["fresh_recall"] - m["cached_recall"], abs=1e-15)
        assert 0 < m["cached_density"] <= 1 and 0 < m["fresh_density"] <= 1
        assert m["seconds"] > 0
    drops = [m["drop"] for m in measures]
    assert c["drop_mean"] == pytest.approx(statistics.mean(drops))
    assert c["drop_max"] == max(drops)
    assert c["tokens_per_s_mean"] > 0 and r["tokens_per_s"] > 0
    assert c["select_s_refresh_mean"] > 0 and c["select_s_reuse_mean"] > 0
    assert all(s["block_cache"]["select_s"] > 0 for s in r["steps"])
    # measured steps carry their measure seconds and are left out of the median step
    measured = [s for s in r["steps"] if s["block_cache"]["measures"]]
    assert [s["step"] for s in measured] == [2, 8]
    assert all(s["block_cache"]["measure_s"] > 0 for s in measured)
    assert r["arm"]["block_refresh"] == K and r["arm"]["block_measure_every"] == M


def test_sampled_rows_measure(runs: dict[str, Any]) -> None:
    exact, rows = runs["k3"]["block_cache"]["measures"], runs["rows"]["block_cache"]["measures"]
    assert _losses(runs["rows"]) == _losses(runs["k3"])  # measuring does not change training
    assert len(rows) == len(exact) == 4
    for x, y in zip(rows, exact, strict=True):
        assert (x["step"], x["layer"], x["age"], x["rows"]) == (y["step"], y["layer"], K - 1, 512)
        assert y["rows"] is None
        assert abs(x["cached_recall"] - y["cached_recall"]) <= 1e-4, (x, y)
        assert abs(x["fresh_recall"] - y["fresh_recall"]) <= 1e-4, (x, y)
        assert x["cached_density"] == y["cached_density"]
    assert runs["rows"]["arm"]["block_measure_rows"] == 512


def test_bad_values_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--block-refresh -1: must be >= 1 .*or 0"):
        check_options(RunConfig(arm="mtrain-block", block_refresh=-1))
    with pytest.raises(ValueError, match="the mtrain-block arm's, not mtrain-static's"):
        check_options(RunConfig(arm="mtrain-static", block_refresh=4))
    with pytest.raises(ValueError, match="--block-refresh with --mix"):
        check_options(RunConfig(arm="mtrain-block", block_refresh=4, mix="long-tail"))
    with pytest.raises(ValueError, match="--block-measure-every -2: must be >= 0"):
        check_options(RunConfig(arm="mtrain-block", block_refresh=4, block_measure_every=-2))
    # refused by the run (and the command line) before any model is built
    with pytest.raises(ValueError, match="--block-measure-rows -1: must be >= 0"):
        check_options(RunConfig(arm="mtrain-block", block_refresh=4, block_measure_rows=-1))
    with pytest.raises(ValueError, match="the mtrain-block arm's, not dense's"):
        run(_cfg(tmp_path, "bad", block_refresh=2, arm="dense"), lambda *_: None)
    with pytest.raises(ValueError, match="--block-refresh -3"):
        run(from_args(["--arm", "mtrain-block", "--block-refresh", "-3"]), lambda *_: None)
    with pytest.raises(ValueError, match="must be >= 1"):
        A.BlockRefresh({"method": "antidiag", "top_p": 0.5}, 0, 1, G)
    assert "--block-refresh" in parser().format_help()


def test_block_refresh_context_parallel(tmp_path: Path) -> None:
    """2 gloo ranks (zigzag), the cache's ring form: the run matches one process's (the
    tolerances of test_train_cp.py), the same refresh steps, the drops equal to rounding."""
    import test_train_cp as TC

    extra = ["--block-refresh", "2", "--block-measure-every", "1"]
    args = [*TC._args("block", tmp_path, "one"), *extra]
    one = run(from_args(args), lambda *_: None, CP.Cp())
    jobs = [{"name": "ring", "args": [*TC._args("block", tmp_path, "ring"), *extra,
                                      "--cp-layout", "zigzag"]}]  # fmt: skip
    ranks = TC.spawn(2, jobs, tmp_path)
    for r, res in enumerate(ranks):
        got = res["ring"]["results"]
        a, b = _losses(got), _losses(one)
        rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
        assert rel <= TC.LOSS_RTOL, (r, a, b)
        gc, oc = got["block_cache"], one["block_cache"]
        assert gc["refresh_steps"] == oc["refresh_steps"] == [0, 2, 4]
        assert len(gc["measures"]) == len(oc["measures"]) == 6  # steps 1, 3, 5 x 2 layers
        for x, y in zip(gc["measures"], oc["measures"], strict=True):
            assert (x["step"], x["layer"], x["age"]) == (y["step"], y["layer"], y["age"])
            assert abs(x["drop"] - y["drop"]) <= 1e-4 and x["cached_density"] == y["cached_density"]
        assert _losses(got) == _losses(ranks[0]["ring"]["results"])  # the replicas agree
