"""MQAR with distinct keys (examples/train/tasks.py, --mqar-distinct 1; issue 19,
docs/TRAINING.md "The tasks"): each pair is queried at most once, so the only
earlier copy of a queried key is its pair in the context and the distance
bucket is the distance to it; Q > P is refused; the default generator still
draws the sequences it drew before the option existed (digests taken from the
generator of commit 9f8170a)."""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train import dp as DP
from examples.train import tasks as T
from examples.train.config import RunConfig, parser
from examples.train.train import check_options, run, tasks_of


def _queries(s: T.Sample) -> list[int]:
    """The answer positions of a sample."""
    return torch.nonzero(s.labels != T.IGNORE).flatten().tolist()


def _check_distinct(task: T.Mqar, s: T.Sample) -> set[int]:
    """Asserts the distinct-keys property on one sample; returns its buckets."""
    n, p, v = task.seq_len, task.num_pairs, task.vocab
    ids = s.ids.tolist()
    keys = ids[1 : 2 * p + 1 : 2]
    values = ids[2 : 2 * p + 2 : 2]
    answers = _queries(s)
    assert len(answers) == task.num_queries
    queried = [ids[t - 1] for t in answers]
    assert len(set(queried)) == len(queried), "a key is queried twice"
    buckets = set()
    for t in answers:
        key = ids[t - 1]
        assert v.key0 <= key < v.value0
        # the key occurs exactly twice: once in the context, once at its query
        where = [i for i, x in enumerate(ids) if x == key]
        assert len(where) == 2 and where[1] == t - 1, (key, where)
        ctx = where[0]
        assert 1 <= ctx <= 2 * p - 1 and ctx % 2 == 1  # a key slot of the context
        i = (ctx - 1) // 2
        assert keys[i] == key
        assert int(s.labels[t]) == ids[t] == values[i]  # the answer is its pair's value
        # the nearest earlier copy of the key is the context pair: the bucket is its distance
        nearest = max(j for j in range(t - 1) if ids[j] == key)
        assert nearest == ctx
        distance = (t - 1) - ctx
        assert task.min_distance <= distance <= task.max_distance
        assert int(s.bucket[t]) == task.bucket_of(distance)
        assert int(s.bucket[t]) == int(math.log2(distance)) - int(math.log2(2 * p))
        buckets.add(int(s.bucket[t]))
    assert ((s.bucket >= 0) == (s.labels != T.IGNORE)).all()
    rest = torch.ones(n, dtype=torch.bool)
    rest[: 2 * p + 1] = False
    for t in answers:
        rest[t - 1 : t + 1] = False
    assert (s.ids[rest] >= v.filler0).all()  # everything else is filler
    return buckets


@pytest.mark.parametrize(
    "n, pairs, queries", [(1024, 16, 16), (512, 8, 5), (256, 4, 4), (4096, 64, 32)]
)
def test_distinct_property(n: int, pairs: int, queries: int) -> None:
    task = T.Mqar(n, pairs, queries, distinct=True)
    seen: set[int] = set()
    for index in range(20):
        seen |= _check_distinct(task, task.sample(3, index))
    # every distance bucket is drawn (the shares stay about log-uniform: docs/TRAINING.md)
    assert seen == set(range(len(task.buckets)))


def test_default_repeats_keys() -> None:
    """The property is not vacuous: the default generator with Q > P queries a key several
    times and the check above rejects its sequences."""
    task = T.Mqar(512, 4, 24)
    s = task.sample(3, 0)
    queried = [int(s.ids[t - 1]) for t in _queries(s)]
    assert len(set(queried)) < len(queried)
    with pytest.raises(AssertionError):
        _check_distinct(task, s)


def test_more_queries_than_pairs_refused() -> None:
    with pytest.raises(ValueError, match="queries each of its 4 pairs at most once"):
        T.Mqar(512, 4, 5, distinct=True)
    with pytest.raises(ValueError, match="--mqar-queries 24 must be <= --mqar-pairs 4"):
        check_options(RunConfig(mqar_distinct=1, mqar_pairs=4, mqar_queries=24))
    with pytest.raises(ValueError, match="--mqar-distinct 2: 0 or 1"):
        check_options(RunConfig(mqar_distinct=2))
    # passkey alone has no MQAR: the option is accepted with any Q
    check_options(RunConfig(task="passkey", mqar_distinct=1, mqar_pairs=4, mqar_queries=24))
    with pytest.raises(ValueError, match="--mqar-pairs 4"):  # refused before any model
        run(RunConfig(mqar_distinct=1, mqar_pairs=4, mqar_queries=24, device="cpu"))


def _digest(task: T.Task, seed: int, count: int) -> str:
    h = hashlib.sha256()
    for i in range(count):
        s = task.sample(seed, i)
        for x in (s.ids, s.labels, s.bucket):
            h.update(x.numpy().tobytes())
    return h.hexdigest()[:16]


def test_default_unchanged() -> None:
    """The default (and distinct=0) draws bitwise what the generator drew before the option
    existed: digests of 6 sequences taken from commit 9f8170a's tasks.py."""
    v = T.Vocab()
    for kw, want in (
        ({"num_pairs": 16, "num_queries": 16}, "0395f3f01dd7ffd9"),
        ({"num_pairs": 4, "num_queries": 24}, "ce05ddef0bf56fe7"),
    ):
        n = 1024 if kw["num_pairs"] == 16 else 512
        assert _digest(T.make_task("mqar", n, v, **kw), 11, 6) == want
        assert _digest(T.make_task("mqar", n, v, **kw, distinct=0), 11, 6) == want
    distinct = T.make_task("mqar", 1024, v, num_pairs=16, num_queries=16, distinct=1)
    assert _digest(distinct, 11, 6) != "0395f3f01dd7ffd9"


def test_option_reaches_the_tasks() -> None:
    cfg = RunConfig(task="mix", seq_len=512, mqar_pairs=8, mqar_queries=8, mqar_distinct=1)
    tasks, names = tasks_of(cfg, T.Vocab())
    assert names == ["mqar", "passkey"]
    mqar = tasks[0]
    assert isinstance(mqar, T.Mqar) and mqar.distinct
    plain, _ = tasks_of(RunConfig(task="mix", seq_len=512), T.Vocab())
    assert isinstance(plain[0], T.Mqar) and not plain[0].distinct
    # the data-parallel documents (--mix long-tail) take it through the same keyword
    kw = {"num_pairs": 4, "num_queries": 4, "digits": 5, "num_buckets": 8, "num_keys": 256}
    kw.update(num_values=256, num_filler=256, distinct=1)
    doc = DP.documents(["mqar"], [300], [0], 0, 1, kw)[0]
    task = T.Mqar(300, 4, 4, distinct=True)
    _check_distinct(task, T.Sample(doc.ids, doc.labels, task.sample(1, 0).bucket))
    assert "--mqar-distinct" in parser().format_help()
