"""MQAR's second bucketing (examples/train/tasks.py and evaluate.py; issue 19, docs/TRAINING.md
"The tasks"): every answer is also bucketed by the distance to the nearest earlier copy of its
key (an earlier query of the same key, else the context pair), so that the caveat of Q > P
(a query copying from a nearer query) shows in the results. Checked against a brute-force
search of each sequence, equal to the context distance with distinct keys, summed to the same
counts and hits as the main buckets by the evaluation, and drawn by the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.train import report as R
from examples.train import tasks as T
from examples.train.config import RunConfig
from examples.train.train import run


def _nearest_by_search(task: T.Mqar, s: T.Sample) -> dict[int, int]:
    """answer position -> distance from its key to the nearest earlier token equal to that key
    (keys occur only in the context and at queries: filler and values use other ids)."""
    ids = s.ids.tolist()
    out = {}
    for t in torch.nonzero(s.labels != T.IGNORE).flatten().tolist():
        key = ids[t - 1]
        assert task.vocab.key0 <= key < task.vocab.value0
        prev = max(j for j in range(t - 1) if ids[j] == key)
        # that copy is followed by the same value: it answers the query
        assert ids[prev + 1] == ids[t]
        out[t] = (t - 1) - prev
    return out


@pytest.mark.parametrize(
    "n, pairs, queries", [(512, 4, 24), (1024, 16, 16), (2048, 8, 64), (4096, 4, 24)]
)
def test_nearest_is_the_nearest_copy(n: int, pairs: int, queries: int) -> None:
    task = T.Mqar(n, pairs, queries)
    nearer = 0
    for index in range(12):
        s = task.sample(5, index)
        assert s.nearest is not None
        found = _nearest_by_search(task, s)
        assert ((s.nearest >= 0) == (s.labels != T.IGNORE)).all()
        for t, d in found.items():
            assert int(s.nearest[t]) == int(math.log2(d)) - 1 == task.nearest_bucket_of(d)
            assert 0 <= int(s.nearest[t]) < len(task.nearest_buckets)
            lo, hi = (int(x) for x in task.nearest_buckets[int(s.nearest[t])].split("-"))
            assert lo <= d <= hi
            context = int(s.bucket[t]) + int(math.log2(task.min_distance)) - 1
            nearer += int(s.nearest[t]) < context
            assert int(s.nearest[t]) <= context  # never farther than the context pair
    if queries > pairs:
        assert nearer > 0  # keys queried again: some answers have a nearer copy


def test_distinct_nearest_is_the_context() -> None:
    task = T.Mqar(1024, 16, 16, distinct=True)
    for index in range(10):
        s = task.sample(2, index)
        assert s.nearest is not None
        ids = s.ids.tolist()
        for t, d in _nearest_by_search(task, s).items():
            assert d == (t - 1) - ids.index(ids[t - 1])  # the nearest copy is the context's key
            assert int(s.nearest[t]) == int(s.bucket[t]) + int(math.log2(task.min_distance)) - 1


def test_passkey_has_no_nearest() -> None:
    assert T.Passkey(512).sample(1, 0).nearest is None


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("nearest")
    cfg = RunConfig(
        arm="dense", task="mix", size="tiny", seq_len=512, steps=2, batch=2, warmup=1,
        mqar_pairs=4, mqar_queries=24, seed=0, data_seed=3, eval_seqs=8, eval_batch=4,
        dtype="float32", device="cpu", out=str(tmp / "dense.json"),
    )  # fmt: skip
    return run(cfg, log=lambda *_: None), tmp


def test_evaluation_counts_both_bucketings(result: tuple[dict, Path]) -> None:
    r, _ = result
    e = r["eval"]["mqar"]
    near = e["nearest"]
    assert near["buckets"] == T.Mqar(512, 4, 24).nearest_buckets
    assert sum(near["count"]) == sum(e["count"]) == 8 * 24  # every answer once in each
    hits = sum(a * c for a, c in zip(e["accuracy"], e["count"], strict=True) if c)
    near_hits = sum(a * c for a, c in zip(near["accuracy"], near["count"], strict=True) if c)
    assert abs(hits - near_hits) < 1e-9
    assert abs(hits / sum(e["count"]) - e["overall"]) < 1e-12
    assert "nearest" not in r["eval"]["passkey"]
    # the counts are those of the evaluation sequences' own buckets
    task = T.Mqar(512, 4, 24)
    want = [0] * len(task.nearest_buckets)
    for i in range(8):
        s = task.eval_sample(3 + 10**6, i)
        for b in s.nearest[s.nearest >= 0].tolist():
            want[b] += 1
    assert want == near["count"]


def test_report_draws_the_nearest_buckets(result: tuple[dict, Path]) -> None:
    _, tmp = result
    out = tmp / "report"
    assert R.main([str(tmp / "dense.json"), "--out-dir", str(out)]) == 0
    assert (out / "accuracy_mqar_nearest.png").stat().st_size > 0
    assert (out / "accuracy_mqar.png").stat().st_size > 0
    # a results file from before the bucketing (no "nearest") is drawn without that chart
    old = json.loads((tmp / "dense.json").read_text())
    del old["eval"]["mqar"]["nearest"]
    for h in old["eval_history"]:
        h["eval"]["mqar"].pop("nearest", None)
    (tmp / "old.json").write_text(json.dumps(old))
    assert R.main([str(tmp / "old.json"), "--out-dir", str(tmp / "old")]) == 0
    assert not (tmp / "old" / "accuracy_mqar_nearest.png").exists()
