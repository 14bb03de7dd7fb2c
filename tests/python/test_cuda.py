"""The CUDA path (skipped without a GPU or without the cuda backend in the
installed libmtrain): attention on device tensors against float64 masked
attention (SPEC.md section 7's rule), causal and non-causal patterns, the
online estimate and the block selection on the device, opcheck with CUDA
inputs, the caller's stream, and the device guard."""

from __future__ import annotations

import pytest
import torch

import mtrain
from conftest import assert_close_spec, causal_mask, randn, reference, run_mtrain

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in mtrain.backends(),
    reason="needs a GPU and a libmtrain built with CUDA",
)

DEV = "cuda"


def to_dev(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (8, 1, 128)])
def test_attention_against_reference(
    gen: torch.Generator, dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    n, g = 1000, 128  # the last block partial
    q, k, v, do = (randn(gen, n, h, d, dtype=dtype) for h in (hq, hkv, hkv, hq))
    plan = mtrain.estimate_pattern(*to_dev(q, k), mtrain.TopK(64, 256), granularity=g)
    assert plan._plan().ctx.backend == "cuda"
    mask = plan.patterns[0].mask()
    got = run_mtrain(*to_dev(q, k, v, do), pattern=plan)
    assert all(t.device.type == DEV for t in got.values())
    got = {key: t.cpu() for key, t in got.items()}
    ref = reference(q, k, v, mask, do)
    naive = reference(q, k, v, mask, do, dtype)
    assert_close_spec(got, ref, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("hq", "hkv", "d", "g"), [(4, 2, 64, 64), (8, 1, 128, 128)])
def test_noncausal_block_mask_on_device(
    gen: torch.Generator, dtype: torch.dtype, hq: int, hkv: int, d: int, g: int
) -> None:
    """A non-causal block mask (SPEC.md section 1, "Non-causal patterns") on the device:
    blocks above the diagonal attend, the diagonal block is not masked token by token,
    the keys past N never count (N not a multiple of G); forward and every gradient
    against float64 masked attention (section 7's rule)."""
    n = 333
    nb = -(-n // g)
    q, k, v, do = (randn(gen, n, h, d, dtype=dtype) for h in (hq, hkv, hkv, hq))
    blocks = torch.rand(hq, nb, nb, generator=gen) < 0.4
    pattern = mtrain.block_mask_pattern(blocks, n, g, causal=False)
    assert not pattern.causal
    mask = pattern.mask()
    assert bool(mask.triu(1).any())  # keys after the query take part
    got = run_mtrain(*to_dev(q, k, v, do), pattern=pattern)
    assert all(t.device.type == DEV for t in got.values())
    got = {key: t.cpu() for key, t in got.items()}
    ref = reference(q, k, v, mask, do)
    naive = None if dtype == torch.float32 else reference(q, k, v, mask, do, dtype)
    assert_close_spec(got, ref, naive)


def test_varlen_on_device(gen: torch.Generator) -> None:
    lens = [300, 517, 129]
    hq, hkv, d, g = 4, 2, 128, 128
    n = sum(lens)
    q, k, v, do = (randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, 300, 817, n], dtype=torch.int32)  # on the host: no copy
    pats = [mtrain.dense_pattern(m, hq, g) for m in lens]
    got = run_mtrain(*to_dev(q, k, v, do), pattern=pats, cu_seqlens=cu)
    from conftest import causal_mask, varlen_mask

    mask = varlen_mask([causal_mask(m, hq) for m in lens])
    ref = reference(q, k, v, mask, do)
    naive = reference(q, k, v, mask, do, torch.bfloat16)
    assert_close_spec({key: t.cpu() for key, t in got.items()}, ref, naive)


def test_packed_estimate_on_device(gen: torch.Generator) -> None:
    """The packed batch's estimate on the device (one call for the batch): each
    document's pattern is the one its own estimate gives, top-k and top-p."""
    lens = [1, 300, 128, 517, 129, 2000]
    hq, hkv, d, g = 8, 2, 64, 128
    n = sum(lens)
    q, k = (randn(gen, n, h, d, dtype=torch.bfloat16).to(DEV) for h in (hq, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for budgets in (mtrain.TopK(40, 90), mtrain.TopP(0.8, 0.9, 500, 1500)):
        plan = mtrain.estimate_pattern(q, k, budgets, cu_seqlens=cu, granularity=g)
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            alone = mtrain.estimate_pattern(q[a:b], k[a:b], budgets, granularity=g).patterns[0]
            for h in range(hq):
                assert plan.patterns[s].head(h) == alone.head(h), (budgets, s, h)


def test_opcheck_cuda(gen: torch.Generator) -> None:
    from mtrain import _core

    q, k, v, do = to_dev(*(randn(gen, 256, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2, 4)))
    opts = _core.Options(pattern="dense", granularity=128).encode()
    plan = torch.ops.mtrain.pattern_plan(q, [], None, opts)
    torch.library.opcheck(torch.ops.mtrain.attn_fwd.default, (q, k, v, plan))
    o, lse = torch.ops.mtrain.attn_fwd(q, k, v, plan)
    torch.library.opcheck(torch.ops.mtrain.attn_bwd.default, (do, q, k, v, o, lse, plan))


def test_callers_stream(gen: torch.Generator) -> None:
    """Inputs written on a side stream, the op queued on that stream: the
    result equals the default stream's (the library runs on the current
    stream, so no extra synchronisation is needed)."""
    q, k, v = (randn(gen, 512, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    expect = mtrain.attention(*to_dev(q, k, v), granularity=128)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qd, kd, vd = (torch.empty(t.shape, dtype=t.dtype, device=DEV) for t in (q, k, v))
        for dst, src in zip((qd, kd, vd), (q, k, v), strict=True):
            dst.copy_(src.pin_memory(), non_blocking=True)
        got = mtrain.attention(qd, kd, vd, granularity=128)
    side.synchronize()
    assert torch.equal(got, expect)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(gen: torch.Generator) -> None:
    q, k, v = (randn(gen, 256, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    on0 = mtrain.attention(*[t.to("cuda:0") for t in (q, k, v)], granularity=128)
    on1 = mtrain.attention(*[t.to("cuda:1") for t in (q, k, v)], granularity=128)
    assert on1.device == torch.device("cuda:1")
    assert torch.equal(on0.cpu(), on1.cpu())


def _init_group(backend: str, port: str) -> None:
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group(backend, rank=0, world_size=1)


def test_nccl_group_of_one(gen: torch.Generator) -> None:
    """CUDA tensors on an NCCL group: mtrain bootstraps its NCCL communicator
    through the group (unique id broadcast) and runs the ring (of one rank
    here: one GPU); the estimate, dispatch, forward and backward equal the
    single-process results (within 1e-3 of the largest value; bitwise is
    expected). Several GPUs: docs/PYTORCH.md."""
    import torch.distributed as dist

    _init_group("nccl", "29531")
    try:
        n, hq, hkv, d = 700, 4, 2, 64
        q, k, v, do = to_dev(
            *(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
        )
        budgets = mtrain.TopK(16, 64)
        alone = run_mtrain(q, k, v, do, budgets=budgets, granularity=64)
        group = dist.group.WORLD
        ql, pos, info = mtrain.dispatch(q, group, layout="zigzag", granularity=64)
        assert ql.device.type == "cuda" and pos.numel() == ql.shape[0]
        kl, vl, dol = (mtrain.dispatch(t, info=info).local for t in (k, v, do))
        got = run_mtrain(ql, kl, vl, dol, budgets=budgets, **info.attention_kwargs())
        back = {key: mtrain.undispatch(t, info) for key, t in got.items()}
        for key, t in alone.items():
            diff = (back[key].double() - t.double()).abs().max().item()
            print(f"{key}: largest difference to one process {diff:.3e}")
            assert diff <= 1e-3 * t.double().abs().max().item(), key
        # the block selection on the ring (every key gathered, the NCCL communicator's
        # collectives): the same patterns as on one process
        sel = {"top_p": 0.9, "report": True}
        ring, ring_rep = mtrain.select_blocks(ql, kl, **sel, **info.attention_kwargs())
        one, one_rep = mtrain.select_blocks(q, k, **sel, granularity=64)
        assert [p.mask().tolist() for p in ring] == [p.mask().tolist() for p in one]
        assert torch.equal(ring_rep[0].blocks, one_rep[0].blocks)
        from mtrain import _comm

        assert any(type(c).__name__ == "NcclComm" for c in _comm._comms.values())
    finally:
        mtrain.reset()
        dist.destroy_process_group()


# The cuda backend's block scores: the fp64 kernels (within 1e-12 of cpu-ref) and the
# default tensor-core kernels of bf16 and fp16 inputs (docs/PATTERNS.md "CUDA scoring": per
# entry within a relative tolerance of at most about 6e-4 at these shapes, so the recall within
# 2e-3 relative).
SCORE_PATHS = {"fp64": 1e-9, "mma": 2e-3}


@pytest.mark.parametrize("path", sorted(SCORE_PATHS))
def test_block_selection_on_device(
    gen: torch.Generator, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mtrain.select_blocks on CUDA tensors (the cuda backend's block scores, the host
    selection) selects what cpu-ref selects from the same bf16 values (they may differ only at
    a near tie, SPEC.md section 9.6: within the scores' tolerance; none is expected with these
    inputs), for every method, in a packed batch, with the fp64 and the tensor-core scores
    (MTRAIN_CUDA_BLOCK_SCORES); the antidiag pattern then runs through attention on the device
    within SPEC.md section 7's bound."""
    from conftest import varlen_mask

    monkeypatch.setenv("MTRAIN_CUDA_BLOCK_SCORES", path)

    lens = [700, 1301]  # 6 and 11 blocks of 128, both partial
    n, hq, hkv, d, g = sum(lens), 8, 2, 64, 128
    q, k = randn(gen, n, hq, d), randn(gen, n, hkv, d)
    q[..., 0] += 1.5  # structure: a few keys every query prefers
    k[::53, :, 0] += 4.0
    q, k = q.bfloat16(), k.bfloat16()
    v, do = randn(gen, n, hkv, d, dtype=torch.bfloat16), randn(gen, n, hq, d, dtype=torch.bfloat16)
    cu = torch.tensor([0, lens[0], n])
    qd, kd, vd = to_dev(q, k, v)
    _, lse = mtrain.attention(qd, kd, vd, cu_seqlens=cu, granularity=g, return_lse=True)
    cases = [
        ({"method": "antidiag", "top_p": 0.6}, None),
        ({"method": "antidiag", "top_k": 2, "head_adaptive": True, "stride": 16}, None),
        ({"method": "meanpool", "top_k": 4}, None),
        ({"method": "precise", "top_p": 0.9}, lse),
    ]
    kept: list[mtrain.Pattern] = []
    for opts, lse_dev in cases:
        extra = {"lse": lse_dev} if lse_dev is not None else {}
        pats, reps = mtrain.select_blocks(qd, kd, cu_seqlens=cu, granularity=g, report=True,
                                          **opts, **extra)  # fmt: skip
        host = {"lse": lse_dev.cpu()} if lse_dev is not None else {}
        want, want_reps = mtrain.select_blocks(q, k, cu_seqlens=cu, granularity=g, report=True,
                                               backend="cpu-ref", **opts, **host)  # fmt: skip
        for s in range(2):
            assert torch.equal(pats[s].mask(), want[s].mask()), (opts, s)
            assert torch.equal(reps[s].top_k, want_reps[s].top_k), (opts, s)
            r, w = reps[s].recall, want_reps[s].recall
            assert torch.allclose(r, w, rtol=SCORE_PATHS[path], atol=0, equal_nan=True), (opts, s)
        if not kept:
            kept = pats
    assert sum(p.density() for p in kept) / 2 < 0.9
    got = run_mtrain(*to_dev(q, k, v, do), pattern=kept, cu_seqlens=cu)
    mask = varlen_mask([p.mask() for p in kept])
    ref = reference(q, k, v, mask, do)
    naive = reference(q, k, v, mask, do, torch.bfloat16)
    assert_close_spec({key: t.cpu() for key, t in got.items()}, ref, naive)


@pytest.mark.parametrize("path", sorted(SCORE_PATHS))
@pytest.mark.parametrize("method", ["antidiag", "meanpool", "precise"])
def test_noncausal_block_selection_on_device(
    gen: torch.Generator, method: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mtrain.select_blocks(..., causal=False) on CUDA tensors (the cuda backend's non-causal
    block scores, SPEC.md section 9.7: every key block of every query block, over all its real
    keys) selects what cpu-ref selects from the same bf16 values, blocks above the diagonal
    included, with the same recall (within the scores' tolerance); precise from the LSE of
    bidirectional attention computed on the device. N is not a multiple of G (padding keys never
    count), 8:2 heads; the fp64 and the tensor-core scores."""
    monkeypatch.setenv("MTRAIN_CUDA_BLOCK_SCORES", path)
    n, hq, hkv, d, g = 1000, 8, 2, 64, 128  # 8 blocks, the last partial
    nb = -(-n // g)
    q, k = randn(gen, n, hq, d), randn(gen, n, hkv, d)
    q[..., 0] += 1.5  # structure: a few keys every query prefers, later ones too
    k[::53, :, 0] += 4.0
    q, k = q.bfloat16(), k.bfloat16()
    qd, kd = to_dev(q, k)
    opts: dict = {"method": method, "local_blocks": 1}
    opts.update({"top_k": 3} if method == "meanpool" else {"top_p": 0.6})
    host = dict(opts)
    if method == "precise":
        v = randn(gen, n, hkv, d, dtype=torch.bfloat16)
        full = mtrain.block_mask_pattern(torch.ones(hq, nb, nb, dtype=torch.bool), n, g,
                                         causal=False)  # fmt: skip
        _, lse = mtrain.attention(qd, kd, v.to(DEV), pattern=full, return_lse=True)
        opts["lse"], host["lse"] = lse, lse.cpu()
    pats, reps = mtrain.select_blocks(qd, kd, granularity=g, causal=False, report=True, **opts)
    want, want_reps = mtrain.select_blocks(q, k, granularity=g, causal=False, report=True,
                                           backend="cpu-ref", **host)  # fmt: skip
    assert not pats[0].causal
    got_blocks = torch.stack([pats[0].block_mask(h) for h in range(hq)])
    want_blocks = torch.stack([want[0].block_mask(h) for h in range(hq)])
    assert torch.equal(got_blocks, want_blocks), method
    assert int(got_blocks.triu(1).sum()) > 0, "no block above the diagonal was selected"
    assert torch.equal(reps[0].top_k, want_reps[0].top_k)
    r, w = reps[0].recall, want_reps[0].recall
    assert torch.allclose(r, w, rtol=SCORE_PATHS[path], atol=0, equal_nan=True), method


def test_cuda_tensors_on_gloo_group_refused() -> None:
    import torch.distributed as dist

    _init_group("gloo", "29532")
    try:
        q = torch.zeros(256, 4, 64, dtype=torch.bfloat16, device=DEV)
        kv = q[:, :2].contiguous()
        with pytest.raises(mtrain.MtrainError) as info:
            mtrain.attention(q, kv, kv, group=dist.group.WORLD)
        assert info.value.status == "MTRAIN_ERR_NOT_SUPPORTED"
        assert "needs an NCCL group" in info.value.message
    finally:
        mtrain.reset()
        dist.destroy_process_group()


def test_ordered_after_the_producer_on_default_stream(gen: torch.Generator) -> None:
    """The op runs on torch's current stream, the default one here: inputs
    written on that stream behind a 0.2 s sleep kernel are read only once
    written, and the output is read only once computed (a copy on the same
    stream), without any synchronisation by the caller."""
    n, hq, hkv, d = 2048, 4, 2, 64
    q, k, v = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv)))
    expect = mtrain.attention(q, k, v, granularity=128).cpu()
    assert torch.cuda.current_stream().cuda_stream == 0  # the legacy default stream
    for _ in range(3):
        cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2)
        torch.cuda._sleep(cycles)
        q2 = q * 1  # written after the sleep, on the default stream
        got = mtrain.attention(q2, k, v, granularity=128)
        assert torch.equal(got.cpu(), expect)


def _queue_sleep() -> float:
    """Measures a 0.3 s sleep kernel (its seconds), then queues another one on the
    current stream without waiting for it: what a call queued next must not wait for."""
    import time

    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.3)  # kHz -> 0.3 s
    t_sleep = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    slept = time.perf_counter() - t_sleep
    torch.cuda._sleep(cycles)
    return slept


def test_host_does_not_wait(gen: torch.Generator) -> None:
    """With a given pattern, the forward and the backward return while the
    GPU is still busy with earlier work (a 0.3 s sleep kernel queued first
    on the same stream): no device synchronisation in the op; the results
    equal those of a run without the sleep."""
    import time

    n, hq, hkv, d = 4096, 8, 2, 128
    q, k, v, do = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)))
    pattern = mtrain.vertical_slash_pattern(n, [([0, 1, 2, 3], [0, 1, 2])] * hq, 128)
    q.requires_grad_(True)
    o_ref = mtrain.attention(q, k, v, pattern=pattern)  # warm-up: contexts, plans
    o_ref.backward(do)
    o_ref, dq_ref = o_ref.detach().cpu(), q.grad.cpu()
    q.grad = None
    torch.cuda.synchronize()
    slept = _queue_sleep()
    t0 = time.perf_counter()
    o = mtrain.attention(q, k, v, pattern=pattern)
    t1 = time.perf_counter()
    o.backward(do)
    t2 = time.perf_counter()
    mtrain.synchronize()
    torch.cuda.synchronize()
    print(f"sleep {slept * 1e3:.1f} ms; forward queued in {(t1 - t0) * 1e3:.2f} ms, "
          f"backward in {(t2 - t1) * 1e3:.2f} ms")  # fmt: skip
    assert t2 - t0 < 0.5 * slept, "the op waited for the device"
    assert q.grad is not None
    assert torch.equal(o.detach().cpu(), o_ref) and torch.equal(q.grad.cpu(), dq_ref)


def test_deferred_nonfinite(gen: torch.Generator) -> None:
    """NaN in q: the stream-ordered forward returns; mtrain.synchronize()
    raises MTRAIN_ERR_NONFINITE naming the LSE, the token and the head."""
    n, hq, hkv, d = 512, 4, 2, 64
    q, k, v = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv)))
    q[33, 1, 5] = float("nan")
    mtrain.attention(q, k, v, granularity=128)
    with pytest.raises(mtrain.MtrainError) as info:
        mtrain.synchronize()
    assert info.value.status == "MTRAIN_ERR_NONFINITE"
    assert "output 'lse'" in info.value.message and "(token 33, head 1)" in info.value.message
    mtrain.synchronize()  # reported once


def test_transformers_model_on_gpu(gen: torch.Generator) -> None:
    """A Qwen2 model on the GPU in bf16 with attn_implementation="mtrain" at
    full budget: logits and every gradient within twice SDPA's error against
    the float64 model (or 1e-2 of the largest value: bf16 storage)."""
    transformers = pytest.importorskip("transformers")
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    name = mtrain.register_transformers(
        "mtrain_gpu_full", budgets=mtrain.TopK(10**6, 10**6), granularity=128
    )

    def step(attn: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).to(DEV, dtype)
        model.config._attn_implementation = attn
        ids = torch.randint(0, 512, (1, 1000), generator=gen.manual_seed(seed)).to(DEV)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        return {"logits": out.logits.double(), **grads}

    got = step(name, torch.bfloat16)
    sdpa = step("sdpa", torch.bfloat16)
    ref = step("eager", torch.float64)
    assert got.keys() == ref.keys() and len(got) > 10
    for key, r in ref.items():
        e_mtrain = (got[key] - r).abs().max().item()
        e_sdpa = (sdpa[key] - r).abs().max().item()
        bound = max(2 * e_sdpa, 1e-2 * r.abs().max().item())
        assert e_mtrain <= bound, f"{key}: mtrain {e_mtrain:.3e} > {bound:.3e} (sdpa {e_sdpa:.3e})"
    mtrain.synchronize()


def test_workspace_from_torch_allocator(gen: torch.Generator) -> None:
    """The library's accumulators come from torch's caching allocator: the
    forward's fp32 output accumulator alone ([T, H, d] floats) shows in torch's
    peak of allocated bytes, beyond the inputs and outputs."""
    n, h, d = 4096, 8, 128
    q, k, v, do = (randn(gen, n, h, d, dtype=torch.bfloat16) for _ in range(4))
    q, k, v, do = to_dev(q, k, v, do)
    pattern = mtrain.dense_pattern(n, h, 128)
    run_mtrain(q, k, v, do, pattern=pattern)  # contexts and caches made
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = mtrain.attention(q, k, v, pattern=pattern)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    assert extra >= n * h * d * 4, f"only {extra} bytes beyond the output came from torch"


def test_graph_capture_refused_clearly(gen: torch.Generator) -> None:
    """Capturing mtrain in a CUDA graph fails with mtrain's own error, not a
    CUDA error from inside the capture."""
    n, h, d = 512, 4, 64
    q, k, v = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for _ in range(3)))
    pattern = mtrain.dense_pattern(n, h, 128)
    mtrain.attention(q, k, v, pattern=pattern)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(mtrain.MtrainError, match="capturing a CUDA graph"),
        torch.cuda.graph(graph),
    ):
        mtrain.attention(q, k, v, pattern=pattern)


def test_compile_on_gpu(gen: torch.Generator) -> None:
    """torch.compile (fullgraph) of an estimate-and-attend function on CUDA
    tensors: no graph break, the same outputs as eager."""
    n, hq, hkv, d = 1000, 4, 2, 64
    q, k, v = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv)))
    budgets = mtrain.TopK(16, 64)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mtrain.attention(q, k, v, budgets=budgets, granularity=128) * 2

    eager = fn(q, k, v)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager, compiled)


def test_dense_fallback_on_gpu(gen: torch.Generator) -> None:
    """'auto' on the GPU: a pattern denser than the measured threshold runs torch's SDPA, whose
    output and gradients must meet SPEC.md section 7 against the float64 reference (as mtrain's
    own kernels do); a sparse pattern runs the mtrain kernels."""
    n, hq, hkv, d = 1024, 8, 2, 128
    q, k, v, do = (randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    mtrain.dense_fallback_counts(reset=True)
    qq, kk, vv = (t.to(DEV).requires_grad_() for t in (q, k, v))
    o = mtrain.attention(qq, kk, vv, budgets=mtrain.TopK(n, n), dense_above="auto")
    o.backward(do.to(DEV))
    assert mtrain.dense_fallback_counts()["dense"] == 1
    assert qq.grad is not None and kk.grad is not None and vv.grad is not None
    got = {"o": o.detach().cpu(), "dq": qq.grad.cpu(), "dk": kk.grad.cpu(), "dv": vv.grad.cpu()}
    mask = causal_mask(n, hq)
    ref = reference(q, k, v, mask, do)
    naive = reference(q, k, v, mask, do, torch.bfloat16)
    for name in ("o", "dq", "dk", "dv"):
        err = (got[name].double() - ref[name]).abs().max().item()
        e_naive = (naive[name].double() - ref[name]).abs().max().item()
        print(f"fallback {name}: max error {err:.3g} (naive bf16 {e_naive:.3g})")
    assert_close_spec(got, ref, naive, names=("o", "dq", "dk", "dv"))
    sparse = mtrain.attention(
        *to_dev(q, k, v), budgets=mtrain.TopK(4, 16), granularity=64, dense_above="auto"
    )
    assert mtrain.dense_fallback_counts()["sparse"] == 1
    assert sparse.shape == q.shape


def _attention_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, plan: mtrain.SparsePlan
) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o, lse = mtrain.attention(q, k, v, pattern=plan, return_lse=True)
    o.backward(do)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return [t.detach().cpu() for t in (o, lse, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("budgets", ["top-k", "top-p"])
def test_device_plan_equals_host_plan(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, budgets: str
) -> None:
    """The online estimate's plan built on the GPU (on_device) gives the host
    plan's patterns and pairs and bitwise its forward and deterministic backward,
    for a packed batch with lengths that are not multiples of G."""
    lens, hq, hkv, d = [3000, 128, 77, 1500], 8, 2, 64
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, do = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)))
    b = mtrain.TopK(96, 300) if budgets == "top-k" else mtrain.TopP(0.7, 0.9, 256, 2048)
    kw = {"cu_seqlens": cu, "granularity": 64}
    dev = mtrain.estimate_pattern(q, k, b, **kw)
    assert dev._plan().on_device
    monkeypatch.setenv("MTRAIN_PLAN_ON_HOST", "1")
    host = mtrain.estimate_pattern(q, k, b, **kw)
    monkeypatch.delenv("MTRAIN_PLAN_ON_HOST")
    assert not host._plan().on_device
    assert dev.computed_pairs == host.computed_pairs
    for pd, ph in zip(dev.patterns, host.patterns, strict=True):
        assert [pd.head(h) for h in range(hq)] == [ph.head(h) for h in range(hq)]
    for got, want in zip(
        _attention_outputs(q, k, v, do, dev), _attention_outputs(q, k, v, do, host), strict=True
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["top-k", "top-p"])
def test_estimate_does_not_wait(gen: torch.Generator, kind: str) -> None:
    """With top-k or top-p budgets the online estimate, its plan, the forward
    and the backward all return while the GPU is still busy with a 0.3 s sleep
    kernel queued first: no synchronisation on the training step's path."""
    import time

    n, hq, hkv, d = 8192, 8, 2, 128
    q, k, v, do = to_dev(*(randn(gen, n, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)))
    budget = mtrain.TopK(200, 500) if kind == "top-k" else mtrain.TopP(0.8, 0.9, 512, 4096)
    q.requires_grad_(True)
    for _ in range(2):  # warm-up: contexts, the allocator's pool
        plan = mtrain.estimate_pattern(q.detach(), k, budget)
        mtrain.attention(q, k, v, pattern=plan).backward(do)
    q.grad = None
    torch.cuda.synchronize()
    slept = _queue_sleep()
    t0 = time.perf_counter()
    plan = mtrain.estimate_pattern(q.detach(), k, budget)
    t1 = time.perf_counter()
    o = mtrain.attention(q, k, v, pattern=plan)
    o.backward(do)
    t2 = time.perf_counter()
    mtrain.synchronize()
    torch.cuda.synchronize()
    print(f"sleep {slept * 1e3:.1f} ms; estimate and plan queued in {(t1 - t0) * 1e3:.2f} ms, "
          f"forward and backward in {(t2 - t1) * 1e3:.2f} ms")  # fmt: skip
    assert plan._plan().on_device
    assert t2 - t0 < 0.5 * slept, "the step waited for the device"
