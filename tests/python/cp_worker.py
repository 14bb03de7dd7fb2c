"""The ranks of the context-parallel tests (test_distributed.py): each case
runs on every rank of a gloo group and rank 0 writes what it found to a
file the test reads. Inputs come from fixed seeds, the same global batch on
every rank."""

from __future__ import annotations

import ctypes
import datetime
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

import mtrain
from mtrain import _core
from mtrain import _lib as L

G = 32
LENS = [150, 330]
HQ, HKV, D = 4, 2, 64
BUDGET = mtrain.TopK(8, 48)
LAST_Q = 32
LAYOUTS = ("striped", "zigzag", "contiguous", "balanced")


def global_batch(seed: int = 77) -> dict[str, torch.Tensor]:
    """The packed batch every rank (and the single-process reference) uses."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q": r(n, HQ, D),
        "k": r(n, HKV, D),
        "v": r(n, HKV, D),
        "do": r(n, HQ, D),
        "cu": torch.tensor([0, LENS[0], n]),
    }


def case_ring(rank: int, world: int) -> dict[str, Any]:
    """Estimate on the ring, forward and backward, for every layout; the
    outputs and gradients gathered back to global order."""
    b = global_batch()
    out: dict[str, Any] = {}
    group = dist.group.WORLD
    for layout in LAYOUTS:
        ql, pos, info = mtrain.dispatch(
            b["q"], group, layout=layout, cu_seqlens=b["cu"], granularity=G
        )
        kl, vl, dol = (mtrain.dispatch(b[x], info=info).local for x in ("k", "v", "do"))
        ql, kl, vl = (t.clone().requires_grad_() for t in (ql, kl, vl))
        plan = mtrain.estimate_pattern(ql, kl, BUDGET, last_q=LAST_Q, **info.attention_kwargs())
        o, lse = mtrain.attention(ql, kl, vl, pattern=plan, return_lse=True)
        o.backward(dol)
        res = {
            "o": mtrain.undispatch(o.detach(), info),
            "lse": mtrain.undispatch(lse, info),
            "dq": mtrain.undispatch(ql.grad, info),
            "dk": mtrain.undispatch(kl.grad, info),
            "dv": mtrain.undispatch(vl.grad, info),
            "patterns": [[p.head(h) for h in range(HQ)] for p in plan.patterns],
            "local_tokens": info.local_tokens,
            "positions": pos,
            "rows": info.rows,
        }
        out[layout] = res
    # dense attention on a batched [B, N, H, d] input through the ring
    g = torch.Generator().manual_seed(5)
    q4, k4, v4 = (torch.randn(2, 100, h, D, generator=g) for h in (HQ, HKV, HKV))
    ql, _, info = mtrain.dispatch(q4, group, layout="zigzag", seq_dim=1, granularity=G)
    kl, vl = (mtrain.dispatch(t, info=info).local for t in (k4, v4))
    o = mtrain.attention(ql, kl, vl, **info.attention_kwargs())
    out["batched_dense"] = mtrain.undispatch(o, info)
    # the gradient of undispatch flows back to each rank's slots
    ql.requires_grad_()
    full = mtrain.undispatch(ql * (rank + 1), info)
    full.sum().backward()
    # every rank's loss sees every slot: the gradient is world * (rank + 1) on
    # real slots (as torch.distributed.nn's all-gather), 0 on padding
    assert ql.grad is not None
    real = info.rows.view(2, -1) >= 0
    out["undispatch_grad"] = (ql.grad[real].unique().tolist(), ql.grad[~real].abs().sum().item())
    return out


def case_disagree(rank: int, world: int) -> dict[str, Any]:
    """Ranks with different granularities: every rank fails, naming the field."""
    del world
    q = torch.randn(64, HQ, D)
    k = torch.randn(64, HKV, D)
    try:
        mtrain.attention(q, k, k, group=dist.group.WORLD, granularity=16 if rank == 0 else 32)
    except mtrain.MtrainError as e:
        return {"status": e.status, "message": e.message}
    return {"status": "none", "message": ""}


def case_layouts(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 striped, the others zigzag: equal slot counts (380 tokens, 12
    blocks of G 32, a multiple of 2W for W = 2 and 3), so only the agreement on
    the layout catches it (before it, the ring ran and gave wrong results);
    every rank fails."""
    del world
    b = global_batch()
    layout = "striped" if rank == 0 else "zigzag"
    ql, _, info = mtrain.dispatch(b["q"][:380], dist.group.WORLD, layout=layout, granularity=G)
    kl = mtrain.dispatch(b["k"][:380], info=info).local
    res: dict[str, Any] = {"local_tokens": info.local_tokens}
    try:
        mtrain.attention(ql, kl, kl, **info.attention_kwargs())
    except mtrain.MtrainError as e:
        return {**res, "status": e.status, "message": e.message}
    return {**res, "status": "none", "message": ""}


def case_block_mask(rank: int, world: int) -> dict[str, Any]:
    """A bool block mask as pattern= for one sequence of 301 tokens (not a multiple of W * G:
    the layout pads it), with the dispatch's attention_kwargs; the output gathered back."""
    del rank, world
    q, k, v, mask = block_mask_batch()
    ql, _, info = mtrain.dispatch(q, dist.group.WORLD, layout="striped", granularity=G)
    kl, vl = (mtrain.dispatch(t, info=info).local for t in (k, v))
    o = mtrain.attention(ql, kl, vl, pattern=mask, **info.attention_kwargs())
    return {"o": mtrain.undispatch(o, info)}


def block_mask_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    n, nb = 301, -(-301 // G)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    mask = (torch.rand(HQ, nb, nb, generator=g) < 0.3).tril()
    return q, k, v, mask


BLOCK_LAYOUTS = ("striped", "zigzag", "contiguous")
BG = 16  # the block selection's granularity: 10 and 21 blocks
# select_blocks options of the context-parallel block selection (test_block_select.py): every
# method passes the keys around the ring on the CPU backends (antidiag in three passes), the
# head-adaptive budgets all-reduce their gain curves
BLOCK_CASES: dict[str, dict[str, Any]] = {
    "antidiag_p": {"method": "antidiag", "top_p": 0.8},
    "antidiag_k_adaptive": {"method": "antidiag", "top_k": 2, "head_adaptive": True},
    "meanpool_k": {"method": "meanpool", "top_k": 2, "sink_blocks": 2},
    "precise_p": {"method": "precise", "top_p": 0.9},
    "precise_k_adaptive": {
        "method": "precise",
        "top_k": 3,
        "head_adaptive": True,
        "local_blocks": 2,
    },
}


def block_selections(layout: str | None) -> dict[str, Any]:
    """mtrain.select_blocks of every BLOCK_CASES entry on the packed global batch: on one
    process (layout None) or on this rank's slots of `layout` over the world group; the precise
    method with the LSE of single-process dense attention (the same bits on every rank). Also
    the attention with the antidiag top-p patterns, gathered back to global order."""
    b = global_batch()
    q, k, v, cu = b["q"], b["k"], b["v"], b["cu"]
    # structure: a direction every query prefers on a few keys; head 0 looks at each
    # sequence's first block (forced), so that the head-adaptive budgets move
    q[..., 0] += 1.5
    k[::37, :, 0] += 4.0
    q[:, 0, 1] += 3.0
    for start in cu[:-1].tolist():
        k[start : start + BG, 0, 1] += 5.0
    _, lse = mtrain.attention(q, k, v, cu_seqlens=cu, granularity=BG, return_lse=True)
    info = None
    where: dict[str, Any] = {"cu_seqlens": cu, "granularity": BG}
    ql, kl, vl, lsel = q, k, v, lse
    if layout is not None:
        ql, _, info = mtrain.dispatch(
            q, dist.group.WORLD, layout=layout, cu_seqlens=cu, granularity=BG
        )
        kl, vl, lsel = (mtrain.dispatch(t, info=info).local for t in (k, v, lse))
        where = info.attention_kwargs()
    selections: dict[str, Any] = {}
    kept: list[mtrain.Pattern] = []
    for name, opts in BLOCK_CASES.items():
        extra = {"lse": lsel} if opts["method"] == "precise" else {}
        pats, reps = mtrain.select_blocks(ql, kl, report=True, **opts, **extra, **where)
        if name == "antidiag_p":
            kept = pats
        selections[name] = {
            "masks": [torch.stack([p.block_mask(h) for h in range(HQ)]) for p in pats],
            "recall": [r.recall for r in reps],
            "top_k": [r.top_k for r in reps],
            "blocks": [r.blocks for r in reps],
        }
    o = mtrain.attention(ql, kl, vl, pattern=kept, **where)
    if info is not None:
        o = mtrain.undispatch(o, info)
    return {"selections": selections, "o": o}


def case_blocks(rank: int, world: int) -> dict[str, Any]:
    """The block selection on the ring for every layout of BLOCK_LAYOUTS."""
    del rank, world
    return {layout: block_selections(layout) for layout in BLOCK_LAYOUTS}


# mtrain.BlockPatternCache under a group (test_block_cache.py): one sequence of an odd length
# (the layouts pad it), refresh every 2 steps, inputs that change every step
CACHE_N, CACHE_G, CACHE_D, CACHE_STEPS, CACHE_REFRESH = 301, 16, 32, 5, 2
CACHE_LAYOUTS = ("striped", "zigzag")
CACHE_CASES: dict[str, dict[str, Any]] = {
    "meanpool_k": {"method": "meanpool", "top_k": 2, "sink_blocks": 2},
    "precise_p": {"method": "precise", "top_p": 0.85},
    "antidiag_p": {"method": "antidiag", "top_p": 0.8, "stride": 4},
}


def cache_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global q, k and the dense forward's lse of one step (seed 300 + step): a few
    keys that queries prefer, at places that move every step."""
    g = torch.Generator().manual_seed(300 + step)
    n = CACHE_N
    q, k, v = (torch.randn(n, h, CACHE_D, generator=g) for h in (HQ, HKV, HKV))
    q[..., 0] += 1.5
    k[torch.randperm(n, generator=g)[:10], :, 0] += 4.0
    _, lse = mtrain.attention(q, k, v, granularity=CACHE_G, return_lse=True)
    return q, k, lse


def cache_run(layout: str | None) -> dict[str, Any]:
    """Every CACHE_CASES entry through a BlockPatternCache for CACHE_STEPS steps: on one
    process (layout None, the global inputs) or on this rank's slots of `layout` over the
    world group. Per step: the pattern's masks, its age, whether it is the previous step's
    object; the precise method gets lse= only on the steps that select. The last step of
    antidiag_p also attends with its pattern (gathered back to global order) and measures
    (collective under the group)."""
    out: dict[str, Any] = {}
    group = dist.group.WORLD if layout is not None else None
    for name, opts in CACHE_CASES.items():
        where: dict[str, Any] = {"granularity": CACHE_G}
        if layout is not None:
            where.update(group=group, layout=layout, seq_len=CACHE_N)
        cache = mtrain.BlockPatternCache(CACHE_REFRESH, **opts, **where)
        steps: list[dict[str, Any]] = []
        held = None
        for step in range(CACHE_STEPS):
            q, k, lse = cache_inputs(step)
            if layout is not None:
                q, _, info = mtrain.dispatch(q, group, layout=layout, granularity=CACHE_G)
                k, lse = (mtrain.dispatch(t, info=info).local for t in (k, lse))
            due = cache.due(0)
            extra = {"lse": lse} if opts["method"] == "precise" and due else {}
            p = cache.select(0, q, k, **extra)
            steps.append(
                {
                    "masks": torch.stack([p.block_mask(h) for h in range(p.num_heads)]),
                    "heads": [p.head(h) for h in range(p.num_heads)],
                    "age": cache.age(0),
                    "due": due,
                    "reused": p is held,
                    "counts": cache.counts(0),
                }
            )
            held = p
            if name == "antidiag_p" and step == CACHE_STEPS - 1:
                # the global pattern through the attention (the dispatch's kwargs)
                v = torch.randn(CACHE_N, HKV, CACHE_D, generator=torch.Generator().manual_seed(4))
                if layout is None:
                    out["o"] = mtrain.attention(q, k, v, pattern=[p], granularity=CACHE_G)
                else:
                    vl = mtrain.dispatch(v, info=info).local
                    o = mtrain.attention(q, k, vl, pattern=[p], **info.attention_kwargs())
                    out["o"] = mtrain.undispatch(o, info)
                r = cache.measure(0, q, k)
                out["measure"] = {
                    "cached": r.cached_per_head, "fresh": r.fresh_per_head, "age": r.age,
                    "densities": (r.cached_density, r.fresh_density),
                }  # fmt: skip
        out[name] = steps
    return out


def case_cache(rank: int, world: int) -> dict[str, Any]:
    """BlockPatternCache over the world group for every layout of CACHE_LAYOUTS."""
    del rank, world
    return {layout: cache_run(layout) for layout in CACHE_LAYOUTS}


def _error(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except mtrain.MtrainError as e:
        return {"status": e.status, "message": e.message}
    return {"status": "none", "message": ""}


def case_cache_errors(rank: int, world: int) -> dict[str, Any]:
    """BlockPatternCache errors under a group: every rank fails, none waits on a collective
    another rank left, and the layer stays as it was (counts) and steps on afterwards."""
    del world
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    out["seq_len"] = _error(lambda: mtrain.BlockPatternCache(2, top_k=1, group=group, seq_len=0))
    # different layouts of equal slot counts (as case_layouts): the context check names it
    b = global_batch()
    layout = "striped" if rank == 0 else "zigzag"
    ql, _, info = mtrain.dispatch(b["q"][:380], group, layout=layout, granularity=G)
    kl = mtrain.dispatch(b["k"][:380], info=info).local
    cache = mtrain.BlockPatternCache(
        2, method="meanpool", top_k=1, granularity=G, group=group, layout=layout, seq_len=380
    )
    out["layouts"] = {**_error(lambda: cache.select(0, ql, kl)), "counts": cache.counts(0)}
    # the schedule: rank 0 invalidates alone, then every rank steps
    q, k, _ = cache_inputs(0)
    ql, _, info = mtrain.dispatch(q, group, granularity=CACHE_G)
    kl = mtrain.dispatch(k, info=info).local
    cache = mtrain.BlockPatternCache(
        2, method="meanpool", top_k=2, granularity=CACHE_G, group=group, seq_len=CACHE_N
    )
    cache.select(0, ql, kl)
    if rank == 0:
        cache.invalidate(0)
    out["schedule"] = {**_error(lambda: cache.select(0, ql, kl)), "counts": cache.counts(0)}
    cache.invalidate(0)  # every rank now: in step again
    p = cache.select(0, ql, kl)
    out["schedule"]["after"] = (cache.counts(0), p.head(0))
    # this rank's slots wrong on rank 0 only (one token short): rank 0 names its slots, the
    # others see a rank out of step
    mine = (ql[:-1], kl[:-1]) if rank == 0 else (ql, kl)
    out["slots"] = {**_error(lambda: cache.select(0, *mine)), "counts": cache.counts(0)}
    cache.select(0, ql, kl)
    out["slots"]["after"] = cache.counts(0)
    return out


def case_split(rank: int, world: int) -> dict[str, Any]:
    """mtrain_comm_split on the torch communicator (3 ranks): the even ranks
    {2, 0} (ordered by key) and {1}; contexts created on them check their
    configs collectively through the sub-communicator (by point-to-point)."""
    name = mtrain._comm.register_group(dist.group.WORLD)
    comm = mtrain._comm.communicator(name, torch.device("cpu"))
    lib = L.lib()
    sub = ctypes.c_void_p()
    L.check(
        lib.comm_split(
            ctypes.cast(ctypes.pointer(comm.struct), ctypes.c_void_p),
            rank % 2,
            -rank,
            ctypes.byref(sub),
        )
    )
    res: dict[str, Any] = {"rank": lib.comm_rank(sub), "size": lib.comm_size(sub)}
    statuses = []
    for granularity in (64, 32 if rank == 2 else 64):  # ranks 0 and 2 disagree in round 2
        cfg = L.Config(
            api_version=L.API_VERSION, backend=b"cpu", granularity=granularity, deterministic=1
        )
        ctx = ctypes.c_void_p()
        st = lib.context_create(ctypes.byref(cfg), sub, ctypes.byref(ctx))
        statuses.append(L.status_name(st))
        if st == 0:
            lib.context_destroy(ctx)
    res["statuses"] = statuses
    lib.comm_destroy(sub)
    return res


def case_timeout(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 plans with the others, then never runs the forward: rank 0's
    ring receive times out naming its peer."""
    del world
    b = global_batch()
    ql, _, info = mtrain.dispatch(b["q"], dist.group.WORLD, cu_seqlens=b["cu"], granularity=G)
    kl = mtrain.dispatch(b["k"], info=info).local
    plan = mtrain.estimate_pattern(ql, kl, BUDGET, last_q=LAST_Q, **info.attention_kwargs())
    if rank == 1:
        time.sleep(float(os.environ["MTRAIN_COMM_TIMEOUT"]) + 6)
        return {}
    t0 = time.monotonic()
    try:
        mtrain.attention(ql, kl, kl, pattern=plan)
    except mtrain.MtrainError as e:
        return {"status": e.status, "message": e.message, "seconds": time.monotonic() - t0}
    return {"status": "none", "message": "", "seconds": time.monotonic() - t0}


def hf_model(seed: int = 11) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=HQ * D, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    model.config._attn_implementation = mtrain.register_transformers("mtrain_cp", granularity=G)
    return model


def hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input ids [1, N] and next-token labels (-100 at the end)."""
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return ids, labels


def hf_loss(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kw: Any
) -> torch.Tensor:
    logits = model(input_ids=ids, **kw).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def case_hf(rank: int, world: int) -> dict[str, Any]:
    """A Qwen2 model on the ring: tokens dispatched (zigzag), RoPE positions
    from dispatch, the DispatchInfo passed through transformers to the
    attention; the loss summed over ranks, the gradients all-reduced."""
    del rank
    model = hf_model()
    ids, labels = hf_batch()
    group = dist.group.WORLD
    ids_l, pos, info = mtrain.dispatch(ids, group, layout="zigzag", seq_dim=1, granularity=G)
    labels_l = mtrain.dispatch(labels, info=info, pad_value=-100).local
    loss = hf_loss(model, ids_l, labels_l, position_ids=pos, mtrain_dispatch=info)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        grads[n] = p.grad
    return {"loss": total, "grads": grads, "world": world}


CASES = {
    "ring": case_ring,
    "disagree": case_disagree,
    "layouts": case_layouts,
    "block_mask": case_block_mask,
    "blocks": case_blocks,
    "cache": case_cache,
    "cache_errors": case_cache_errors,
    "split": case_split,
    "timeout": case_timeout,
    "hf": case_hf,
}


def main(rank: int, world: int, init_file: str, out_dir: str, cases: list[str]) -> None:
    os.environ["MTRAIN_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    hard_exit = "timeout" in cases
    try:
        for case in cases:
            try:
                result: Any = CASES[case](rank, world)
            except BaseException:
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"{case}_{rank}.pt"))
    finally:
        if hard_exit:
            # the group is out of step after a timeout: no orderly teardown
            os._exit(0)
        # every rank has saved its results; then the orderly teardown, and an
        # exit that skips the interpreter's own (a gloo thread destroyed while
        # joinable aborted a worker now and then at exit, "terminate called
        # without an active exception", seen again on 2026-11-25 after
        # mtrain.reset() had made it rarer: docs/PYTORCH.md)
        try:
            dist.barrier()
            _core.reset()
            dist.destroy_process_group()
        finally:
            os._exit(0)
