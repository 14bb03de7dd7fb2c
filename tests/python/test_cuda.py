"""The CUDA path (skipped without a GPU or without the cuda backend in the
installed libmtrain): attention on device tensors against float64 masked
attention (SPEC.md section 7's rule), the online estimate on the device,
opcheck with CUDA inputs, the caller's stream, and the device guard."""

from __future__ import annotations

import pytest
import torch

import mtrain
from conftest import assert_close_spec, randn, reference, run_mtrain

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


def test_nccl_group_refused() -> None:
    """Context parallel with CUDA tensors is not implemented: a clear error."""
    import os

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        q = torch.zeros(256, 4, 64, dtype=torch.bfloat16, device=DEV)
        with pytest.raises(mtrain.MtrainError) as info:
            mtrain.attention(
                q, q[:, :2].contiguous(), q[:, :2].contiguous(), group=dist.group.WORLD
            )
        assert info.value.status == "MTRAIN_ERR_NOT_SUPPORTED"
    finally:
        mtrain.reset()
        dist.destroy_process_group()


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
