"""The training program's data parallel with balancing (examples/train/dp.py, docs/TRAINING.md
"Data parallel with balancing"): 2 and 3 gloo processes train the tiny model in float64 on
long-tail mixes of packed documents dealt by cost, by token count and round-robin; their
per-step losses, evaluation and final weights equal one process's training on the whole batch
(up to float64 rounding), every rank ends with the same weights, a rank dealt no document
joins the collectives (steps with such a rank run and match), cost balancing predicts a lower
max/mean than token balancing on the mix, and bad settings are refused with clear errors."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mtrain

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from examples.train import cp as CP
from examples.train import dp as DP
from examples.train.config import from_args, parser
from examples.train.train import main, open_cp, run
from test_train_cp import spawn  # the workers under torchrun's environment (gloo)

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)
BASE = [
    "--task", "mix", "--size", "tiny", "--seq-len", "512", "--steps", "4", "--batch", "2",
    "--warmup", "2", "--lr", "3e-3", "--seed", "0", "--data-seed", "7", "--eval-seqs", "4",
    "--eval-batch", "1", "--eval-every", "2", "--dtype", "float64", "--device", "cpu",
    "--threads", "1", "--granularity", "32", "--mqar-pairs", "4", "--mqar-queries", "8",
    "--mix", "long-tail",
]  # fmt: skip
STATIC = ["--arm", "mtrain-static", "--s-frac", "0", "--sinks", "8", "--local-window", "40",
          "--v-frac", "0.03"]  # fmt: skip
# long documents only, one sequence's tokens a step: 1-4 documents, so 3 ranks are often dealt
# none (asserted below)
FEW = ["--batch", "1", "--mix-long-prob", "1"]
DATA = {"static": STATIC, "dense": ["--arm", "dense"], "few": [*STATIC, *FEW]}
# float64 throughout (weights, AdamW, mtrain's cpu-ref attention): one process against W
# ranks differ only by the order of the sums (each rank's pack, then the all-reduce); measured
# 2026-11-27 on these jobs (the 2-core VM): the weights' difference 5e-15 to 2e-14 of the
# update's norm; the tolerances leave 500x (a wrong weighting, such as each rank's mean loss,
# moves the losses by percents)
LOSS_RTOL = 1e-11
UPDATE_RTOL = 1e-11


def _args(data: str, tmp: Path, name: str, *extra: str) -> list[str]:
    return [*BASE, *DATA[data], "--out", str(tmp / f"{name}.json"), *extra]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One process (no group) on each data configuration: the whole global batch packed."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    init: dict[str, Any] = {}
    run(from_args([*_args("static", tmp, "init"), "--steps", "0"]), lambda *_: None, CP.Cp(), init)
    for data in DATA:
        state: dict[str, Any] = {}
        r = run(from_args(_args(data, tmp, data)), lambda *_: None, CP.Cp(), state)
        out[data] = {"results": r, "weights": state["model"], "init": init["model"]}
    return out


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


def assert_same_update(got: dict[str, Any], ref: dict[str, Any], what: str) -> float:
    a, b = _losses(got["results"]), _losses(ref["results"])
    assert len(a) == len(b) == 4, what
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    assert rel <= LOSS_RTOL, f"{what}: losses {a} vs one process {b} (rel {rel:.2e})"
    for key in ("eval", "eval_history"):
        assert got["results"][key] == ref["results"][key], f"{what}: {key} differs"
    gw, rw, w0 = got["weights"], ref["weights"], ref["init"]
    diff = sum(float((gw[k] - v).square().sum()) for k, v in rw.items()) ** 0.5
    update = sum(float((v - w0[k]).square().sum()) for k, v in rw.items()) ** 0.5
    assert update > 0, what
    assert diff <= UPDATE_RTOL * update, f"{what}: weights {diff:.3e} from one process's"
    return diff / update


# world -> jobs: (name, data configuration, --balance)
JOBS = {
    2: [("cost", "static", "cost"), ("tokens", "dense", "tokens")],
    3: [("cost", "dense", "cost"), ("off", "few", "off"), ("few", "few", "cost")],
}


@pytest.mark.parametrize("world", [2, 3])
def test_dp_equals_one_process(
    world: int, single: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    jobs = [
        {"name": name, "args": _args(data, tmp_path, name, "--balance", bal)}
        for name, data, bal in JOBS[world]
    ]
    t0 = time.monotonic()
    ranks = spawn(world, jobs, tmp_path)
    print(f"world {world}: {time.monotonic() - t0:.1f} s")
    for name, data, bal in JOBS[world]:
        w0 = ranks[0][name]["weights"]
        for r, res in enumerate(ranks):
            assert all(torch.equal(w0[k], v) for k, v in res[name]["weights"].items()), (name, r)
            rel = assert_same_update(res[name], single[data], f"world {world} {name} rank {r}")
            print(f"world {world} {name} rank {r}: update rel {rel:.2e}")
        res = ranks[0][name]["results"]
        d = res["dp"]
        assert res["world_size"] == world and res["cp"] is None
        assert d["world_size"] == world and d["balance"] == bal and d["backend"] == "gloo"
        assert d["replica_max_diff"] == 0.0
        assert res["arm"]["attention"] == "mtrain packed"
        for s in res["steps"]:
            x = s["dp"]
            assert len(x["compute_s"]) == len(x["predicted_s"]) == world
            assert sum(x["rank_docs"]) == x["docs"] and sum(x["rank_tokens"]) == x["tokens"]
            assert x["tokens"] >= (512 if data == "few" else 1024)
            assert all(t > 0 for t, n in zip(x["compute_s"], x["rank_docs"], strict=True) if n)
            assert x["step_s_max"] >= max(x["compute_s"])
            assert x["predicted_max_over_mean"] >= 1.0
        if data == "few":
            # a rank was dealt no document on some step, and still joined every collective
            empty = [s["step"] for s in res["steps"] if min(s["dp"]["rank_docs"]) == 0]
            assert empty, [s["dp"]["rank_docs"] for s in res["steps"]]
            for s in res["steps"]:
                x = s["dp"]
                for n, t, a in zip(x["rank_docs"], x["compute_s"], x["attention_s"], strict=True):
                    if n == 0:
                        assert a == 0.0 and t < x["step_s_max"]
        if bal != "off":
            rep = [s["dp"]["balance_report"] for s in res["steps"]]
            assert all(r is not None and r["max_before"] >= r["mean_before"] > 0 for r in rep)


def _dealer(method: str, world: int, tmp: Path) -> DP.Dealer:
    f = DP.budget_file("dense", 4, 2, 2048, 0, 0, tmp / "budgets.json")
    _, cal = DP.calibration_of("", torch.device("cpu"))
    dims = {"hidden": 128, "intermediate": 384, "vocab": 0, "kv_heads": 2, "head_dim": 32}
    return DP.Dealer(method, world, f, cal, 64, dims, 30, 100)


@pytest.mark.parametrize("world", [2, 3])
def test_cost_beats_tokens_in_prediction(world: int, tmp_path: Path) -> None:
    """On the long-tail mix (2048 tokens max, 4 sequences' tokens a step, 20 steps) the cost
    deal's predicted max/mean is below the token deal's on average and never above it by more
    than rounding, and the round-robin deal is the worst; the tokens deal evens the tokens."""
    lt = DP.LongTail(2048, 4 * 2048, DP.min_doc_len(4, 8, 5, 8))
    dealers = {m: _dealer(m, world, tmp_path) for m in DP.BALANCES}
    ratio: dict[str, list[float]] = {m: [] for m in DP.BALANCES}
    tok_spread = []
    for step in range(20):
        lengths = lt.draw(7, step)
        for m, d in dealers.items():
            rank_of, _ = d.deal(lengths)
            assert sorted(set(rank_of)) <= list(range(world))
            mm = DP.max_over_mean(d.predicted(lengths, rank_of))
            assert mm is not None
            ratio[m].append(mm)
            if m == "tokens":
                toks = [sum(n for n, r in zip(lengths, rank_of, strict=True) if r == k)
                        for k in range(world)]  # fmt: skip
                tok_spread.append(max(toks) / (sum(toks) / world))
        assert ratio["cost"][-1] <= ratio["tokens"][-1] + 1e-9, (step, ratio)
    mean = {m: statistics.mean(v) for m, v in ratio.items()}
    assert mean["cost"] < mean["tokens"] < mean["off"], mean
    assert mean["cost"] < 1.02, mean  # many short documents: cost balancing is near perfect
    assert statistics.mean(tok_spread) < statistics.mean(ratio["tokens"]), (tok_spread, mean)


def test_long_tail_distribution() -> None:
    """The mix's lengths: reproducible from (seed, step), inside their ranges, at least the
    step's tokens, and about half of the tokens in long documents."""
    lt = DP.LongTail(4096, 16 * 4096, 52)
    (s_lo, s_hi), (l_lo, l_hi) = lt.ranges()
    assert (s_lo, s_hi, l_lo, l_hi) == (128, 512, 1024, 4096)
    assert lt.draw(3, 5) == lt.draw(3, 5) and lt.draw(3, 5) != lt.draw(3, 6)
    long_tok = total = 0
    for step in range(40):
        lens = lt.draw(3, step)
        assert sum(lens) >= 16 * 4096 and sum(lens[:-1]) < 16 * 4096
        assert all(s_lo <= n <= s_hi or l_lo <= n <= l_hi for n in lens)
        long_tok += sum(n for n in lens if n >= l_lo)
        total += sum(lens)
    assert 0.35 < long_tok / total < 0.65, long_tok / total
    # every task fits in the shortest document
    docs = DP.documents(["mqar", "passkey"], [52, 52], [0, 1], 0, 1, _kw())
    assert [d.answers for d in docs] == [8, 5]


def _kw() -> dict[str, int]:
    return {"num_pairs": 4, "num_queries": 8, "digits": 5, "num_buckets": 8, "num_keys": 256,
            "num_values": 256, "num_filler": 256}  # fmt: skip


def test_pack() -> None:
    """Packing: offsets, positions restarting per document, no answer across a boundary."""
    docs = DP.documents(["mqar", "passkey"], [60, 70, 80], [0, 1, 2], 2, 1, _kw())
    ids, labels, pos, cu = DP.pack(docs)
    assert cu.tolist() == [0, 60, 130, 210] and ids.shape == labels.shape == pos.shape == (1, 210)
    assert pos[0, 60].item() == 0 and pos[0, 129].item() == 69
    assert int((labels[0, 1:] != -100).sum()) == sum(d.answers for d in docs) == 8 + 5 + 8
    assert all(labels[0, int(c)].item() == -100 for c in cu[:-1])  # BOS: no answer


def test_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Bad settings are refused before any process group exists, naming the setting."""
    out = str(tmp_path / "x.json")
    plain = [a for a in BASE if a not in ("--mix", "long-tail")]
    with pytest.raises(ValueError, match="give --mix long-tail"):
        open_cp(from_args([*plain, "--balance", "cost", "--out", out]))
    with pytest.raises(ValueError, match="the window arm is not supported"):
        open_cp(from_args([*BASE, "--arm", "window", "--out", out]))
    with pytest.raises(ValueError, match="--seq-len 128 too short for --mix long-tail"):
        open_cp(from_args([*BASE, "--seq-len", "128", "--out", out]))
    with pytest.raises(ValueError, match=r"--mix-long-prob 1\.5"):
        open_cp(from_args([*BASE, "--mix-long-prob", "1.5", "--out", out]))
    with pytest.raises(ValueError, match=r"--balance-calibration /nonexistent\.json: no such file"):
        open_cp(from_args([*BASE, "--balance", "cost", "--balance-calibration",
                           "/nonexistent.json", "--out", out]))  # fmt: skip
    with pytest.raises(ValueError, match="--dtype float64 runs on the CPU only"):
        run(from_args([*BASE, "--device", "meta", "--out", out]), lambda *_: None, CP.Cp())
    with pytest.raises(ValueError, match="--balance 'sorted'"):
        _dealer("sorted", 2, tmp_path)
    with pytest.raises(ValueError, match="--balance-spread 'random'"):
        DP.Dealer("cost", 2, tmp_path / "b.json", {}, 64, {}, 30, 100, "random")
    with pytest.raises(mtrain.MtrainError, match="num_sinks -1"):
        mtrain.balance_batch([100], 1, str(DP.budget_file("dense", 4, 2, 512, 0, 0,
                             tmp_path / "b.json")), {"pair_s": 1, "row_s": 0, "seq_s": 0,
                             "linear_flops": 1}, tune=False, num_sinks=-1)  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--cp off under a launcher .* data parallel"):
        main([*BASE, "--cp", "off", "--out", out])
    assert not torch.distributed.is_initialized()
    for bad in (["--balance", "sorted"], ["--mix", "uniform"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
    assert not (tmp_path / "x.json").exists()
