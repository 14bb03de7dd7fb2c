"""The dense fallback of mtrain.attention (mtrain.fallback): above ``dense_above`` the estimated
pattern's layer runs torch's dense attention, which must then equal causal attention (forward
and gradients, against the float64 reference), with GQA, packed varlen and batched inputs; at
or below it the sparse kernels run, bitwise as without a threshold; bad thresholds are
refused naming the value."""

from __future__ import annotations

import logging

import pytest
import torch

import mtrain
from conftest import causal_mask, randn, reference, varlen_mask


def run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, **kwargs: object
) -> dict[str, torch.Tensor]:
    """o, dq, dk, dv of mtrain.attention(q, k, v, **kwargs) (no lse: the fallback's condition)."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = mtrain.attention(qq, kk, vv, **kwargs)
    o.backward(dout)
    assert qq.grad is not None and kk.grad is not None and vv.grad is not None
    return {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


def close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    for name in ("o", "dq", "dk", "dv"):
        err = (got[name].double() - ref[name]).abs().max().item()
        assert err <= tol, f"{name}: max error {err} > {tol}"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_dense_above_zero_runs_dense(gen: torch.Generator) -> None:
    n, hq, hkv, d = 300, 4, 2, 64
    q, k, v, do = (randn(gen, n, h, d) for h in (hq, hkv, hkv, hq))
    mtrain.dense_fallback_counts(reset=True)
    budget = mtrain.TopK(8, 40)
    log = logging.getLogger("mtrain")
    records, level = _Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        got = run(q, k, v, do, budgets=budget, layer=3, granularity=64, dense_above=0.0)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert mtrain.dense_fallback_counts()["dense"] == 1
    assert mtrain.dense_fallback_counts()["sparse"] == 0
    assert any("layer 3: pattern density" in m for m in records.messages), records.messages
    # dense causal attention, not the sparse pattern
    close(got, reference(q, k, v, causal_mask(n, hq), do), 2e-5)
    sparse = run(q, k, v, do, budgets=budget, granularity=64)
    assert (sparse["o"] - got["o"]).abs().max() > 1e-3  # the pattern was sparse


def test_threshold_above_density_runs_sparse_bitwise(gen: torch.Generator) -> None:
    n, hq, hkv, d = 257, 4, 1, 64
    q, k, v, do = (randn(gen, n, h, d) for h in (hq, hkv, hkv, hq))
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(8, 40), granularity=32)
    mtrain.dense_fallback_counts(reset=True)
    got = run(q, k, v, do, pattern=plan, dense_above=1.0)
    want = run(q, k, v, do, pattern=plan)
    assert mtrain.dense_fallback_counts()["sparse"] == 1
    assert mtrain.dense_fallback_counts()["dense"] == 0
    for name in ("o", "dq", "dk", "dv"):
        assert torch.equal(got[name], want[name]), name


def test_varlen_and_batched_dense(gen: torch.Generator) -> None:
    lens = [97, 160]
    hq, hkv, d = 4, 1, 64
    n = sum(lens)
    q, k, v, do = (randn(gen, n, h, d) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, 97, 257])
    got = run(
        q, k, v, do, budgets=mtrain.TopK(8, 40), cu_seqlens=cu, granularity=32, dense_above=0.0
    )
    close(got, reference(q, k, v, varlen_mask([causal_mask(m, hq) for m in lens]), do), 2e-5)
    b, m = 2, 96
    q4, k4, v4 = (randn(gen, b, m, h, d) for h in (hq, hkv, hkv))
    o4 = mtrain.attention(q4, k4, v4, budgets=mtrain.TopK(4, 20), granularity=32, dense_above=0.0)
    assert o4.shape == q4.shape
    for i in range(b):
        want = torch.nn.functional.scaled_dot_product_attention(
            q4[i].transpose(0, 1), k4[i].transpose(0, 1), v4[i].transpose(0, 1),
            is_causal=True, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        assert (o4[i] - want).abs().max() < 1e-6


def test_auto_never_falls_back_on_cpu(gen: torch.Generator) -> None:
    n, hq, d = 200, 2, 64
    q, k, v, do = (randn(gen, n, hq, d) for _ in range(4))
    mtrain.dense_fallback_counts(reset=True)
    got = run(q, k, v, do, budgets=mtrain.TopK(n, n), granularity=32, dense_above="auto")
    want = run(q, k, v, do, budgets=mtrain.TopK(n, n), granularity=32)
    assert mtrain.dense_fallback_counts()["sparse"] == mtrain.dense_fallback_counts()["dense"] == 0
    assert torch.equal(got["o"], want["o"])


def test_return_lse_keeps_the_sparse_kernels(gen: torch.Generator) -> None:
    n, hq, d = 128, 2, 64
    q, k, v = (randn(gen, n, hq, d) for _ in range(3))
    mtrain.dense_fallback_counts(reset=True)
    _, lse = mtrain.attention(
        q, k, v, budgets=mtrain.TopK(4, 16), granularity=32, dense_above=0.0, return_lse=True
    )
    assert lse.shape == (n, hq) and mtrain.dense_fallback_counts()["dense"] == 0


def test_dense_recheck_skips_estimates(gen: torch.Generator) -> None:
    n, hq, d = 256, 2, 64
    q, k, v = (randn(gen, n, hq, d) for _ in range(3))
    mtrain.dense_fallback_counts(reset=True)
    kw = {"budgets": mtrain.TopK(4, 16), "layer": 0, "granularity": 32, "dense_above": 0.0}
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    for call in range(7):
        o = mtrain.attention(q, k, v, dense_recheck=3, **kw)
        assert (o - want).abs().max() < 1e-6
        # calls 0, 3, 6 estimate; the two after each run dense without estimating
        assert mtrain.dense_fallback_counts()["estimates_skipped"] == call - call // 3
    assert mtrain.dense_fallback_counts() == {"sparse": 0, "dense": 7, "estimates_skipped": 4}
    # another layer (or other budgets) has its own decision; a sparse decision is not kept
    mtrain.attention(q, k, v, dense_recheck=3, **{**kw, "layer": 1, "dense_above": 1.0})
    mtrain.attention(q, k, v, dense_recheck=3, **{**kw, "layer": 1, "dense_above": 1.0})
    assert mtrain.dense_fallback_counts() == {"sparse": 2, "dense": 7, "estimates_skipped": 4}


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_recheck_is_refused(gen: torch.Generator, bad: object) -> None:
    q, k, v = (randn(gen, 64, 2, 64) for _ in range(3))
    with pytest.raises(mtrain.MtrainError, match="dense_recheck"):
        mtrain.attention(
            q, k, v, budgets=mtrain.TopK(4, 16), granularity=32, dense_above=0.5, dense_recheck=bad
        )


@pytest.mark.parametrize("bad", [-0.1, 1.5, "fast", True, [0.5]])
def test_bad_threshold_is_refused(gen: torch.Generator, bad: object) -> None:
    q, k, v = (randn(gen, 64, 2, 64) for _ in range(3))
    with pytest.raises(mtrain.MtrainError, match="dense_above"):
        mtrain.attention(q, k, v, budgets=mtrain.TopK(4, 16), granularity=32, dense_above=bad)


def test_sparse_decisions_held_only_for_device_plans() -> None:
    """remember(hold_sparse=True) (a plan built on the GPU, whose density is read back with a
    wait) keeps a sparse decision for recheck - 1 calls, counted as sparse; without it (host
    plans) and with recheck 1 nothing is held; a dense decision replaces a held sparse one."""
    from mtrain import fallback

    fallback.dense_fallback_counts(reset=True)
    fallback.remember("a", False, 3, hold_sparse=True)
    assert [fallback.still_sparse("a") for _ in range(3)] == [True, True, False]
    assert fallback.dense_fallback_counts()["sparse"] == 2
    fallback.remember("b", False, 3)
    fallback.remember("c", False, 1, hold_sparse=True)
    assert not fallback.still_sparse("b") and not fallback.still_sparse("c")
    fallback.remember("a", False, 4, hold_sparse=True)
    fallback.remember("a", True, 2)
    assert not fallback.still_sparse("a") and fallback.still_dense("a")
    fallback.dense_fallback_counts(reset=True)
