"""Shared fixtures and references of the Python tests.

The reference is explicit masked attention in float64 (the mask is the
pattern's allowed(h, i, j), docs/SPEC.md section 1), with its gradients from
autograd. Seeds are printed (pytest -s, or in the report of a failure);
MTRAIN_TEST_SEED draws other inputs."""

from __future__ import annotations

import math
import os

import pytest
import torch

import mtrain

SEED = int(os.environ.get("MTRAIN_TEST_SEED", "1234"))
# One library thread unless asked otherwise: the suite runs beside other work
# on two cores, where OpenMP's spinning barriers make tiny calls slow (the
# OpenMP paths are tested by ctest).
os.environ.setdefault("MTRAIN_NUM_THREADS", "1")


def pytest_report_header(config: pytest.Config) -> list[str]:
    del config
    return [
        f"mtrain {mtrain.__version__} from {os.path.dirname(mtrain.__file__)}",
        f"libmtrain: {mtrain.library_path()} (backends {', '.join(mtrain.backends())})",
        f"torch {torch.__version__}, seed {SEED} (MTRAIN_TEST_SEED)",
    ]


def seed_of(name: str) -> int:
    return (SEED * 1000003 + sum((i + 1) * ord(c) for i, c in enumerate(name))) % (2**31)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from SEED and the test's name (the seed is printed)."""
    seed = seed_of(request.node.name)
    print(f"seed {seed} ({request.node.name})")
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [N, Hq, d], lse [N, Hq] of attention restricted to mask [Hq, N, N],
    computed in the inputs' dtype, differentiable."""
    _, hq, d = q.shape
    g = hq // k.shape[1]
    kr = k.repeat_interleave(g, dim=1)
    vr = v.repeat_interleave(g, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kr) * (scale if scale is not None else 1 / math.sqrt(d))
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("hij,jhd->ihd", p, vr)
    return o, lse.transpose(0, 1)


def causal_mask(n: int, heads: int) -> torch.Tensor:
    i = torch.arange(n)
    return (i[:, None] >= i[None, :]).expand(heads, n, n)


def varlen_mask(masks: list[torch.Tensor]) -> torch.Tensor:
    """Block-diagonal combination of per-sequence masks [H, n_s, n_s]."""
    heads = masks[0].shape[0]
    total = sum(m.shape[1] for m in masks)
    out = torch.zeros(heads, total, total, dtype=torch.bool)
    o = 0
    for m in masks:
        n = m.shape[1]
        out[:, o : o + n, o : o + n] = m
        o += n
    return out


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dout: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """o, lse, dq, dk, dv of masked attention computed in `dtype` (float64: the
    reference; a low precision: the naive computation of SPEC.md section 7)."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = masked_attention(qq, kk, vv, mask)
    o.backward(dout.to(dtype))
    assert qq.grad is not None and kk.grad is not None and vv.grad is not None
    return {"o": o.detach(), "lse": lse.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def run_mtrain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, **kwargs: object
) -> dict[str, torch.Tensor]:
    """o, lse, dq, dk, dv of mtrain.attention(q, k, v, **kwargs)."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = mtrain.attention(qq, kk, vv, return_lse=True, **kwargs)
    o.backward(dout)
    assert qq.grad is not None and kk.grad is not None and vv.grad is not None
    return {"o": o.detach(), "lse": lse.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def assert_close_spec(
    got: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    naive: dict[str, torch.Tensor] | None = None,
    names: tuple[str, ...] = ("o", "lse", "dq", "dk", "dv"),
) -> None:
    """docs/SPEC.md section 7, per output: e <= 1e-4 * M (fp32), and for bf16
    and fp16 e <= max(2 * e_naive, 1e-4 * M), e_naive being the error of the
    naive computation in that dtype (every intermediate rounded to it)."""
    for name in names:
        g = got[name].double()
        r = ref[name].double()
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        e = (g - r).abs().max().item()
        m = r.abs().max().item()
        bound = 1e-4 * m
        if naive is not None:
            bound = max(bound, 2 * (naive[name].double() - r).abs().max().item())
        assert e <= bound, f"{name}: max error {e:.3e} > bound {bound:.3e} (max |ref| {m:.3e})"
