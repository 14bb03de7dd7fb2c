"""mtrain.BlockPatternCache (the binding of mtrain_block_cache.h): the refresh
schedule per layer, the same Pattern between refreshes whatever q and k the
step brings, a refreshed pattern equal to a fresh mtrain.select_blocks of
that step's inputs, invalidation, the precise method's LSE only on the steps
that select, the recall check (cached against fresh) equal to float64 masked
softmax masses computed here, and the errors for bad arguments and for inputs
that change shape between steps. CPU, seeds printed (conftest.gen)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import mtrain
from conftest import randn

F64 = torch.float64
G = 32


def step_inputs(
    gen: torch.Generator, n: int = 230, hq: int = 4, hkv: int = 2, d: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh q, k of one step: a few keys that queries prefer, at random places,
    so that consecutive steps select different patterns."""
    q, k = randn(gen, n, hq, d, dtype=F64), randn(gen, n, hkv, d, dtype=F64)
    q[..., 0] += 1.5
    k[torch.randperm(n, generator=gen)[: max(2, n // 30)], :, 0] += 4.0
    return q, k


def masks(p: mtrain.Pattern) -> torch.Tensor:
    return torch.stack([p.block_mask(h) for h in range(p.num_heads)])


def recall_of(p: mtrain.Pattern, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per head: the dense softmax mass (causal, or over all keys for a
    non-causal pattern) inside the pattern, averaged over rows; float64."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    allowed = p.mask()
    i = torch.arange(n)
    visible = (i[None, :] <= i[:, None]) if p.causal else torch.ones(n, n, dtype=torch.bool)
    out = []
    for h in range(hq):
        s = (q[:, h] @ k[:, h // group].T) / math.sqrt(d)
        probs = torch.softmax(s.masked_fill(~visible, -math.inf), dim=1)
        out.append(float((probs * allowed[h]).sum()) / n)
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("causal", [True, False])
def test_schedule_reuse_and_refresh(gen: torch.Generator, causal: bool) -> None:
    opts: dict[str, Any] = {"method": "antidiag", "top_p": 0.7, "granularity": G, "causal": causal}
    cache = mtrain.BlockPatternCache(refresh_every=3, num_layers=2, **opts)
    assert cache.age(0) == -1 and cache.pattern(0) is None and cache.due(0)
    held: mtrain.Pattern | None = None
    fresh_masks = []
    for step in range(8):
        q, k = step_inputs(gen)
        selects = step % 3 == 0
        assert cache.due(0) == selects, step
        p = cache.select(0, q, k)
        assert p.causal == causal
        fresh = mtrain.select_blocks(q, k, **opts)[0]
        fresh_masks.append(masks(fresh))
        assert cache.age(0) == step % 3, step
        assert cache.counts(0) == (step + 1, step // 3 + 1), step
        if selects:
            assert p is not held, step
            # a refreshed pattern is the fresh selection of this step's inputs
            assert torch.equal(masks(p), fresh_masks[-1]), step
            held = p
        else:
            # between refreshes: the same Pattern, the one selected at the refresh
            assert p is held, step
            assert torch.equal(masks(p), fresh_masks[step - step % 3]), step
        assert cache.pattern(0) is p
    # the inputs moved: some step between refreshes differs from its fresh selection
    assert any(
        not torch.equal(fresh_masks[s], fresh_masks[s - s % 3]) for s in range(8) if s % 3
    ), "the steps' inputs select the same pattern: the reuse is not tested"
    # layer 1 has its own schedule
    assert cache.counts(1) == (0, 0) and cache.due(1)
    q, k = step_inputs(gen)
    p1 = cache.select(1, q, k)
    assert cache.age(1) == 0 and cache.age(0) == 7 % 3 and p1 is not cache.pattern(0)


def test_refresh_every_one_selects_every_step(gen: torch.Generator) -> None:
    cache = mtrain.BlockPatternCache(1, method="meanpool", top_k=2, granularity=G)
    for step in range(3):
        q, k = step_inputs(gen)
        p = cache.select(0, q, k)
        assert cache.age(0) == 0 and cache.counts(0) == (step + 1, step + 1)
        want = mtrain.select_blocks(q, k, method="meanpool", top_k=2, granularity=G)[0]
        assert torch.equal(masks(p), masks(want))


def test_invalidate(gen: torch.Generator) -> None:
    cache = mtrain.BlockPatternCache(10, 2, top_k=1, granularity=G)
    q, k = step_inputs(gen)
    a0, a1 = cache.select(0, q, k), cache.select(1, q, k)
    assert cache.select(0, q, k) is a0 and not cache.due(0)
    cache.invalidate(0)
    assert cache.due(0) and not cache.due(1) and cache.pattern(0) is None
    assert cache.select(0, q, k) is not a0 and cache.age(0) == 0
    assert cache.select(1, q, k) is a1 and cache.age(1) == 1
    cache.invalidate()
    assert cache.due(0) and cache.due(1)
    assert cache.counts(0) == (3, 2)


def test_precise_needs_lse_only_when_selecting(gen: torch.Generator) -> None:
    cache = mtrain.BlockPatternCache(2, method="precise", top_p=0.8, granularity=G)
    q, k = step_inputs(gen)
    v = randn(gen, q.shape[0], k.shape[1], q.shape[2], dtype=F64)
    _, lse = mtrain.attention(q, k, v, granularity=G, return_lse=True)
    with pytest.raises(mtrain.MtrainError, match=r"due\(0\) is True\) and needs lse="):
        cache.select(0, q, k)
    assert cache.counts(0) == (0, 0)  # the failed call changed nothing
    p = cache.select(0, q, k, lse=lse)
    want = mtrain.select_blocks(q, k, method="precise", top_p=0.8, lse=lse, granularity=G)[0]
    assert torch.equal(masks(p), masks(want))
    assert cache.select(0, q, k) is p  # not due: no lse needed
    with pytest.raises(mtrain.MtrainError, match="needs lse="):
        cache.select(0, q, k)


@pytest.mark.parametrize("causal", [True, False])
def test_measure_recall_drop(gen: torch.Generator, causal: bool) -> None:
    """measure(): the cached pattern's recall on the current inputs against a
    fresh selection's, each equal to the float64 mass computed here."""
    opts: dict[str, Any] = {"method": "antidiag", "top_k": 2, "granularity": G, "causal": causal}
    cache = mtrain.BlockPatternCache(4, **opts)
    q0, k0 = step_inputs(gen)
    cache.select(0, q0, k0)
    r0 = cache.measure(0, q0, k0)
    assert r0.age == 0 and r0.drop == 0.0 and r0.cached == r0.fresh
    cached = cache.pattern(0)
    assert cached is not None
    assert torch.allclose(r0.cached_per_head, recall_of(cached, q0, k0), rtol=0, atol=1e-12)
    drops = []
    for _ in range(3):
        q, k = step_inputs(gen)
        assert cache.select(0, q, k) is cached
        r = cache.measure(0, q, k)
        fresh = mtrain.select_blocks(q, k, **opts)[0]
        assert torch.allclose(r.cached_per_head, recall_of(cached, q, k), rtol=0, atol=1e-12)
        assert torch.allclose(r.fresh_per_head, recall_of(fresh, q, k), rtol=0, atol=1e-12)
        assert abs(r.cached - float(recall_of(cached, q, k).mean())) <= 1e-12
        assert r.drop == r.fresh - r.cached
        assert r.cached_density == cached.density() and r.fresh_density == fresh.density()
        drops.append(r.drop)
    assert cache.counts(0) == (4, 1)  # measure does not step
    # new random hot keys each step: the stale pattern keeps less mass
    assert sum(drops) > 0, drops


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def _raises(status: str, words: str, fn: Any, *args: Any, **kw: Any) -> None:
    with pytest.raises(mtrain.MtrainError) as info:
        fn(*args, **kw)
    err = info.value
    assert err.status == status, f"{err.status}: {err.message}"
    for w in words.split("|"):
        assert w.lower() in err.message.lower(), f"{w!r} not in {err.message!r}"


def test_bad_arguments(gen: torch.Generator) -> None:
    inv = "MTRAIN_ERR_INVALID_ARGUMENT"
    make = mtrain.BlockPatternCache
    _raises(inv, "refresh_every=0|1 ..", make, 0, top_k=1)
    _raises(inv, "refresh_every=-3", make, -3, top_k=1)
    _raises(inv, "refresh_every=2.0|must be an int", make, 2.0, top_k=1)
    _raises(inv, "refresh_every=True|must be an int", make, True, top_k=1)
    _raises(inv, "num_layers=0", make, 2, 0, top_k=1)
    _raises(inv, "exactly one of top_k", make, 2)
    _raises(inv, "meanpool|top-k only", make, 2, method="meanpool", top_p=0.5)
    _raises(inv, "causal=1|bool", make, 2, top_k=1, causal=1)
    _raises("MTRAIN_ERR_INVALID_BUDGET", "top_k=-1", make, 2, top_k=-1)
    _raises("MTRAIN_ERR_INVALID_BUDGET", "top_p=1.5", make, 2, top_p=1.5)
    _raises(inv, "head_adaptive", make, 2, top_p=0.5, head_adaptive=True)
    _raises(inv, "sink_blocks=-1", make, 2, top_k=1, sink_blocks=-1)
    _raises(inv, "stride=5|granularity 32", make, 2, top_k=1, stride=5, granularity=32)
    _raises(inv, "granularity=0", make, 2, top_k=1, granularity=0)
    _raises(inv, "softmax_scale", make, 2, top_k=1, softmax_scale=-1.0)
    cache = make(2, num_layers=2, top_k=1, granularity=G)
    q, k = step_inputs(gen)
    _raises(inv, "layer 2 is out of range|2 layers", cache.select, 2, q, k)
    _raises(inv, "layer -1 is out of range", cache.due, -1)
    _raises(inv, "holds no pattern", cache.measure, 0, q, k)
    _raises(inv, "lse= is read by method='precise' only", cache.select, 0, q, k, q[:, :, 0])
    _raises("MTRAIN_ERR_SHAPE_MISMATCH", "[tokens, heads, head_dim]", cache.select, 0, q[None], k)
    _raises("MTRAIN_ERR_SHAPE_MISMATCH", "same tokens", cache.select, 0, q, k[:100])
    assert cache.counts(0) == (0, 0)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("tokens", "230 tokens|200 tokens"),
        ("heads", "4 query heads|8 query heads"),
        ("kv_heads", "2 kv heads|4 kv heads"),
        ("head_dim", "head_dim 64|head_dim 32"),
        ("dtype", "torch.float64|torch.float32"),
    ],
)
def test_shape_change_between_steps(gen: torch.Generator, change: str, words: str) -> None:
    cache = mtrain.BlockPatternCache(3, top_k=1, granularity=G)
    q, k = step_inputs(gen)
    p = cache.select(0, q, k)
    shapes = {
        "tokens": {"n": 200}, "heads": {"hq": 8}, "kv_heads": {"hkv": 4}, "head_dim": {"d": 32},
        "dtype": {},
    }  # fmt: skip
    q2, k2 = step_inputs(gen, **shapes[change])
    if change == "dtype":
        q2, k2 = q2.float(), k2.float()
    _raises(
        "MTRAIN_ERR_SHAPE_MISMATCH", f"changed between steps|invalidate(0)|{words}",
        cache.select, 0, q2, k2,
    )  # fmt: skip
    assert cache.counts(0) == (1, 1) and cache.pattern(0) is p  # unchanged
    assert cache.select(0, q, k) is p  # the old shape still steps
    cache.invalidate(0)
    p2 = cache.select(0, q2, k2)  # after invalidate the new shape selects
    assert cache.age(0) == 0 and p2.seq_len == q2.shape[0] and p2.num_heads == q2.shape[1]


def test_group_arguments() -> None:
    """The context-parallel arguments' checks that need no process group."""
    inv = "MTRAIN_ERR_INVALID_ARGUMENT"
    make = mtrain.BlockPatternCache
    _raises(inv, "seq_len=301|with group=", make, 2, top_k=1, seq_len=301)
    _raises(inv, "layout 'diagonal'|striped", make, 2, top_k=1, layout="diagonal")
    _raises(inv, "ranks_per_node=1.5|int", make, 2, top_k=1, ranks_per_node=1.5)
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        _raises("MTRAIN_ERR_INVALID_CONFIG", "init_process_group", make, 2, top_k=1, group=object())


# ---------------------------------------------------------------------------
# context parallel: 2 and 3 gloo processes, every step bitwise the single-process cache
# ---------------------------------------------------------------------------


@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)
@pytest.mark.parametrize("world", [2, 3])
def test_ring_cache_equals_single_process(world: int, tmp_path: Path) -> None:
    """Each rank passes its slots of a sequence of 301 tokens (padded by the layouts) and
    gets, at every step, the pattern of the single-process cache on the global inputs:
    the same heads, ages, reuse and counts; the attention with it and measure() (collective)
    equal too. Then the errors: layouts that differ, a rank that invalidates alone, a rank
    with wrong slots."""
    import torch.multiprocessing as mp

    import cp_worker

    print(f"seeds: steps 300 .. {300 + cp_worker.CACHE_STEPS - 1}, batch 77; world {world}")
    mp.spawn(
        cp_worker.main,
        args=(world, str(tmp_path / "init"), str(tmp_path), ["cache", "cache_errors"]),
        nprocs=world,
        join=True,
    )
    ref = cp_worker.cache_run(None)
    # the inputs move: some cached step differs from a fresh selection of its inputs
    moved = False
    for name, want in ref.items():
        if name in ("measure", "o"):
            continue
        assert [s["due"] for s in want] == [True, False, True, False, True], name
        assert [s["reused"] for s in want] == [False, True, False, True, False], name
        moved = moved or not torch.equal(want[0]["masks"], want[2]["masks"])
    assert moved, "the steps' inputs select the same pattern: the refresh is not tested"
    inv = "MTRAIN_ERR_INVALID_CONFIG"
    for r in range(world):
        got = torch.load(tmp_path / f"cache_{r}.pt", weights_only=False)
        assert "error" not in got, f"rank {r}:\n{got['error']}"
        for layout in cp_worker.CACHE_LAYOUTS:
            have_all = got[layout]
            for name in cp_worker.CACHE_CASES:
                for step, (have, want) in enumerate(zip(have_all[name], ref[name], strict=True)):
                    what = f"rank {r}, {layout}, {name}, step {step}"
                    assert have["heads"] == want["heads"], f"{what}: the patterns differ"
                    assert torch.equal(have["masks"], want["masks"]), what
                    for key in ("age", "due", "reused", "counts"):
                        assert have[key] == want[key], f"{what}: {key}"
            e = (have_all["o"] - ref["o"]).abs().max().item()
            assert e <= 1e-5 * ref["o"].abs().max().item(), f"rank {r} {layout}: o differs by {e}"
            m, want_m = have_all["measure"], ref["measure"]
            assert m["age"] == want_m["age"] == 0 and m["densities"] == want_m["densities"]
            for key in ("cached", "fresh"):
                assert m[key].numpy().tobytes() == want_m[key].numpy().tobytes(), (r, layout)
        err = torch.load(tmp_path / f"cache_errors_{r}.pt", weights_only=False)
        assert "error" not in err, f"rank {r}:\n{err['error']}"
        assert err["seq_len"]["status"] == "MTRAIN_ERR_INVALID_ARGUMENT", err["seq_len"]
        assert "seq_len=0" in err["seq_len"]["message"]
        lay = err["layouts"]
        assert lay["status"] == inv and "select(layer=0)" in lay["message"], lay
        assert f"layout {'striped' if r == 0 else 'zigzag'}" in lay["message"], lay
        assert lay["counts"] == (0, 0), lay
        sched = err["schedule"]
        assert sched["status"] == inv and "out of step" in sched["message"], sched
        assert sched["counts"] == (1, 1), sched  # the failed step changed nothing
        assert sched["after"][0] == (2, 2), sched
        rank0 = torch.load(tmp_path / "cache_errors_0.pt", weights_only=False)
        assert sched["after"][1] == rank0["schedule"]["after"][1], "the ranks' patterns differ"
        slots = err["slots"]
        if r == 0:
            assert slots["status"] == "MTRAIN_ERR_SHAPE_MISMATCH", slots
            assert "slots of the striped layout of 301 tokens" in slots["message"], slots
        else:
            assert slots["status"] == inv and "out of step" in slots["message"], slots
        assert slots["counts"] == (2, 2) and slots["after"] == (3, 2), slots
