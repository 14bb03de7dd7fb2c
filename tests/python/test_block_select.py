"""mtrain.select_blocks against an independent pure-torch float64 reading of
docs/SPEC.md section 9: the scores (mean-pooled gating, strided antidiagonal
sums, precise block masses), the forced sink and local blocks, the causal
block triangle, the ranking with its ties (equal scores: the lower key block
first), top-k, top-p and the head-adaptive budgets; on the cpu-ref backend
(float64 inputs), several head dims, GQA, lengths that are not multiples of
the granularity, packed and batched inputs. Then: the selected patterns run
through mtrain.attention (forward and backward) equal float64 masked
attention within SPEC.md section 7's bound; the precise search with the LSE
of dense attention reports each head's recall of the attention mass; bad
options fail naming the problem; and the context-parallel selection on 2 and
3 gloo processes equals the single-process one bitwise (patterns and
reports). Seeds are printed (conftest.gen)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import mtrain
from conftest import assert_close_spec, randn, reference, run_mtrain, varlen_mask

F64 = torch.float64

# ---------------------------------------------------------------------------
# the reference: SPEC.md section 9 in plain torch, float64
# ---------------------------------------------------------------------------


def _nb(n: int, g: int) -> int:
    return -(-n // g)


def meanpool_scores(q: torch.Tensor, k: torch.Tensor, g: int, scale: float) -> torch.Tensor:
    """w [Hq, nb, nb] of 9.3 (entries kb > qb unused): s * mean q of the query
    block . mean k of the key block, each mean summed in ascending order."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    nb = _nb(n, g)

    def means(x: torch.Tensor) -> torch.Tensor:
        out = []
        for b in range(nb):
            rows = range(b * g, min(n, (b + 1) * g))
            s = torch.zeros_like(x[0])
            for r in rows:
                s = s + x[r]
            out.append(s / len(rows))
        return torch.stack(out)  # [nb, H, d]

    qbar, kbar = means(q.to(F64)), means(k.to(F64))
    w = torch.zeros(hq, nb, nb, dtype=F64)
    for h in range(hq):
        w[h] = scale * (qbar[:, h] @ kbar[:, h // group].T)
    return w


def antidiag_scores(
    q: torch.Tensor, k: torch.Tensor, g: int, stride: int, scale: float
) -> torch.Tensor:
    """w [Hq, nb, nb] of 9.2: strided antidiagonal sums X(a, c) over the real,
    causal terms, softmaxed per strided row over its defined columns, summed
    per (query block, key block)."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    s = stride
    a_rows = -(-n // s)
    npad = a_rows * s
    nb = _nb(n, g)
    a = torch.arange(a_rows)
    blk = (a * s) // g  # the block of strided row (column) a
    w = torch.zeros(hq, nb, nb, dtype=F64)
    for h in range(hq):
        qp = torch.zeros(npad, d, dtype=F64)
        kp = torch.zeros(npad, d, dtype=F64)
        qp[:n], kp[:n] = q[:, h].to(F64), k[:, h // group].to(F64)
        logits = (qp @ kp.T).view(a_rows, s, a_rows, s)
        x = torch.zeros(a_rows, a_rows, dtype=F64)
        terms = torch.zeros(a_rows, a_rows, dtype=torch.int64)
        for t in range(s):
            i = a * s + t
            j = a * s + s - 1 - t
            ok = (i[:, None] < n) & (j[None, :] <= i[:, None])
            x += torch.where(ok, logits[:, t, :, s - 1 - t], 0.0)
            terms += ok
        x = x * (scale / s)
        defined = terms > 0
        xm = x.masked_fill(~defined, -math.inf)
        e = torch.exp(xm - xm.max(dim=1, keepdim=True).values)
        p = e / e.sum(dim=1, keepdim=True)
        onehot = torch.nn.functional.one_hot(blk, nb).to(F64)  # [A, nb]
        w[h] = onehot.T @ p @ onehot
    return w


def precise_scores(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, g: int, scale: float
) -> torch.Tensor:
    """w [Hq, nb, nb] of 9.1: sum over the causal pairs of the block of
    exp(s q.k - lse)."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    nb = _nb(n, g)
    i = torch.arange(n)
    onehot = torch.nn.functional.one_hot(i // g, nb).to(F64)
    causal = i[None, :] <= i[:, None]
    w = torch.zeros(hq, nb, nb, dtype=F64)
    for h in range(hq):
        s = scale * (q[:, h].to(F64) @ k[:, h // group].to(F64).T) - lse[:, h, None].to(F64)
        p = torch.where(causal, torch.exp(s), 0.0)
        w[h] = onehot.T @ p @ onehot
    return w


def forced(qb: int, sink: int, local: int) -> list[int]:
    return [kb for kb in range(qb + 1) if kb == qb or kb < sink or kb > qb - local]


def ranking(row: list[float], cands: list[int]) -> list[int]:
    """9.4: highest score first, equal scores the lower key block first, NaN last."""
    return sorted(cands, key=lambda kb: (1, 0.0, kb) if math.isnan(row[kb]) else (0, -row[kb], kb))


def select_ref(
    w: torch.Tensor,
    *,
    top_k: int | list[int] | None = None,
    top_p: float | None = None,
    sink: int = 1,
    local: int = 1,
) -> tuple[torch.Tensor, list[float]]:
    """The block masks [Hq, nb, nb] of 9.4 and each head's recall (kept over
    total, summed over the query blocks in order)."""
    hq, nb, _ = w.shape
    mask = torch.zeros(hq, nb, nb, dtype=torch.bool)
    recalls = []
    for h in range(hq):
        kept_sum = total_sum = 0.0
        budget = top_k[h] if isinstance(top_k, list) else top_k
        for qb in range(nb):
            row = w[h, qb].tolist()
            f = forced(qb, sink, local)
            order = ranking(row, [kb for kb in range(qb + 1) if kb not in f])
            total = 0.0
            for kb in range(qb + 1):
                total += row[kb]
            kept = 0.0
            for kb in f:
                kept += row[kb]
            keep = list(f)
            if budget is not None:
                keep += order[:budget]
                for kb in order[:budget]:
                    kept += row[kb]
            else:
                assert top_p is not None
                if total > 0:  # T <= 0 or NaN: the forced blocks only
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


def adaptive_budgets(w: torch.Tensor, top_k: int, sink: int = 1, local: int = 1) -> list[int]:
    """9.5: the Hq * top_k units of budget, each to the head whose next block
    adds the most recall (equal gains: the lowest head)."""
    hq, nb, _ = w.shape
    ranked: list[list[list[float]]] = []
    totals = []
    most = 0
    for h in range(hq):
        rows, total = [], 0.0
        for qb in range(nb):
            row = w[h, qb].tolist()
            f = forced(qb, sink, local)
            order = ranking(row, [kb for kb in range(qb + 1) if kb not in f])
            rows.append([row[kb] for kb in order])
            most = max(most, len(order))
            total += sum(row[: qb + 1])
        ranked.append(rows)
        totals.append(total)

    def gain(h: int, u: int) -> float:
        if totals[h] <= 0:
            return 0.0
        x = sum(r[u] if u < len(r) else 0.0 for r in ranked[h]) / totals[h]
        return -math.inf if math.isnan(x) else x

    got = [0] * hq
    for _ in range(hq * top_k):
        best, best_gain = -1, -math.inf
        for h in range(hq):
            if got[h] >= most:
                continue
            x = gain(h, got[h])
            if best < 0 or x > best_gain:
                best, best_gain = h, x
        if best < 0:
            break
        got[best] += 1
    return got


def masks_of(p: mtrain.Pattern) -> torch.Tensor:
    assert all(p.is_block_mask(h) for h in range(p.num_heads))
    return torch.stack([p.block_mask(h) for h in range(p.num_heads)])


def inputs(
    gen: torch.Generator, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k with some structure: a shared direction that every query prefers
    on a few keys, so that the selections are neither empty nor dense."""
    q, k = randn(gen, n, hq, d, dtype=F64), randn(gen, n, hkv, d, dtype=F64)
    q[..., 0] += 1.5
    hot = torch.randperm(n, generator=gen)[: max(2, n // 40)]
    k[hot, :, 0] += 4.0
    return q.to(dtype), k.to(dtype)


# ---------------------------------------------------------------------------
# against the reference (cpu-ref, float64)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", [16, 64, 128])
def test_meanpool_top_k(gen: torch.Generator, d: int) -> None:
    n, hq, hkv, g = 301, 4, 2, 32  # 10 blocks, the last of 13 tokens
    q, k = inputs(gen, n, hq, hkv, d)
    w = meanpool_scores(q, k, g, 1 / math.sqrt(d))
    for top_k, sink, local in ((2, 1, 1), (0, 1, 1), (3, 0, 2), (1, 2, 3), (20, 1, 1)):
        pats, reps = mtrain.select_blocks(
            q, k, method="meanpool", top_k=top_k, granularity=g, sink_blocks=sink,
            local_blocks=local, report=True,
        )  # fmt: skip
        assert pats[0].granularity == g and pats[0].seq_len == n
        want, _ = select_ref(w, top_k=top_k, sink=sink, local=local)
        got = masks_of(pats[0])
        assert torch.equal(got, want), (top_k, sink, local)
        rep = reps[0]
        assert torch.isnan(rep.recall).all()  # logits, not masses
        assert rep.top_k.tolist() == [top_k] * hq
        assert rep.blocks.tolist() == want.sum(dim=(1, 2)).tolist()


def test_meanpool_ties_go_to_the_lower_block(gen: torch.Generator) -> None:
    """Key blocks 2 and 3 hold the same keys, which every query prefers: equal
    scores, and top-1 keeps block 2 in every query block that can choose."""
    n, hq, hkv, d, g = 256, 2, 1, 16, 32
    q, k = randn(gen, n, hq, d, dtype=F64), randn(gen, n, hkv, d, dtype=F64)
    q[..., 0] += 2.0
    k[2 * g : 3 * g, :, 0] += 6.0
    k[3 * g : 4 * g] = k[2 * g : 3 * g]
    pats = mtrain.select_blocks(q, k, method="meanpool", top_k=1, granularity=g)
    got = masks_of(pats[0])
    want, _ = select_ref(meanpool_scores(q, k, g, 1 / math.sqrt(d)), top_k=1)
    assert torch.equal(got, want)
    for qb in range(4, 8):
        assert got[:, qb, 2].all() and not got[:, qb, 3].any(), qb


@pytest.mark.parametrize(("d", "stride"), [(16, 8), (64, 4), (128, 16)])
def test_antidiag_top_p(gen: torch.Generator, d: int, stride: int) -> None:
    n, hq, hkv, g = 299, 6, 2, 32  # 10 blocks, the last of 11 tokens (299 = 37 S + 3 for S 8)
    q, k = inputs(gen, n, hq, hkv, d)
    w = antidiag_scores(q, k, g, stride, 1 / math.sqrt(d))
    for top_p, sink, local in ((0.9, 1, 1), (0.5, 1, 1), (0.3, 0, 2), (1.0, 1, 1)):
        pats, reps = mtrain.select_blocks(
            q, k, method="antidiag", top_p=top_p, granularity=g, stride=stride,
            sink_blocks=sink, local_blocks=local, report=True,
        )  # fmt: skip
        want, recalls = select_ref(w, top_p=top_p, sink=sink, local=local)
        got = masks_of(pats[0])
        assert torch.equal(got, want), (top_p, sink, local, (got != want).nonzero()[:8])
        rep = reps[0]
        assert rep.top_k.tolist() == [-1] * hq
        assert rep.blocks.tolist() == want.sum(dim=(1, 2)).tolist()
        assert torch.allclose(rep.recall, torch.tensor(recalls, dtype=F64), rtol=0, atol=1e-12)
        assert (rep.recall >= top_p - 1e-12).all()
    # the densities differ with p: the selection is neither empty nor everything
    d5 = mtrain.select_blocks(q, k, top_p=0.5, granularity=g, stride=stride)[0].density()
    d9 = mtrain.select_blocks(q, k, top_p=0.9, granularity=g, stride=stride)[0].density()
    assert 0.1 < d5 < d9 < 1.0, (d5, d9)


def test_antidiag_top_k_head_adaptive(gen: torch.Generator) -> None:
    n, hq, hkv, d, g, stride = 320, 4, 2, 32, 32, 8
    q, k = inputs(gen, n, hq, hkv, d)
    # head 0 looks at its sink block (forced): its other blocks add little recall, so its
    # units of budget go to the other heads
    q[:, 0, 1] += 3.0
    k[:g, 0, 1] += 5.0
    w = antidiag_scores(q, k, g, stride, 1 / math.sqrt(d))
    pats, reps = mtrain.select_blocks(q, k, top_k=2, granularity=g, report=True)
    want, _ = select_ref(w, top_k=2)
    assert torch.equal(masks_of(pats[0]), want)
    pats, reps = mtrain.select_blocks(q, k, top_k=2, head_adaptive=True, granularity=g, report=True)
    budgets = adaptive_budgets(w, 2)
    assert reps[0].top_k.tolist() == budgets
    assert sum(budgets) == hq * 2 and budgets != [2] * hq, budgets  # the budget moved
    want, recalls = select_ref(w, top_k=budgets)
    assert torch.equal(masks_of(pats[0]), want)
    assert torch.allclose(reps[0].recall, torch.tensor(recalls, dtype=F64), rtol=0, atol=1e-12)


def test_precise_with_dense_lse_reports_the_recall(gen: torch.Generator) -> None:
    """With the LSE of dense attention the block masses are exact attention
    masses: the selection equals the reference's, and each head's reported
    recall is the dense softmax mass inside its pattern, over the rows."""
    n, hq, hkv, d, g = 270, 4, 2, 32, 32
    q, k = inputs(gen, n, hq, hkv, d)
    v = randn(gen, n, hkv, d, dtype=F64)
    _, lse = mtrain.attention(q, k, v, granularity=g, return_lse=True)
    w = precise_scores(q, k, lse, g, 1 / math.sqrt(d))
    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]
    probs = []
    for h in range(hq):
        s = (q[:, h] @ k[:, h // (hq // hkv)].T) / math.sqrt(d)
        probs.append(torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1))
    for top_p in (0.5, 0.8, 0.95):
        pats, reps = mtrain.select_blocks(
            q, k, method="precise", top_p=top_p, lse=lse, granularity=g, report=True
        )
        want, _ = select_ref(w, top_p=top_p)
        assert torch.equal(masks_of(pats[0]), want), top_p
        allowed = pats[0].mask()
        for h in range(hq):
            mass = float((probs[h] * allowed[h]).sum()) / n
            assert abs(float(reps[0].recall[h]) - mass) <= 1e-9, (top_p, h)
            assert mass >= top_p - 1e-9
    pats, reps = mtrain.select_blocks(
        q, k, method="precise", top_k=3, lse=lse, head_adaptive=True, granularity=g, report=True
    )
    budgets = adaptive_budgets(w, 3)
    assert reps[0].top_k.tolist() == budgets
    assert torch.equal(masks_of(pats[0]), select_ref(w, top_k=budgets)[0])


def test_packed_and_batched(gen: torch.Generator) -> None:
    """Two packed sequences (cu_seqlens) are selected each on its own; the
    batched [B, N, H, d] form gives the patterns of its sequences."""
    hq, hkv, d, g = 4, 2, 16, 16
    lens = [93, 160]
    q, k = inputs(gen, sum(lens), hq, hkv, d)
    cu = torch.tensor([0, lens[0], sum(lens)])
    pats = mtrain.select_blocks(q, k, top_p=0.7, cu_seqlens=cu, granularity=g)
    assert [p.seq_len for p in pats] == lens
    for s, (a, b) in enumerate(((0, lens[0]), (lens[0], sum(lens)))):
        want = select_ref(antidiag_scores(q[a:b], k[a:b], g, 8, 1 / math.sqrt(d)), top_p=0.7)[0]
        assert torch.equal(masks_of(pats[s]), want), s
    qb, kb = q[: 2 * 93].reshape(2, 93, hq, d), k[: 2 * 93].reshape(2, 93, hkv, d)
    batched = mtrain.select_blocks(qb, kb, method="meanpool", top_k=2, granularity=g)
    assert len(batched) == 2
    for s in range(2):
        one = mtrain.select_blocks(qb[s], kb[s], method="meanpool", top_k=2, granularity=g)[0]
        assert torch.equal(masks_of(batched[s]), masks_of(one))
    # lse [B, N, Hq] for batched inputs
    _, lse = mtrain.attention(qb, kb, kb, granularity=g, return_lse=True)
    assert lse.shape == (2, 93, hq)
    pats = mtrain.select_blocks(qb, kb, method="precise", top_p=0.9, lse=lse, granularity=g)
    for s in range(2):
        want = select_ref(precise_scores(qb[s], kb[s], lse[s], g, 1 / math.sqrt(d)), top_p=0.9)[0]
        assert torch.equal(masks_of(pats[s]), want), s


# ---------------------------------------------------------------------------
# the selected pattern through the attention (cpu backend, float32)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["antidiag", "meanpool"])
def test_selected_pattern_through_attention(gen: torch.Generator, method: str) -> None:
    """fp32 selection on the cpu backend, its patterns as pattern= for a packed
    batch of two sequences: the outputs and gradients equal float64 attention
    masked by the same patterns within SPEC.md section 7's bound."""
    hq, hkv, d, g = 4, 2, 64, 16
    lens = [150, 203]
    n = sum(lens)
    q, k = inputs(gen, n, hq, hkv, d, torch.float32)
    v, do = randn(gen, n, hkv, d), randn(gen, n, hq, d)
    cu = torch.tensor([0, lens[0], n])
    budget: dict[str, Any] = {"top_p": 0.6} if method == "antidiag" else {"top_k": 2}
    pats = mtrain.select_blocks(q, k, method=method, cu_seqlens=cu, granularity=g, **budget)
    density = sum(p.density() for p in pats) / 2
    assert density < 0.85, f"{method}: density {density:.3f}, not sparse"
    got = run_mtrain(q, k, v, do, pattern=pats, cu_seqlens=cu)
    mask = varlen_mask([p.mask() for p in pats])
    ref = reference(q, k, v, mask, do)
    assert_close_spec(got, ref)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def _expect(status: str, words: str, **kw: Any) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = randn(g, 64, 4, 16), randn(g, 64, 2, 16)
    args = {"granularity": 16, **kw}
    qq, kk = args.pop("q", q), args.pop("k", k)
    with pytest.raises(mtrain.MtrainError) as info:
        mtrain.select_blocks(qq, kk, **args)
    err = info.value
    assert err.status == status, f"{err.status}: {err.message}"
    for w in words.split("|"):
        assert w.lower() in err.message.lower(), f"{w!r} not in {err.message!r}"


def test_errors() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = randn(g, 64, 4, 16), randn(g, 64, 2, 16)
    lse = torch.zeros(64, 4)
    inv, bud = "MTRAIN_ERR_INVALID_ARGUMENT", "MTRAIN_ERR_INVALID_BUDGET"
    _expect(inv, "exactly one of top_k= |top_p=")
    _expect(inv, "exactly one of top_k= |top_p=", top_k=2, top_p=0.5)
    _expect(inv, "meanpool|top-k only", method="meanpool", top_p=0.9)
    _expect(inv, "precise|needs lse=", method="precise", top_p=0.9)
    _expect(inv, "lse= is read by method='precise' only", top_p=0.9, lse=lse)
    _expect(inv, "'foo'|precise, antidiag, meanpool", method="foo", top_k=1)
    _expect(inv, "must be", method=3, top_k=1)
    _expect(bud, "top_k -1", top_k=-1)
    _expect(inv, "top_k=2.5|int", top_k=2.5)
    _expect(bud, "top_p 1.5|(0, 1]", top_p=1.5)
    _expect(bud, "top_p 0", top_p=0.0)
    _expect(inv, "stride 5|granularity 16", top_k=1, stride=5)
    _expect(inv, "head_adaptive", method="meanpool", top_k=1, head_adaptive=True)
    _expect(inv, "head_adaptive", top_p=0.5, head_adaptive=True)
    _expect(inv, "sink_blocks -1", top_k=1, sink_blocks=-1)
    _expect("MTRAIN_ERR_SHAPE_MISMATCH", "lse has shape", method="precise", top_k=1, lse=lse[:8])
    _expect(
        "MTRAIN_ERR_UNSUPPORTED_DTYPE", "lse is torch.float16", method="precise", top_k=1,
        lse=lse.half(),
    )  # fmt: skip
    _expect("MTRAIN_ERR_HEAD_MISMATCH", "multiple", top_k=1, k=randn(g, 64, 3, 16))
    _expect("MTRAIN_ERR_SHAPE_MISMATCH", "tokens", top_k=1, k=k[:32])
    _expect(
        "MTRAIN_ERR_SHAPE_MISMATCH", "hold 80 tokens", top_k=1, cu_seqlens=torch.tensor([0, 80])
    )
    _expect("MTRAIN_ERR_UNSUPPORTED_DTYPE", "int32", top_k=1, q=q.int(), k=k.int())
    _expect("MTRAIN_ERR_SHAPE_MISMATCH", "dimensions", top_k=1, k=k[None])
    # the selection is detached: no gradient reaches q or k through it
    qq = q.clone().requires_grad_()
    mtrain.select_blocks(qq, k, top_k=1, granularity=16)
    assert qq.grad is None


def test_register_transformers_blocks_refusals() -> None:
    pytest.importorskip("transformers")
    reg = mtrain.register_transformers
    with pytest.raises(mtrain.MtrainError, match="precise"):
        reg("t-blocks", blocks={"method": "precise", "top_p": 0.9})
    with pytest.raises(mtrain.MtrainError, match="topp"):
        reg("t-blocks", blocks={"topp": 0.9})
    with pytest.raises(mtrain.MtrainError, match="exactly one of top_k"):
        reg("t-blocks", blocks={"method": "antidiag"})
    with pytest.raises(mtrain.MtrainError, match="one of budgets=, pattern= and blocks="):
        reg("t-blocks", budgets=mtrain.TopK(1, 1), blocks={"top_p": 0.9})
    assert reg("t-blocks", blocks={"method": "meanpool", "top_k": 2}) == "t-blocks"


# ---------------------------------------------------------------------------
# context parallel: 2 and 3 gloo processes, bitwise the single-process selection
# ---------------------------------------------------------------------------


@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)
@pytest.mark.parametrize("world", [2, 3])
def test_ring_selection_equals_single_process(world: int, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    import cp_worker

    print(f"seeds: batch 77; world {world}")
    mp.spawn(
        cp_worker.main,
        args=(world, str(tmp_path / "init"), str(tmp_path), ["blocks"]),
        nprocs=world,
        join=True,
    )
    ref = cp_worker.block_selections(None)
    for r in range(world):
        got = torch.load(tmp_path / f"blocks_{r}.pt", weights_only=False)
        assert "error" not in got, f"rank {r}:\n{got['error']}"
        for layout in cp_worker.BLOCK_LAYOUTS:
            for name, want in ref["selections"].items():
                have = got[layout]["selections"][name]
                what = f"rank {r}, {layout}, {name}"
                assert len(have["masks"]) == len(want["masks"]) == len(cp_worker.LENS), what
                for a, b in zip(have["masks"], want["masks"], strict=True):
                    assert torch.equal(a, b), f"{what}: the patterns differ"
                for key in ("recall", "top_k", "blocks"):
                    for a, b in zip(have[key], want[key], strict=True):
                        # bitwise, NaN (meanpool's recall) included
                        assert a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes()
            o, want_o = got[layout]["o"], ref["o"]
            e = (o - want_o).abs().max().item()
            assert e <= 1e-5 * want_o.abs().max().item(), f"rank {r} {layout}: o differs by {e}"
