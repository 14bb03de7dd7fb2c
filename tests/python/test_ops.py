"""The torch.library surface: opcheck on every op (schema, autograd
registration, fake tensors, AOT dispatch with dynamic shapes), gradcheck in
float64 on the cpu-ref backend, torch.compile of a small model
(fullgraph=True), and the plan shared by a step's forward and backward."""

from __future__ import annotations

import json

import pytest
import torch

import mtrain
from conftest import randn
from mtrain import _core

OPS = torch.ops.mtrain


def _options(**kw: object) -> str:
    return _core.Options(**kw).encode()  # type: ignore[arg-type]


def _qkv(gen: torch.Generator, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> list:
    return [randn(gen, n, h, d, dtype=dtype) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_attention(gen: torch.Generator, dtype: torch.dtype) -> None:
    n, hq, hkv, d = 100, 4, 2, 64
    q, k, v = _qkv(gen, n, hq, hkv, d, dtype)
    plan = OPS.pattern_plan(q, [], None, _options(pattern="dense", granularity=32))
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(OPS.attn_fwd.default, (q, k, v, plan))
    o, lse = OPS.attn_fwd(q.detach(), k.detach(), v.detach(), plan)
    do = randn(gen, n, hq, d, dtype=dtype)
    torch.library.opcheck(
        OPS.attn_bwd.default, (do, q.detach(), k.detach(), v.detach(), o, lse, plan)
    )


def test_opcheck_plans(gen: torch.Generator) -> None:
    n, hq, hkv, d = 96, 4, 2, 64
    q, k, _ = _qkv(gen, n, hq, hkv, d, torch.float32)
    budgets = json.dumps({"heads": [["topk", 4, 20]]})
    opts = _options(pattern="estimate", budgets=budgets, granularity=32, last_q=16)
    torch.library.opcheck(OPS.estimate_plan.default, (q, k, None, opts))
    cu = torch.tensor([0, 40, 96])
    torch.library.opcheck(OPS.estimate_plan.default, (q, k, cu, opts))
    p = mtrain.dense_pattern(n, hq, 32)
    torch.library.opcheck(OPS.pattern_plan.default, (q, [p.handle], None, _options(granularity=32)))
    torch.library.opcheck(
        OPS.pattern_plan.default, (q, [], cu, _options(pattern="dense", granularity=32))
    )


def test_gradcheck_cpu_ref(gen: torch.Generator) -> None:
    """Central differences of the float64 forward (cpu-ref) against the
    backward, on a sparse vertical-slash pattern with GQA and two sequences."""
    lens, g, hq, hkv, d = [13, 22], 4, 4, 2, 8
    n = sum(lens)
    q, k, v = _qkv(gen, n, hq, hkv, d, torch.float64)
    pats = [
        mtrain.vertical_slash_pattern(13, [([0, 2], [1, 5])] * hq, granularity=g),
        mtrain.vertical_slash_pattern(22, [([0, 1], [0, 3, 9]), ([0, 4], [2])] * 2, granularity=g),
    ]
    cu = torch.tensor([0, 13, 35])

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mtrain.attention(q, k, v, pattern=pats, cu_seqlens=cu)

    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_backend_of_float64_is_the_oracle(gen: torch.Generator) -> None:
    q, k, _ = _qkv(gen, 40, 2, 1, 16, torch.float64)
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(4, 8), granularity=8)
    assert plan._plan().ctx.backend == "cpu-ref"
    q32, k32 = q.float(), k.float()
    assert (
        mtrain.estimate_pattern(q32, k32, mtrain.TopK(4, 8), granularity=8)._plan().ctx.backend
        == "cpu"
    )


class TinyAttentionModel(torch.nn.Module):
    """Projections, mtrain sparse attention with the pattern estimated in the
    step, an output projection."""

    def __init__(self, dim: int, hq: int, hkv: int, d: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.wq = torch.nn.Linear(dim, hq * d, bias=False)
        self.wk = torch.nn.Linear(dim, hkv * d, bias=False)
        self.wv = torch.nn.Linear(dim, hkv * d, bias=False)
        self.wo = torch.nn.Linear(hq * d, dim, bias=False)
        self.budgets = mtrain.TopK(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.wq(x).view(n, self.hq, self.d)
        k = self.wk(x).view(n, self.hkv, self.d)
        v = self.wv(x).view(n, self.hkv, self.d)
        plan = mtrain.estimate_pattern(q, k, self.budgets, granularity=32, last_q=16)
        o = mtrain.attention(q, k, v, pattern=plan)
        return self.wo(o.reshape(n, -1))


def test_compile_fullgraph(gen: torch.Generator) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = TinyAttentionModel(32, 4, 2, 64)
    x = randn(gen, 128, 32)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    for g0, p in zip(eager_grads, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, g0, rtol=0, atol=0)


def test_compile_inductor(gen: torch.Generator) -> None:
    """Inductor too (a C++ compiler builds the surrounding kernels)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = TinyAttentionModel(32, 4, 2, 64)
    x = randn(gen, 96, 32)
    eager_out = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None for p in model.parameters())


def test_plan_lives_until_backward(gen: torch.Generator) -> None:
    """The step's plan is kept by the autograd graph: dropping the SparsePlan
    before the backward is fine; the registry empties once the graph is gone."""
    q, k, v = _qkv(gen, 64, 2, 2, 64, torch.float32)
    q.requires_grad_()
    before = len(_core._plans)
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(4, 8), granularity=16)
    o = mtrain.attention(q, k, v, pattern=plan)
    del plan
    assert len(_core._plans) == before + 1
    o.sum().backward()
    del o
    assert len(_core._plans) == before
