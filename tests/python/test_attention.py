"""mtrain.attention against explicit masked attention in float64: forward (o,
lse) and every gradient, over dtypes, GQA, head_dim 64 and 128, lengths that
are not multiples of the block, packed (varlen) and batched inputs, and the
pattern sources (dense, given vertical-slash, block mask, pattern file,
online estimate)."""

from __future__ import annotations

import math

import pytest
import torch

import mtrain
from conftest import (
    assert_close_spec,
    causal_mask,
    randn,
    reference,
    run_mtrain,
    varlen_mask,
)


def random_vs_pattern(
    gen: torch.Generator, n: int, heads: int, g: int
) -> tuple[mtrain.Pattern, torch.Tensor]:
    """A random vertical-slash pattern and its mask."""
    nb = -(-n // g)
    spec = []
    for _ in range(heads):
        diag = sorted(
            {0} | {int(x) for x in torch.randint(0, nb, (max(1, nb // 3),), generator=gen)}
        )
        vert = sorted({int(x) for x in torch.randint(0, n, (max(1, n // 10),), generator=gen)})
        spec.append((diag, vert))
    p = mtrain.vertical_slash_pattern(n, spec, granularity=g)
    return p, p.mask()


def inputs(
    gen: torch.Generator, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    return tuple(randn(gen, n, h, d, dtype=dtype) for h in (hq, hkv, hkv, hq))


@pytest.mark.parametrize(
    ("dtype", "hq", "hkv", "d"),
    [
        (torch.float32, 4, 2, 64),
        (torch.float32, 3, 3, 128),
        (torch.bfloat16, 4, 1, 128),
        (torch.float16, 4, 2, 64),
        (torch.float64, 2, 1, 64),
    ],
)
def test_vertical_slash_against_reference(
    gen: torch.Generator, dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    n, g = 203, 32  # 7 blocks, the last one partial
    q, k, v, do = inputs(gen, n, hq, hkv, d, dtype)
    pattern, mask = random_vs_pattern(gen, n, hq, g)
    got = run_mtrain(q, k, v, do, pattern=pattern)
    ref = reference(q, k, v, mask, do)
    naive = (
        reference(q, k, v, mask, do, dtype) if dtype in (torch.bfloat16, torch.float16) else None
    )
    assert_close_spec(got, ref, naive)
    assert got["o"].dtype == dtype


def test_dense_default_equals_sdpa(gen: torch.Generator) -> None:
    n, hq, hkv, d = 150, 4, 2, 64
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    got = run_mtrain(q, k, v, do, granularity=32)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    o.backward(do)
    sdpa = {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    ref = reference(q, k, v, causal_mask(n, hq), do)
    assert_close_spec(got, ref)
    # and SDPA itself meets the same bound against the reference (the two agree)
    assert_close_spec(sdpa, ref, names=("o", "dq", "dk", "dv"))


def test_full_budget_is_dense(gen: torch.Generator) -> None:
    """A budget that keeps every slash selects every block diagonal: the
    estimated pattern is the dense one and the result equals dense SDPA."""
    n, hq, hkv, d = 260, 4, 2, 64
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(n, n), granularity=64)
    for p in plan.patterns:
        nb = p.num_blocks
        for h in range(hq):
            assert p.head(h)[0] == list(range(nb))
    assert plan.computed_pairs == hq * n * (n + 1) // 2
    got = run_mtrain(q, k, v, do, pattern=plan)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    o.backward(do)
    sdpa = {"o": o.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    assert_close_spec(got, sdpa, names=("o", "dq", "dk", "dv"))


def test_block_mask(gen: torch.Generator) -> None:
    n, g, hq, hkv, d = 170, 32, 2, 1, 64
    nb = -(-n // g)
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    blocks = torch.rand(hq, nb, nb, generator=gen) < 0.4
    blocks &= torch.ones(nb, nb, dtype=torch.bool).tril()
    got = run_mtrain(q, k, v, do, pattern=blocks, granularity=g)
    mask = mtrain.block_mask_pattern(blocks, n, g).mask()
    # the mask is what SPEC.md says: listed blocks (and the diagonal), causal
    i = torch.arange(n)
    qb, kb = (i // g)[:, None], (i // g)[None, :]
    expect = (blocks[:, qb, kb] | (qb == kb)) & (i[:, None] >= i[None, :])
    assert torch.equal(mask, expect)
    assert_close_spec(got, reference(q, k, v, mask, do))


def test_noncausal_block_mask(gen: torch.Generator, tmp_path: object) -> None:
    """A non-causal block mask (SPEC.md section 1, "Non-causal patterns"): blocks above the diagonal
    attend, the diagonal block is not masked token by token; through the op,
    forward and every gradient, and through a pattern file."""
    n, g, hq, hkv, d = 170, 32, 4, 2, 64
    nb = -(-n // g)
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    blocks = torch.rand(hq, nb, nb, generator=gen) < 0.4
    pattern = mtrain.block_mask_pattern(blocks, n, g, causal=False)
    assert not pattern.causal
    mask = pattern.mask()
    qb = (torch.arange(n) // g)[:, None]
    kb = (torch.arange(n) // g)[None, :]
    assert torch.equal(mask, blocks[:, qb, kb] | (qb == kb))
    assert bool(mask.triu(1).any())  # keys after the query take part
    expect = reference(q, k, v, mask, do)
    assert_close_spec(run_mtrain(q, k, v, do, pattern=pattern), expect)
    path = f"{tmp_path}/noncausal.json"
    pattern.save(path)
    assert not mtrain.load_pattern(path).causal
    assert_close_spec(run_mtrain(q, k, v, do, pattern=path), expect)
    with pytest.raises(mtrain.MtrainError, match="above the causal diagonal"):
        mtrain.block_mask_pattern(blocks | torch.ones(nb, nb, dtype=torch.bool), n, g)


def test_pattern_file_round_trip(gen: torch.Generator, tmp_path: object) -> None:
    n, g, hq, hkv, d = 140, 32, 2, 2, 64
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    pattern, mask = random_vs_pattern(gen, n, hq, g)
    path = f"{tmp_path}/p.json"
    pattern.save(path)
    loaded = mtrain.load_pattern(path)
    assert [loaded.head(h) for h in range(hq)] == [pattern.head(h) for h in range(hq)]
    got = run_mtrain(q, k, v, do, pattern=path)
    assert_close_spec(got, reference(q, k, v, mask, do))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_packed(gen: torch.Generator, dtype: torch.dtype) -> None:
    lens = [77, 126, 33, 64]
    g, hq, hkv, d = 32, 4, 2, 64
    n = sum(lens)
    q, k, v, do = inputs(gen, n, hq, hkv, d, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pats = [random_vs_pattern(gen, m, hq, g) for m in lens]
    got = run_mtrain(q, k, v, do, pattern=[p for p, _ in pats], cu_seqlens=cu)
    mask = varlen_mask([m for _, m in pats])
    ref = reference(q, k, v, mask, do)
    naive = reference(q, k, v, mask, do, dtype) if dtype != torch.float32 else None
    assert_close_spec(got, ref, naive)


def test_varlen_dense_and_estimated(gen: torch.Generator) -> None:
    lens = [97, 160]
    g, hq, hkv, d = 32, 4, 1, 64
    n = sum(lens)
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    cu = torch.tensor([0, 97, 257])
    got = run_mtrain(q, k, v, do, cu_seqlens=cu, granularity=g)
    assert_close_spec(got, reference(q, k, v, varlen_mask([causal_mask(m, hq) for m in lens]), do))
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(8, 40), cu_seqlens=cu, granularity=g)
    assert [p.seq_len for p in plan.patterns] == lens
    got = run_mtrain(q, k, v, do, pattern=plan, cu_seqlens=cu)
    mask = varlen_mask([p.mask() for p in plan.patterns])
    assert mask.sum() < varlen_mask([causal_mask(m, hq) for m in lens]).sum()  # sparse
    assert_close_spec(got, reference(q, k, v, mask, do))


def test_batched_equals_packed(gen: torch.Generator) -> None:
    b, n, hq, hkv, d = 3, 96, 4, 2, 64
    q4, k4, v4 = (randn(gen, b, n, h, d) for h in (hq, hkv, hkv))
    do4 = randn(gen, b, n, hq, d)
    pattern, mask = random_vs_pattern(gen, n, hq, 32)
    got = run_mtrain(q4, k4, v4, do4, pattern=pattern)
    assert got["o"].shape == (b, n, hq, d) and got["lse"].shape == (b, n, hq)
    flat = [t.reshape(b * n, *t.shape[2:]) for t in (q4, k4, v4, do4)]
    ref = reference(*flat[:3], varlen_mask([mask] * b), flat[3])
    assert_close_spec({key: t.reshape(b * n, *t.shape[2:]) for key, t in got.items()}, ref)


def test_estimate_with_budget_file(gen: torch.Generator) -> None:
    """The real Qwen2.5-3B budgets (16 query heads) at layer 31, top-k, and
    the top-p file: the plan is the estimate's, the result the reference's."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "data" / "budgets"
    n, hq, hkv, d = 256, 16, 2, 64
    q, k, v, do = inputs(gen, n, hq, hkv, d, torch.float32)
    for name, layer in (
        ("Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json", 31),
        ("Qwen2.5_3B_flex_0.90.json", 3),
    ):
        plan = mtrain.estimate_pattern(q, k, root / name, layer, granularity=32, last_q=32)
        got = run_mtrain(q, k, v, do, pattern=plan)
        assert_close_spec(got, reference(q, k, v, plan.patterns[0].mask(), do))
    # one step's plan serves the forward and the backward: the same handle
    o = mtrain.attention(q, k, v, budgets=root / name, layer=3, granularity=32, last_q=32)
    assert o.shape == q.shape


def test_softmax_scale(gen: torch.Generator) -> None:
    n, hq, d = 64, 2, 64
    q, k, v, do = inputs(gen, n, hq, hq, d, torch.float32)
    got = run_mtrain(q, k, v, do, softmax_scale=0.3, granularity=32)
    qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
    from conftest import masked_attention

    o, lse = masked_attention(qq, kk, vv, causal_mask(n, hq), scale=0.3)
    o.backward(do.double())
    ref = {"o": o.detach(), "lse": lse.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    assert_close_spec(got, ref)  # type: ignore[arg-type]
    assert not math.isclose(0.3, 1 / math.sqrt(d))
