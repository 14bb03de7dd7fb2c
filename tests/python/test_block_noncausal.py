"""Non-causal block selection (mtrain.select_blocks(..., causal=False),
docs/SPEC.md section 9.7) against an independent float64 reading of the
spec written here: dense scores over every key, the softmax over all keys
and its block masses (precise), strided antidiagonal sums over every real
key (antidiag), block-mean logits over every key block (meanpool), the
symmetric forced blocks and the ranking over every key block; on cpu-ref
(float64), random inputs with printed seeds, lengths that are not multiples
of the granularity, GQA, head dims 64 and 128. Then the selected non-causal
patterns through mtrain.attention on the cpu backend (float32), forward and
gradients, against float64 SDPA masked by the same pattern; and the
refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import mtrain
from conftest import assert_close_spec, randn, run_mtrain

F64 = torch.float64


def _nb(n: int, g: int) -> int:
    return -(-n // g)


def _onehot(n: int, g: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.arange(n) // g, _nb(n, g)).to(F64)


def dense_logits(q: torch.Tensor, k: torch.Tensor, h: int) -> torch.Tensor:
    """s * q_h . k_kv(h) for every (query, key) pair, float64 [N, N]."""
    group = q.shape[1] // k.shape[1]
    return (q[:, h].to(F64) @ k[:, h // group].to(F64).T) / math.sqrt(q.shape[2])


def dense_lse(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The LSE of bidirectional dense attention, [N, Hq] float64."""
    return torch.stack(
        [torch.logsumexp(dense_logits(q, k, h), dim=1) for h in range(q.shape[1])], 1
    )


def block_masses(q: torch.Tensor, k: torch.Tensor, g: int) -> torch.Tensor:
    """w [Hq, nb, nb]: the softmax over all keys summed per (query block, key
    block), the precise scores with the dense LSE."""
    onehot = _onehot(q.shape[0], g)
    return torch.stack(
        [onehot.T @ torch.softmax(dense_logits(q, k, h), dim=1) @ onehot for h in range(q.shape[1])]
    )


def antidiag_scores(q: torch.Tensor, k: torch.Tensor, g: int, stride: int) -> torch.Tensor:
    """w [Hq, nb, nb]: X(a, c) over the terms with a real query and a real key
    (every strided column), softmaxed per strided row over its defined
    columns, summed per block."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    s = stride
    rows = -(-n // s)
    nb = _nb(n, g)
    idx = torch.arange(rows)
    onehot = torch.nn.functional.one_hot((idx * s) // g, nb).to(F64)
    w = torch.zeros(hq, nb, nb, dtype=F64)
    for h in range(hq):
        qp = torch.zeros(rows * s, d, dtype=F64)
        kp = torch.zeros(rows * s, d, dtype=F64)
        qp[:n], kp[:n] = q[:, h].to(F64), k[:, h // group].to(F64)
        logits = (qp @ kp.T).view(rows, s, rows, s)
        x = torch.zeros(rows, rows, dtype=F64)
        terms = torch.zeros(rows, rows, dtype=torch.int64)
        for t in range(s):
            ok = ((idx * s + t) < n)[:, None] & ((idx * s + s - 1 - t) < n)[None, :]
            x += torch.where(ok, logits[:, t, :, s - 1 - t], 0.0)
            terms += ok
        x = (x / math.sqrt(d) / s).masked_fill(terms == 0, -math.inf)
        w[h] = onehot.T @ torch.softmax(x, dim=1) @ onehot
    return w


def meanpool_scores(q: torch.Tensor, k: torch.Tensor, g: int) -> torch.Tensor:
    """w [Hq, nb, nb]: s * mean q of the query block . mean k of the key block."""
    onehot = _onehot(q.shape[0], g)
    count = onehot.sum(0)[:, None, None]
    qbar = torch.einsum("nb,nhd->bhd", onehot, q.to(F64)) / count
    kbar = torch.einsum("nb,nhd->bhd", onehot, k.to(F64)) / count
    group = q.shape[1] // k.shape[1]
    return torch.stack(
        [qbar[:, h] @ kbar[:, h // group].T / math.sqrt(q.shape[2]) for h in range(q.shape[1])]
    )


def select_ref(
    w: torch.Tensor,
    *,
    top_k: int | list[int] | None = None,
    top_p: float | None = None,
    sink: int = 1,
    local: int = 1,
) -> tuple[torch.Tensor, list[float]]:
    """The block masks of 9.4 with 9.7's candidates (every key block) and
    forced blocks (the diagonal, kb < sink, |kb - qb| < local); recalls."""
    hq, nb, _ = w.shape
    mask = torch.zeros(hq, nb, nb, dtype=torch.bool)
    recalls = []
    for h in range(hq):
        budget = top_k[h] if isinstance(top_k, list) else top_k
        kept_sum = total_sum = 0.0
        for qb in range(nb):
            row = w[h, qb].tolist()
            forced = [kb for kb in range(nb) if kb == qb or kb < sink or abs(kb - qb) < local]
            cands = [kb for kb in range(nb) if kb not in forced]
            order = sorted(cands, key=lambda kb: (-row[kb], kb))
            total = 0.0
            for kb in range(nb):
                total += row[kb]
            kept = 0.0
            for kb in forced:
                kept += row[kb]
            keep = list(forced)
            if budget is not None:
                keep += order[:budget]
                for kb in order[:budget]:
                    kept += row[kb]
            else:
                assert top_p is not None
                for kb in order:
                    if not kept < top_p * total:
                        break
                    keep.append(kb)
                    kept += row[kb]
            mask[h, qb, keep] = True
            kept_sum += kept
            total_sum += total
        recalls.append(kept_sum / total_sum)
    return mask, recalls


def masks_of(p: mtrain.Pattern) -> torch.Tensor:
    assert not p.causal, "expected a non-causal pattern"
    return torch.stack([p.block_mask(h) for h in range(p.num_heads)])


def inputs(
    gen: torch.Generator, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k with a few keys that every query prefers (also later ones than the
    query), so that the selections are neither empty nor dense."""
    q, k = randn(gen, n, hq, d, dtype=F64), randn(gen, n, hkv, d, dtype=F64)
    q[..., 0] += 1.5
    hot = torch.randperm(n, generator=gen)[: max(2, n // 40)]
    k[hot, :, 0] += 4.0
    return q.to(dtype), k.to(dtype)


def above_diagonal(mask: torch.Tensor) -> int:
    nb = mask.shape[-1]
    return int((mask & torch.ones(nb, nb, dtype=torch.bool).triu(1)).sum())


# ---------------------------------------------------------------------------
# the selection against the reference (cpu-ref, float64)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "n"), [(64, 301), (128, 250)])
def test_precise_block_masses(gen: torch.Generator, d: int, n: int) -> None:
    """With the dense bidirectional LSE the precise scores are the block masses
    of the softmax over all keys: the selection equals the reference's, the
    reported recall is the dense softmax mass inside the pattern, and blocks
    above the diagonal are selected."""
    hq, hkv, g = 4, 2, 32
    q, k = inputs(gen, n, hq, hkv, d)
    lse = dense_lse(q, k)
    w = block_masses(q, k, g)
    assert torch.allclose(w.sum(dim=2), _onehot(n, g).sum(0).expand(hq, -1), rtol=0, atol=1e-9)
    probs = torch.stack([torch.softmax(dense_logits(q, k, h), dim=1) for h in range(hq)])
    for budget, sink, local in (
        ({"top_p": 0.5}, 1, 1), ({"top_p": 0.9}, 1, 1), ({"top_p": 0.8}, 0, 2),
        ({"top_k": 2}, 1, 1), ({"top_k": 3}, 2, 3), ({"top_k": 0}, 1, 1),
    ):  # fmt: skip
        pats, reps = mtrain.select_blocks(
            q, k, method="precise", lse=lse, granularity=g, causal=False, sink_blocks=sink,
            local_blocks=local, report=True, **budget,
        )  # fmt: skip
        want, recalls = select_ref(w, sink=sink, local=local, **budget)
        got = masks_of(pats[0])
        assert torch.equal(got, want), (budget, sink, local, (got != want).nonzero()[:8])
        assert (above_diagonal(got) > 0) == (budget != {"top_k": 0}), budget
        assert torch.allclose(reps[0].recall, torch.tensor(recalls, dtype=F64), rtol=0, atol=1e-12)
        allowed = pats[0].mask()
        assert allowed.shape == (hq, n, n)
        for h in range(hq):
            mass = float((probs[h] * allowed[h]).sum()) / n
            assert abs(float(reps[0].recall[h]) - mass) <= 1e-9, (budget, h)
            if "top_p" in budget:
                assert mass >= budget["top_p"] - 1e-9
    # head-adaptive budgets keep the total and select each head with its budget
    pats, reps = mtrain.select_blocks(
        q, k, method="precise", lse=lse, top_k=2, head_adaptive=True, granularity=g,
        causal=False, report=True,
    )  # fmt: skip
    budgets = reps[0].top_k.tolist()
    assert sum(budgets) == 2 * hq
    assert torch.equal(masks_of(pats[0]), select_ref(w, top_k=budgets)[0])


@pytest.mark.parametrize(("d", "stride"), [(64, 8), (128, 4)])
def test_antidiag(gen: torch.Generator, d: int, stride: int) -> None:
    n, hq, hkv, g = 299, 6, 2, 32  # 299 = 37 * 8 + 3: the last strided row and column partial
    q, k = inputs(gen, n, hq, hkv, d)
    w = antidiag_scores(q, k, g, stride)
    for budget, sink, local in (
        ({"top_p": 0.9}, 1, 1), ({"top_p": 0.4}, 0, 2), ({"top_k": 2}, 1, 1), ({"top_k": 4}, 0, 1),
    ):  # fmt: skip
        pats, reps = mtrain.select_blocks(
            q, k, method="antidiag", granularity=g, stride=stride, sink_blocks=sink,
            local_blocks=local, causal=False, report=True, **budget,
        )  # fmt: skip
        want, recalls = select_ref(w, sink=sink, local=local, **budget)
        got = masks_of(pats[0])
        assert torch.equal(got, want), (budget, sink, local, (got != want).nonzero()[:8])
        assert above_diagonal(got) > 0, budget
        assert torch.allclose(reps[0].recall, torch.tensor(recalls, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [64, 128])
def test_meanpool(gen: torch.Generator, d: int) -> None:
    n, hq, hkv, g = 301, 4, 1, 32
    q, k = inputs(gen, n, hq, hkv, d)
    w = meanpool_scores(q, k, g)
    for top_k, sink, local in ((2, 1, 1), (1, 0, 2), (20, 1, 1)):
        pats, reps = mtrain.select_blocks(
            q, k, method="meanpool", top_k=top_k, granularity=g, sink_blocks=sink,
            local_blocks=local, causal=False, report=True,
        )  # fmt: skip
        want, _ = select_ref(w, top_k=top_k, sink=sink, local=local)
        assert torch.equal(masks_of(pats[0]), want), (top_k, sink, local)
        assert reps[0].blocks.tolist() == want.sum(dim=(1, 2)).tolist()
        assert torch.isnan(reps[0].recall).all()


def test_causal_default_unchanged(gen: torch.Generator) -> None:
    """causal=True (the default) still selects below the diagonal only, and
    differs from the non-causal selection on the same inputs."""
    q, k = inputs(gen, 200, 4, 2, 64)
    causal = mtrain.select_blocks(q, k, top_k=2, granularity=32)[0]
    again = mtrain.select_blocks(q, k, top_k=2, granularity=32, causal=True)[0]
    both = mtrain.select_blocks(q, k, top_k=2, granularity=32, causal=False)[0]
    assert causal.causal and again.causal and not both.causal
    cm = torch.stack([causal.block_mask(h) for h in range(4)])
    assert torch.equal(cm, torch.stack([again.block_mask(h) for h in range(4)]))
    assert above_diagonal(cm) == 0 and above_diagonal(masks_of(both)) > 0


# ---------------------------------------------------------------------------
# the selected pattern through the attention (cpu backend, float32)
# ---------------------------------------------------------------------------


def sdpa_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, do: torch.Tensor
) -> dict[str, torch.Tensor]:
    """float64 torch SDPA with the boolean mask [Hq, N, N]: o, lse, dq, dk, dv."""
    hq, group = q.shape[1], q.shape[1] // k.shape[1]
    qq, kk, vv = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    qh = qq.transpose(0, 1)
    kh = kk.repeat_interleave(group, dim=1).transpose(0, 1)
    vh = vv.repeat_interleave(group, dim=1).transpose(0, 1)
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    o = o.transpose(0, 1)
    o.backward(do.to(F64))
    logits = (qh @ kh.transpose(1, 2)) / math.sqrt(q.shape[2])
    lse = torch.logsumexp(logits.masked_fill(~mask, -math.inf), dim=-1).transpose(0, 1)
    assert qq.grad is not None and kk.grad is not None and vv.grad is not None
    assert lse.shape == (q.shape[0], hq)
    return {"o": o.detach(), "lse": lse.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}


@pytest.mark.parametrize(("method", "d"), [("antidiag", 64), ("meanpool", 128), ("precise", 64)])
def test_selected_pattern_through_attention(gen: torch.Generator, method: str, d: int) -> None:
    """fp32 non-causal selection on the cpu backend, its pattern as pattern=:
    the outputs and every gradient equal float64 SDPA masked by the same
    pattern within SPEC.md section 7's bound."""
    n, hq, hkv, g = 203, 4, 2, 16
    q, k = inputs(gen, n, hq, hkv, d, torch.float32)
    v, do = randn(gen, n, hkv, d), randn(gen, n, hq, d)
    budget: dict[str, Any] = {"top_p": 0.6} if method != "meanpool" else {"top_k": 3}
    if method == "precise":
        budget["lse"] = dense_lse(q, k).float()
    pats = mtrain.select_blocks(q, k, method=method, granularity=g, causal=False, **budget)
    p = pats[0]
    assert not p.causal and p.density() < 0.85, f"{method}: density {p.density():.3f}"
    mask = p.mask()
    assert above_diagonal(masks_of(p)) > 0
    got = run_mtrain(q, k, v, do, pattern=pats, granularity=g)
    assert_close_spec(got, sdpa_reference(q, k, v, mask, do))


# ---------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------


def test_errors() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = randn(g, 64, 4, 16), randn(g, 64, 2, 16)
    with pytest.raises(mtrain.MtrainError, match="causal='no' must be a bool"):
        mtrain.select_blocks(q, k, top_k=1, granularity=16, causal="no")
    with pytest.raises(mtrain.MtrainError, match="meanpool gating is top-k only"):
        mtrain.select_blocks(q, k, method="meanpool", top_p=0.5, granularity=16, causal=False)
