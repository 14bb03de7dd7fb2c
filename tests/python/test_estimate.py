"""mtrain.estimate_pattern against an independent brute-force reading of
docs/SPEC.md section 2 in float64 (top-k with per-head budgets, sinks and
window; top-p, without and with the sinks and the window forced:
top_p_forced), on the cpu-ref backend (float64 inputs), and the online
estimate of one step feeding its forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

import mtrain
from conftest import randn


def brute_force(
    q: torch.Tensor,
    k: torch.Tensor,
    budget: mtrain.TopK | mtrain.TopP,
    h: int,
    g: int,
    last_q: int,
    num_sinks: int,
    window: int,
    top_p_forced: bool = False,
) -> tuple[list[int], list[int]]:
    """(block diagonals, verticals) of head h, straight from SPEC.md section 2
    (top_p_forced: top-p keeps the sinks and the window first, whatever their
    mass, then adds by mass)."""
    n, hq, d = q.shape
    kv = h // (hq // k.shape[1])
    lq = min(last_q, n)
    rows = torch.arange(n - lq, n)
    a = (q[rows, h].double() @ k[:, kv].double().T) / math.sqrt(d)  # [L, N]
    causal = torch.arange(n)[None, :] <= rows[:, None]
    if isinstance(budget, mtrain.TopP):
        m = a.masked_fill(~causal, float("-inf")).max(dim=1, keepdim=True).values
        e = torch.exp(a - m).masked_fill(~causal, 0.0)
        a = e / e.sum(dim=1, keepdim=True) / lq
    a = a.masked_fill(~causal, 0.0)
    vscore = a.sum(dim=0)
    sscore = torch.zeros(n, dtype=torch.float64)
    for r in range(lq):
        i = n - lq + r
        for t in range(i + 1):
            sscore[t] += a[r, i - t]
    vcand = list(range((n - 1) // g * g))
    scand = list(range(n))

    def rank(cands: list[int], score: torch.Tensor, forced: int) -> list[int]:
        # forced candidates first, as if scored +infinity: tied, the lower index first
        return sorted(cands, key=lambda j: (0, 0.0, j) if j < forced else (1, -score[j].item(), j))

    if isinstance(budget, mtrain.TopK):
        verts = rank(vcand, vscore, num_sinks)[: budget.v_size]
        slashes = rank(scand, sscore, window)[: budget.s_size]
    else:

        def keep(
            order: list[int], score: torch.Tensor, p: float, cap: int, forced: int
        ) -> list[int]:
            out, total = [], 0.0
            for j in order:
                if len(out) >= cap or (j >= forced and total + score[j].item() >= p):
                    break
                total += score[j].item()
                out.append(j)
            return out

        fv, fs = (num_sinks, window) if top_p_forced else (0, 0)
        verts = keep(rank(vcand, vscore, fv), vscore, budget.p_v, budget.cap_v, fv)
        slashes = keep(rank(scand, sscore, fs), sscore, budget.p_s, budget.cap_s, fs)
    nb = -(-n // g)
    diags = {0}
    for t in slashes:
        diags.add(t // g)
        if t % g:
            diags.add(t // g + 1)
    return sorted(x for x in diags if x < nb), sorted(verts)


def test_top_k_per_head_budgets(gen: torch.Generator) -> None:
    n, hq, hkv, d, g = 301, 4, 2, 16, 16
    q, k = randn(gen, n, hq, d, dtype=torch.float64), randn(gen, n, hkv, d, dtype=torch.float64)
    budgets = [mtrain.TopK(5, 20), mtrain.TopK(0, 3), mtrain.TopK(40, 60), mtrain.TopK(1000, 1000)]
    opts = {"last_q": 24, "num_sinks": 3, "window": 7}
    plan = mtrain.estimate_pattern(q, k, budgets, granularity=g, **opts)
    assert plan._plan().ctx.backend == "cpu-ref"
    pattern = plan.patterns[0]
    for h in range(hq):
        assert pattern.head(h) == brute_force(q, k, budgets[h], h, g, **opts), f"head {h}"


def test_top_p(gen: torch.Generator) -> None:
    n, hq, hkv, d, g = 200, 2, 1, 16, 16
    q, k = randn(gen, n, hq, d, dtype=torch.float64), randn(gen, n, hkv, d, dtype=torch.float64)
    q[:, :, 0] += 3.0  # a few keys stand out
    k[::37, :, 0] += 4.0
    budgets = [mtrain.TopP(0.6, 0.5, 50, 7), mtrain.TopP(0.9, 0.95)]
    opts = {"last_q": 16, "num_sinks": 30, "window": 100}
    pattern = mtrain.estimate_pattern(q, k, budgets, granularity=g, **opts).patterns[0]
    for h in range(hq):
        got = pattern.head(h)
        assert got == brute_force(q, k, budgets[h], h, g, **opts), f"head {h}"
        assert 0 < len(got[1]) < n  # top-p kept some verticals, not all


def _last_queries_skip_sinks(
    gen: torch.Generator, n: int, hq: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (float64) whose last queries give the first keys and the nearest ones almost no
    mass, as measured on a trained model (docs/TRAINING.md): top-p alone drops the sinks."""
    q, k = randn(gen, n, hq, d, dtype=torch.float64), randn(gen, n, hkv, d, dtype=torch.float64)
    q[:, :, 0] = 3.0
    k[:, :, 0] = 0.0
    k[:40, :, 0] = -4.0  # the sinks: far below every other key for the last queries
    k[n - 40 :, :, 0] = -4.0  # and the local window
    k[60::50, :, 0] = 3.0  # a few keys the last queries do want
    return q, k


@pytest.mark.parametrize("hq, hkv, n, g", [(2, 1, 200, 16), (4, 2, 333, 32)])
def test_top_p_forced(gen: torch.Generator, hq: int, hkv: int, n: int, g: int) -> None:
    """top_p_forced=True: top-p heads keep keys 0 .. num_sinks - 1 and the block diagonals
    of token diagonals 0 .. window - 1, then add by mass (the brute force of the rule);
    without it the same inputs lose the sinks. GQA, N not a multiple of G."""
    q, k = _last_queries_skip_sinks(gen, n, hq, hkv, 16)
    budgets = [mtrain.TopP(0.6, 0.5, 50, 300), mtrain.TopK(4, 10)] * (hq // 2)
    opts = {"last_q": 16, "num_sinks": 30, "window": 100}
    forced = mtrain.estimate_pattern(q, k, budgets, granularity=g, top_p_forced=True, **opts)
    plain = mtrain.estimate_pattern(q, k, budgets, granularity=g, **opts)
    window_blocks = set(range(-(-100 // g) + 1))  # token diagonals 0..99 touch these
    for h in range(hq):
        got = forced.patterns[0].head(h)
        assert got == brute_force(q, k, budgets[h], h, g, **opts, top_p_forced=True), f"head {h}"
        assert plain.patterns[0].head(h) == brute_force(q, k, budgets[h], h, g, **opts), h
        if isinstance(budgets[h], mtrain.TopP):
            diags, verts = got
            assert verts[:30] == list(range(30)), f"head {h}: the sinks are not all kept"
            assert window_blocks <= set(diags), f"head {h}: the window is not covered"
            assert not set(range(30)) <= set(plain.patterns[0].head(h)[1]), h  # lost unforced


def test_top_p_forced_mass_and_caps(gen: torch.Generator) -> None:
    """The forced mass alone reaches p: only the forced candidates; caps below the forced
    prefixes: the lowest forced indices; sinks beyond the candidates, a window beyond N."""
    n, hq, hkv, d, g = 150, 2, 1, 16, 16
    q, k = randn(gen, n, hq, d, dtype=torch.float64), randn(gen, n, hkv, d, dtype=torch.float64)
    cases = [
        ({"num_sinks": 100, "window": 120}, mtrain.TopP(0.1, 0.1), list(range(100)), 120),
        ({"num_sinks": 30, "window": 100}, mtrain.TopP(0.9, 0.9, 7, 20), list(range(7)), 20),
        ({"num_sinks": 500, "window": 500}, mtrain.TopP(0.5, 0.5, 1000, 1000), list(range(144)), n),
    ]
    for opts, budget, want_verts, tokens in cases:
        plan = mtrain.estimate_pattern(
            q, k, budget, granularity=g, last_q=32, top_p_forced=True, **opts
        )
        for h in range(hq):
            diags, verts = plan.patterns[0].head(h)
            want = brute_force(q, k, budget, h, g, 32, top_p_forced=True, **opts)
            assert (diags, verts) == want, (opts, h)
            assert verts == want_verts, (opts, h)  # only the forced ones
            blocks = {t // g for t in range(tokens)} | {t // g + 1 for t in range(tokens) if t % g}
            assert diags == sorted(b for b in blocks if b < -(-n // g)), (opts, h)


@pytest.mark.parametrize("bad", [2, -1, "yes", None, 0.5])
def test_top_p_forced_refused(gen: torch.Generator, bad: object) -> None:
    q, k = randn(gen, 64, 2, 16), randn(gen, 64, 1, 16)
    with pytest.raises(mtrain.MtrainError, match="top_p_forced") as e:
        mtrain.estimate_pattern(q, k, mtrain.TopP(0.9, 0.9), granularity=16, top_p_forced=bad)
    assert e.value.status == "MTRAIN_ERR_INVALID_ARGUMENT"
    with pytest.raises(mtrain.MtrainError, match="top_p_forced"):
        mtrain.attention(q, k, k, budgets=mtrain.TopP(0.9, 0.9), top_p_forced=bad)


def test_top_p_forced_forward_and_backward(gen: torch.Generator) -> None:
    """attention(budgets=TopP, top_p_forced=True): the pattern it estimates (the sinks and
    the window in) feeds its forward and backward, equal to the fp64 masked reference."""
    from conftest import reference, run_mtrain

    n, hq, hkv, d, g = 256, 4, 2, 32, 32
    q64, k64 = _last_queries_skip_sinks(gen, n, hq, hkv, d)
    q, k = q64.float(), k64.float()
    v, do = randn(gen, n, hkv, d), randn(gen, n, hq, d)
    budget = mtrain.TopP(0.5, 0.5, 64, 64)
    kw = {"granularity": g, "last_q": 32, "top_p_forced": True}
    plan = mtrain.estimate_pattern(q, k, budget, **kw)
    mask = plan.patterns[0].mask()
    for h in range(hq):
        assert plan.patterns[0].head(h)[1][:30] == list(range(30))
    assert mask.sum() < hq * n * (n + 1) // 2
    got = run_mtrain(q, k, v, do, budgets=budget, **kw)
    ref = reference(q, k, v, mask, do)
    for name in ("o", "lse", "dq", "dk", "dv"):
        e = (got[name].double() - ref[name]).abs().max().item()
        assert e <= 1e-4 * ref[name].abs().max().item(), name


def test_packed_sequences(gen: torch.Generator) -> None:
    """cu_seqlens: every packed sequence's pattern (estimated in one call for the
    batch) is the brute force's of that sequence alone, and the pattern the
    sequence gets when estimated by itself; lengths below and between blocks."""
    hq, hkv, d, g, last_q = 4, 2, 16, 32, 24
    lens = [5, 70, 32, 129, 1]
    n = sum(lens)
    q, k = randn(gen, n, hq, d), randn(gen, n, hkv, d)
    budgets = [mtrain.TopK(6, 20), mtrain.TopP(0.6, 0.9, 40, 300)] * 2
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"granularity": g, "last_q": last_q, "num_sinks": 3, "window": 5, "backend": "cpu-ref"}
    plan = mtrain.estimate_pattern(q, k, budgets, cu_seqlens=cu, **kw)
    assert len(plan.patterns) == len(lens)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        got = plan.patterns[s]
        assert got.seq_len == b - a
        alone = mtrain.estimate_pattern(q[a:b], k[a:b], budgets, **kw).patterns[0]
        for h in range(hq):
            assert got.head(h) == alone.head(h), (s, h)
            want = brute_force(q[a:b], k[a:b], budgets[h], h, g, last_q, 3, 5)
            assert (list(got.head(h)[0]), list(got.head(h)[1])) == want, (s, h)


def test_live_plan_found_by_content(gen: torch.Generator) -> None:
    """The same estimated patterns (a packed batch, estimated again from copies
    of its inputs) find the live plan through their content digest; a batch
    whose patterns differ in one sequence, or holds them in another order,
    gets a plan of its own."""
    hq, hkv, d, g = 2, 1, 16, 16
    lens = [40, 64, 23]
    n = sum(lens)
    q, k = randn(gen, n, hq, d), randn(gen, n, hkv, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"granularity": g, "last_q": 8, "num_sinks": 0, "window": 0, "backend": "cpu-ref"}
    budget = mtrain.TopK(5, 1)
    first = mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, **kw)
    again = mtrain.estimate_pattern(q.clone(), k.clone(), budget, cu_seqlens=cu, **kw)
    assert again._plan() is first._plan()
    # the last sequence's keys change: its pattern differs, the plan too
    k2 = k.clone()
    k2[lens[0] + lens[1] :] = randn(gen, lens[2], hkv, d)
    other = mtrain.estimate_pattern(q, k2, budget, cu_seqlens=cu, **kw)
    assert [p.head(h) for p in other.patterns for h in range(hq)] != [
        p.head(h) for p in first.patterns for h in range(hq)
    ]
    assert other._plan() is not first._plan()
    # two sequences of one length swapped: same lengths, patterns in another order
    a, b = randn(gen, 32, hq, d), randn(gen, 32, hq, d)
    ka, kb = randn(gen, 32, hkv, d), randn(gen, 32, hkv, d)
    cu2 = torch.tensor([0, 32, 64], dtype=torch.int32)
    ab = mtrain.estimate_pattern(
        torch.cat([a, b]), torch.cat([ka, kb]), budget, cu_seqlens=cu2, **kw
    )
    ba = mtrain.estimate_pattern(
        torch.cat([b, a]), torch.cat([kb, ka]), budget, cu_seqlens=cu2, **kw
    )
    assert [p.head(0) for p in ab.patterns] != [p.head(0) for p in ba.patterns]
    assert ba._plan() is not ab._plan()


def test_estimate_feeds_forward_and_backward(gen: torch.Generator) -> None:
    """One step: the estimate's plan serves the forward and the backward; the
    gradients are those of the estimated pattern's masked attention."""
    from conftest import reference, run_mtrain

    n, hq, hkv, d, g = 256, 4, 2, 64, 32
    q, k, v, do = (randn(gen, n, h, d) for h in (hq, hkv, hkv, hq))
    plan = mtrain.estimate_pattern(q, k, mtrain.TopK(16, 64), granularity=g, last_q=32)
    mask = plan.patterns[0].mask()
    assert mask.sum() < hq * n * (n + 1) // 2
    got = run_mtrain(q, k, v, do, pattern=plan)
    ref = reference(q, k, v, mask, do)
    for name in ("o", "dq", "dk", "dv"):
        e = (got[name].double() - ref[name]).abs().max().item()
        assert e <= 1e-4 * ref[name].abs().max().item(), name


def test_last_estimate_times(gen: torch.Generator) -> None:
    """mtrain.last_estimate_times: zero on a thread that has not estimated, then the parts of
    this thread's last estimate (the host path on the CPU: no device selection)."""
    import threading

    fresh: list[dict[str, float]] = []
    worker = threading.Thread(target=lambda: fresh.append(mtrain.last_estimate_times()))
    worker.start()
    worker.join()
    assert fresh == [dict.fromkeys(("scores", "select", "stages", "copies", "reduce"), 0.0)]
    n, hq, hkv, d = 2048, 4, 2, 32
    q, k = randn(gen, n, hq, d, dtype=torch.float32), randn(gen, n, hkv, d, dtype=torch.float32)
    mtrain.estimate_pattern(q, k, [mtrain.TopP(0.9, 0.9)] * hq, granularity=64, last_q=64)
    t = mtrain.last_estimate_times()
    assert t["scores"] > 0 and t["select"] > 0 and t["stages"] > 0
    # the parts of the scores add up to them (one rank: the reduction is a no-op)
    assert t["stages"] + t["copies"] + t["reduce"] == pytest.approx(t["scores"], rel=1e-9, abs=1e-9)
