"""The tiny CI form of the training program (examples/train, docs/TRAINING.md):
the task generators put answers where they should be, cover every bucket and
reproduce from their seeds; a 2-layer model trained 24 steps at 1024 tokens on
the CPU (float32, seeded) with mtrain's estimated pattern at full budget
follows dense SDPA to within 1e-4 of the loss at every step, at a sparse
static budget (about 36% of the causal pairs) its loss over the last 8 steps
stays within 0.02 of dense's, and the block-sparse arm's (antidiag top-p 0.5:
about 55% of the pairs) within 0.05. The tolerances rest on the measurements
in docs/TRAINING.md ("The CI test")."""

from __future__ import annotations

import hashlib
import itertools
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train import tasks as T
from examples.train.config import RunConfig, parser
from examples.train.train import run

# measured on 3 seeds (docs/TRAINING.md): full budget max |dloss| 4.3e-6; sparse static
# |mean of the last 8 losses - dense's| at most 0.0017; the block arm 0.0049 for this test's seed
# 0 and 0.0065 for seed 1 (seed 2: 0.133, the block run's loss falling faster than dense's)
FULL_TOL = 1e-4
SPARSE_TOL = 0.02
BLOCK_TOL = 0.05
STEPS = 24


# ---------------------------------------------------------------------------
# the task generators
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, pairs, queries", [(1024, 16, 16), (512, 8, 40), (4096, 64, 32)])
def test_mqar_answers(n: int, pairs: int, queries: int) -> None:
    task = T.Mqar(n, pairs, queries)
    v = task.vocab
    seen = set()
    for index in range(20):
        s = task.sample(3, index)
        assert s.ids.shape == s.labels.shape == s.bucket.shape == (n,)
        assert int(s.ids[0]) == v.BOS
        keys = s.ids[1 : 2 * pairs + 1 : 2]
        values = s.ids[2 : 2 * pairs + 2 : 2]
        assert ((keys >= v.key0) & (keys < v.value0)).all() and len(set(keys.tolist())) == pairs
        assert ((values >= v.value0) & (values < v.filler0)).all()
        answers = torch.nonzero(s.labels != T.IGNORE).flatten().tolist()
        assert len(answers) == queries
        assert ((s.bucket >= 0) == (s.labels != T.IGNORE)).all()
        for t in answers:
            assert t - 1 > 2 * pairs and t < n  # the query lies after the context
            i = keys.tolist().index(int(s.ids[t - 1]))  # the queried key is a context key
            assert int(s.labels[t]) == int(s.ids[t]) == int(values[i])  # its value answers
            distance = (t - 1) - (1 + 2 * i)
            assert task.min_distance <= distance <= task.max_distance
            assert int(s.bucket[t]) == int(math.log2(distance)) - int(math.log2(2 * pairs))
            seen.add(int(s.bucket[t]))
        rest = torch.ones(n, dtype=torch.bool)
        rest[: 2 * pairs + 1] = False
        for t in answers:
            rest[t - 1 : t + 1] = False
        assert (s.ids[rest] >= v.filler0).all()  # everything else is filler
    assert seen == set(range(len(task.buckets)))  # every distance bucket is drawn


def test_mqar_distances_are_log_uniform() -> None:
    task = T.Mqar(4096, 16, 16)
    counts = torch.zeros(len(task.buckets))
    for index in range(100):
        b = task.sample(5, index).bucket
        counts += torch.bincount(b[b >= 0], minlength=len(task.buckets))
    share = counts[:-1] / counts.sum()  # the last bucket is cut at N - 3
    expect = 1 / math.log2((task.max_distance + 1) / task.min_distance)
    assert (share - expect).abs().max() < 0.3 * expect, (share, expect)


def test_passkey_answers_and_depths() -> None:
    task = T.Passkey(1024, digits=5, num_buckets=8)
    v = task.vocab
    for index in range(40):
        for s in (task.sample(2, index), task.eval_sample(2, index)):
            starts = torch.nonzero(s.ids == v.NEEDLE).flatten().tolist()
            assert len(starts) == 2 and starts[1] == starts[0] + 6
            key = s.ids[starts[0] + 1 : starts[1]]
            assert ((key >= v.DIGIT0) & (key < v.DIGIT0 + 10)).all()
            assert int(s.ids[-6]) == v.ASK and torch.equal(s.ids[-5:], key)
            labelled = torch.nonzero(s.labels != T.IGNORE).flatten().tolist()
            assert labelled == list(range(1019, 1024)) and torch.equal(s.labels[-5:], key)
            assert (s.bucket[-5:] == task.bucket_of(starts[0])).all()
        e = task.eval_sample(2, index)
        start = int(torch.nonzero(e.ids == v.NEEDLE).flatten()[0])
        assert task.bucket_of(start) == index % 8  # evaluation: bucket index % 8
    # the buckets partition the start positions [1, max_start], in order, equally
    ranges = [task.bucket_range(b) for b in range(8)]
    assert ranges[0][0] == 1 and ranges[-1][1] == task.max_start
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert lo == hi + 1
    sizes = [hi - lo + 1 for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
    for b, (lo, hi) in enumerate(ranges):
        assert task.bucket_of(lo) == task.bucket_of(hi) == b


def test_seeds_reproduce() -> None:
    tasks = [T.Mqar(1024), T.Passkey(1024)]
    a = T.batch(tasks, 7, 0, 4)
    b = T.batch(tasks, 7, 0, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = T.batch(tasks, 8, 0, 4)
    assert not torch.equal(a[0], c[0])
    # a sequence depends on (seed, index) only, not on the batch it falls in
    d = T.batch(tasks, 7, 2, 2)
    assert torch.equal(a[0][2:], d[0]) and torch.equal(a[1][2:], d[1])
    assert a[3].tolist() == [0, 1, 0, 1]


def test_mqar_stream_is_pinned() -> None:
    # The sequences a seed gives are part of a run's identity (a resumed run, the CPU study's
    # runs): a change of the generator that changes them must be deliberate. The digest was
    # taken from the first generator (tensor ops per query) and still holds for the faster one.
    task = T.Mqar(512, 4, 24, T.Vocab(num_keys=32, num_values=32, num_filler=256))
    h = hashlib.sha256()
    for i in range(8):
        s = task.sample(3, i)
        for x in (s.ids, s.labels, s.bucket):
            h.update(x.numpy().tobytes())
    assert h.hexdigest()[:16] == "56ce3b92f4293fb5"


def test_cli_help() -> None:
    text = parser().format_help()
    for flag in ("--arm", "--seq-len", "--steps", "--out", "mtrain-static", "--init-from"):
        assert flag in text


# ---------------------------------------------------------------------------
# training: dense, mtrain at full budget, mtrain sparse
# ---------------------------------------------------------------------------


def _train(arm: str, tmp: Path, **kw: Any) -> dict[str, Any]:
    cfg = RunConfig(
        arm=arm, task="mix", size="tiny", seq_len=1024, steps=STEPS, batch=2, warmup=5,
        seed=0, data_seed=7, eval_seqs=8, probe_every=8, dtype="float32", device="cpu",
        out=str(tmp / f"{arm}.json"), **kw,
    )  # fmt: skip
    return run(cfg, log=lambda *_: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("train")
    return {
        "dense": _train("dense", tmp),
        "full": _train("mtrain-full", tmp),
        # no slashes beyond the forced local window: a sparse pattern at 1K tokens
        "sparse": _train("mtrain-static", tmp, s_frac=0.0),
        # the block selection, sparse at this length (top-p 0.9 keeps 95% of the pairs here)
        "block": _train("mtrain-block", tmp, block_top_p=0.5),
    }


def _losses(r: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in r["steps"]]


def test_training_learns(runs: dict[str, dict[str, Any]]) -> None:
    """The loss falls (measured: by 0.58 to 0.83 from the first 3 steps to the
    last 8), so the comparisons below compare runs that train."""
    for name, r in runs.items():
        loss = _losses(r)
        assert len(loss) == STEPS and all(math.isfinite(x) for x in loss), name
        assert statistics.mean(loss[-8:]) < statistics.mean(loss[:3]) - 0.4, (name, loss)


def test_full_budget_tracks_dense(runs: dict[str, dict[str, Any]]) -> None:
    dense, full = _losses(runs["dense"]), _losses(runs["full"])
    diff = max(abs(a - b) for a, b in zip(full, dense, strict=True))
    assert diff <= FULL_TOL, f"mtrain at full budget differs from dense by {diff:.2e}"
    layers = [x for p in runs["full"]["probes"] for x in p["layers"].values()]
    assert layers and all(x["density"] == 1.0 for x in layers)
    assert all(abs(x["recall"] - 1.0) < 1e-5 for x in layers)


def test_sparse_tracks_dense(runs: dict[str, dict[str, Any]]) -> None:
    dense, sparse = _losses(runs["dense"]), _losses(runs["sparse"])
    layers = [x for p in runs["sparse"]["probes"] for x in p["layers"].values()]
    density = statistics.mean(x["density"] for x in layers)
    recall = statistics.mean(x["recall"] for x in layers)
    assert 0.2 < density < 0.5, f"density {density:.3f}: the sparse arm is not sparse"
    assert 0.2 < recall < 0.99, f"recall {recall:.3f}"
    gap = abs(statistics.mean(sparse[-8:]) - statistics.mean(dense[-8:]))
    assert gap <= SPARSE_TOL, f"sparse loss {gap:.4f} from dense (tolerance {SPARSE_TOL})"
    assert sparse != dense  # the sparse arm did compute something else


def test_block_tracks_dense(runs: dict[str, dict[str, Any]]) -> None:
    dense, block = _losses(runs["dense"]), _losses(runs["block"])
    layers = [x for p in runs["block"]["probes"] for x in p["layers"].values()]
    density = statistics.mean(x["density"] for x in layers)
    recall = statistics.mean(x["recall"] for x in layers)
    scored = statistics.mean(x["scored_recall"] for x in layers)
    assert 0.3 < density < 0.8, f"density {density:.3f}: the block arm is not sparse"
    assert 0.3 < recall < 0.99, f"recall {recall:.3f}"
    assert 0.5 <= scored <= 1.0, f"scored recall {scored:.3f} (top-p 0.5 keeps at least 0.5)"
    gap = abs(statistics.mean(block[-8:]) - statistics.mean(dense[-8:]))
    assert gap <= BLOCK_TOL, f"block loss {gap:.4f} from dense (tolerance {BLOCK_TOL})"
    assert block != dense
    assert runs["block"]["arm"]["blocks"] == {
        "method": "antidiag", "top_p": 0.5, "sink_blocks": 1, "local_blocks": 1, "stride": 8,
    }  # fmt: skip


def test_results_file(runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    r = runs["sparse"]
    assert r["tokens_per_step"] == 2048 and r["tokens_per_s"] > 0
    assert r["arm"]["budgets"] == {"TopK": [30 + 32, 100]}
    assert set(r["eval"]) == {"mqar", "passkey"}
    for name, ev in r["eval"].items():
        assert len(ev["accuracy"]) == len(ev["buckets"]) == len(ev["count"]), name
        assert sum(ev["count"]) == (8 * 16 // 2 if name == "mqar" else 8 * 5 // 2) * 2
        assert all(a is None or 0 <= a <= 1 for a in ev["accuracy"])
    shares = [p["attention_share"] for p in r["probes"]]
    assert len(shares) == 3 and all(0 < s < 1 for s in shares)
    assert "peak_memory_bytes" not in r  # CPU
    del tmp_path
