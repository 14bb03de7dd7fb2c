#!/usr/bin/env python3
"""cp_check.py: mtrain's context parallel from PyTorch (``group=``, docs/PYTORCH.md) on W ranks
against the same computation on one device.

    torchrun --nproc_per_node W tools/cp_check.py                 # GPUs: NCCL, cuda:LOCAL_RANK
    torchrun --nproc_per_node 2 tools/cp_check.py --device cpu    # CPU: gloo, small sizes

One packed batch of sequences of uneven lengths (not multiples of W or of the granularity; GPU
default 7001, 5003, 2950 tokens; CPU 301, 187, 122), GQA (16 query and 2 kv heads), for every
dtype (GPU bf16 and fp16, CPU fp32), head dim (128 and 64), pattern source and layout (striped,
zigzag, balanced, contiguous):

  CP (every rank): mtrain.dispatch of q, k, v, dout -> the pattern (estimated on the group, or
      given) -> mtrain.attention forward -> backward -> mtrain.undispatch of o, lse, dq, dk, dv;
  one device (rank 0, no group, the same inputs and seeds): the same calls on the whole batch.

Pattern sources: ``topk`` (the online estimate with mtrain.TopK(--topk)), ``budgets`` (the online
estimate with the static budgets of --budgets at --layer; needs as many query heads as the file's
layer has: 16 for Qwen2.5-3B), ``dense`` (pattern=None), ``blockmask`` (a user-given block mask
per sequence and head, random with --block-density, passed as mtrain.block_mask_pattern objects).

Rank 0 checks (docs/SPEC.md section 7):
  - the estimated patterns of the group equal the single-device ones bitwise (every sequence,
    head, diagonal and vertical);
  - "Distributed runs": o, lse, dq, dk, dv of the group within tol * max|single-device| of the
    single-device ones: tol 1e-5 in fp32, 2^-7 in bf16; fp16 is not in that rule and gets 2^-9
    (4 unit roundoffs, the bound of SPEC.md's tool checks for fp16);
  - against an fp64 reference of the same pattern (--ref64): ``mtrain`` is mtrain's own oracle
    (cpu-ref: float64 CPU tensors through mtrain.attention), ``torch`` is masked attention in
    float64 written here (per head, on the device; shares no code with mtrain); ``auto`` takes
    mtrain up to 4096 tokens, else torch. The bound is SPEC.md's: e <= 1e-4 * M in fp32, and in
    bf16 / fp16 e <= max(2 * e_naive, 1e-4 * M), e_naive the error of the same masked attention
    computed naively in that dtype (every intermediate rounded to it).
  - error paths (--error-checks, W >= 2): ranks asking for different layouts (equal slot
    counts), different granularities, and different batches must fail on every rank with a clear
    MtrainError (MTRAIN_ERR_INVALID_CONFIG, _INVALID_CONFIG, _SHAPE_MISMATCH).

Prints the seeds, one table row per case (max|err| / max|ref| per output against the single
device, the worst fp64 error over its bound, pass/fail), the error checks, and a summary; --json
writes everything. Exit status: 0 when every case and check passed, 1 when one failed, 2 for bad
arguments or environment. --perturb-rank R (for tests of this checker) adds 0.5 to rank R's local
q after dispatch, so that the check must fail.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cp_launch  # tools/, beside this script
import torch
import torch.distributed as dist

PROG = "cp_check"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGETS = ROOT / "data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
LAYOUTS = ("striped", "zigzag", "balanced", "contiguous")
SOURCES = ("topk", "budgets", "dense", "blockmask")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUTPUTS = ("o", "lse", "dq", "dk", "dv")
# docs/SPEC.md section 7, "Distributed runs": the group against one device; fp16 is not there:
# 4 unit roundoffs (2^-9), the bound SPEC.md's tool checks use for fp16
DIST_TOL = {"fp32": 1e-5, "bf16": 2.0**-7, "fp16": 2.0**-9}
REF64_AUTO_TOKENS = 4096


def die(msg: str, code: int = 2) -> None:
    """Prints an error (no traceback) and exits."""
    cp_launch.die(PROG, msg, code)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for what is compared and the bounds.",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seq-lens", help="sequence lengths (GPU 7001,5003,2950; CPU 301,187,122)")
    p.add_argument("--granularity", type=int, help="block size G (GPU 128, CPU 32)")
    p.add_argument("--heads", type=int, default=16, help="query heads (16)")
    p.add_argument("--kv-heads", type=int, default=2, help="kv heads (2)")
    p.add_argument("--head-dims", default="128,64", help="head dims (128,64)")
    p.add_argument("--dtypes", help="fp32, bf16, fp16 (GPU bf16,fp16; CPU fp32)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts (all four)")
    p.add_argument("--sources", default=",".join(SOURCES), help="pattern sources (all four)")
    p.add_argument("--topk", help="V,S of mtrain.TopK for the topk source (GPU 1024,128; CPU 8,48)")
    p.add_argument("--last-q", type=int, default=64, help="estimate: voting queries (64)")
    p.add_argument("--budgets", default=str(DEFAULT_BUDGETS), help="budget file (Qwen2.5-3B)")
    p.add_argument("--layer", type=int, default=31, help="budget file layer (31)")
    p.add_argument("--block-density", type=float, default=0.3, help="blockmask source (0.3)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ref64", default="auto", choices=["auto", "mtrain", "torch", "off"])
    p.add_argument("--error-checks", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--perturb-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results (rank 0)")
    p.add_argument("--timeout-min", type=float, default=30.0, help="process group timeout")
    a = p.parse_args(argv)
    if a.heads <= 0 or a.kv_heads <= 0 or a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} must be a positive multiple of --kv-heads {a.kv_heads}")
    for name, vals, allowed in (
        ("--layouts", words(a.layouts), LAYOUTS),
        ("--sources", words(a.sources), SOURCES),
    ):
        bad = [x for x in vals if x not in allowed]
        if bad or not vals:
            p.error(f"{name}: {bad or 'none given'} not in {', '.join(allowed)}")
    if a.dtypes is not None:
        bad = [x for x in words(a.dtypes) if x not in DTYPES]
        if bad:
            p.error(f"--dtypes: {bad} not in {', '.join(DTYPES)}")
    return a


# ---- the process group -------------------------------------------------------------------------


@dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    group: Any


def setup(args: argparse.Namespace) -> Env:
    """init_process_group: NCCL with one GPU per rank (cuda:LOCAL_RANK), or gloo on the CPU."""
    rank, world, device, group = cp_launch.init_group(PROG, args.device, args.timeout_min)
    return Env(rank, world, device, group)


def log(env: Env, msg: str) -> None:
    if env.rank == 0:
        print(msg, flush=True)


# ---- inputs and pattern sources ----------------------------------------------------------------


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    cu: torch.Tensor  # CPU int64 offsets
    lens: list[int]
    seed: int


def make_batch(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Batch:
    """N(0, 1) drawn in fp32 on the CPU from `seed` (the same on every rank), rounded to dtype."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)

    def r(h: int) -> torch.Tensor:
        return torch.randn(n, h, d, generator=g).to(dtype).to(device)

    q, k, v, do = r(hq), r(hkv), r(hkv), r(hq)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return Batch(q, k, v, do, cu, lens, seed)


@dataclass
class Source:
    """A pattern source: how the pattern of a case is obtained."""

    name: str
    budgets: Any = None  # estimate: mtrain.TopK or a budget file path
    layer: int | None = None
    patterns: list[Any] = field(default_factory=list)  # blockmask: one mtrain.Pattern per sequence
    masks: list[torch.Tensor] = field(default_factory=list)  # blockmask: bool [Hq, nb, nb]


def block_masks(lens: list[int], hq: int, g: int, density: float, seed: int) -> list[torch.Tensor]:
    """Random causal block masks, one [Hq, nb, nb] per sequence (the diagonal on)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        nb = -(-n // g)
        m = torch.rand(hq, nb, nb, generator=gen) < density
        m = m.tril() | torch.eye(nb, dtype=torch.bool)
        out.append(m)
    return out


def heads_of(patterns: list[Any]) -> list[list[tuple[list[int], list[int]]]]:
    """(diagonals, verticals) of every head of every sequence's pattern."""
    return [[p.head(h) for h in range(p.num_heads)] for p in patterns]


# ---- one run: the group or one device ----------------------------------------------------------


@dataclass
class Result:
    out: dict[str, torch.Tensor]
    patterns: list[list[tuple[list[int], list[int]]]] | None
    pattern_objs: list[Any] | None = None  # estimated patterns (single device), for references


def run_group(
    env: Env, b: Batch, src: Source, layout: str, g: int, args: argparse.Namespace
) -> Result:
    import mtrain

    ql, _, info = mtrain.dispatch(b.q, env.group, layout=layout, cu_seqlens=b.cu, granularity=g)
    kl, vl, dol = (mtrain.dispatch(t, info=info).local for t in (b.k, b.v, b.do))
    if env.rank == args.perturb_rank:  # test-only: this rank's real slots of q are shifted
        real = (info.rows >= 0).to(ql.device)
        ql = ql.clone()
        ql[real] += 0.5
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
    kw = info.attention_kwargs()
    pats = None
    if src.budgets is not None:
        plan = mtrain.estimate_pattern(ql, kl, src.budgets, src.layer, last_q=args.last_q, **kw)
        pats = heads_of(plan.patterns)
        o, lse = mtrain.attention(ql, kl, vl, pattern=plan, return_lse=True)
    elif src.patterns:
        o, lse = mtrain.attention(ql, kl, vl, pattern=src.patterns, return_lse=True, **kw)
    else:
        o, lse = mtrain.attention(ql, kl, vl, return_lse=True, **kw)
    o.backward(dol)
    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    local = {"o": o.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    out = {name: mtrain.undispatch(t, info) for name, t in local.items()}
    return Result(out, pats)


def run_single(b: Batch, src: Source, g: int, args: argparse.Namespace) -> Result:
    import mtrain

    q, k, v = (t.detach().clone().requires_grad_() for t in (b.q, b.k, b.v))
    pats = objs = None
    if src.budgets is not None:
        plan = mtrain.estimate_pattern(
            q, k, src.budgets, src.layer, cu_seqlens=b.cu, granularity=g, last_q=args.last_q
        )
        objs = plan.patterns
        pats = heads_of(objs)
        o, lse = mtrain.attention(q, k, v, pattern=plan, return_lse=True)
    elif src.patterns:
        o, lse = mtrain.attention(q, k, v, pattern=src.patterns, cu_seqlens=b.cu, return_lse=True)
    else:
        o, lse = mtrain.attention(q, k, v, cu_seqlens=b.cu, granularity=g, return_lse=True)
    o.backward(b.do)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    out = {"o": o.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return Result(out, pats, objs)


# ---- references --------------------------------------------------------------------------------


def allowed(
    n: int, g: int, device: torch.device, head: tuple[list[int], list[int]] | torch.Tensor | None
) -> torch.Tensor:
    """docs/SPEC.md section 1's allowed(h, i, j) of one head as a bool [n, n]: None is dense
    causal, (diagonals, verticals) a vertical-slash head, a bool [nb, nb] a block-mask head."""
    i = torch.arange(n, device=device)
    causal = i[:, None] >= i[None, :]
    if head is None:
        return causal
    nb = -(-n // g)
    qb = i // g
    bi = torch.arange(nb, device=device)
    diff = bi[:, None] - bi[None, :]
    if isinstance(head, torch.Tensor):
        blk = head.to(device) | torch.eye(nb, dtype=torch.bool, device=device)
        return blk[qb[:, None], qb[None, :]] & causal
    diagonals, verticals = head
    on = torch.zeros(nb, dtype=torch.bool, device=device)
    on[0] = True
    if diagonals:
        on[torch.tensor(diagonals, dtype=torch.long, device=device)] = True
    blk = on[diff.clamp(min=0)] & (diff >= 0)
    a = blk[qb[:, None], qb[None, :]]
    if verticals:
        vert = torch.zeros(n, dtype=torch.bool, device=device)
        vert[torch.tensor(verticals, dtype=torch.long, device=device)] = True
        a = a | (vert[None, :] & (qb[None, :] < qb[:, None]))
    return a & causal


def head_spec(
    src: Source, single: Result, s: int, h: int
) -> tuple[list[int], list[int]] | torch.Tensor | None:
    if src.budgets is not None:
        assert single.patterns is not None
        return single.patterns[s][h]
    if src.masks:
        return src.masks[s][h]
    return None


def masked_reference(
    b: Batch, src: Source, single: Result, g: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """o, lse, dq, dk, dv of masked attention (the pattern of the single-device run) computed in
    `dtype` head by head with autograd: float64 is the reference, bf16/fp16 the naive computation
    of SPEC.md section 7 (every intermediate in that dtype; a kv head's gradient sums its query
    heads' contributions in fp32)."""
    hq, d = int(b.q.shape[1]), int(b.q.shape[2])
    hkv = int(b.k.shape[1])
    grp = hq // hkv
    scale = 1.0 / math.sqrt(d)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    n_all = int(b.q.shape[0])
    out = {
        "o": torch.empty(n_all, hq, d, dtype=dtype, device=device),
        "lse": torch.empty(n_all, hq, dtype=dtype, device=device),
        "dq": torch.empty(n_all, hq, d, dtype=dtype, device=device),
        "dk": torch.zeros(n_all, hkv, d, dtype=acc, device=device),
        "dv": torch.zeros(n_all, hkv, d, dtype=acc, device=device),
    }
    for s, n in enumerate(b.lens):
        a0 = int(b.cu[s])
        rows = slice(a0, a0 + n)
        for h in range(hq):
            mask = allowed(n, g, device, head_spec(src, single, s, h))
            q = b.q[rows, h].to(device, dtype).detach().requires_grad_()
            k = b.k[rows, h // grp].to(device, dtype).detach().requires_grad_()
            v = b.v[rows, h // grp].to(device, dtype).detach().requires_grad_()
            sc = (q @ k.transpose(0, 1)) * scale
            sc = sc.masked_fill(~mask, float("-inf"))
            lse = torch.logsumexp(sc, dim=-1)
            o = torch.softmax(sc, dim=-1) @ v
            o.backward(b.do[rows, h].to(device, dtype))
            assert q.grad is not None and k.grad is not None and v.grad is not None
            out["o"][rows, h] = o.detach()
            out["lse"][rows, h] = lse.detach()
            out["dq"][rows, h] = q.grad
            out["dk"][rows, h // grp] += k.grad.to(acc)
            out["dv"][rows, h // grp] += v.grad.to(acc)
            del sc, o, lse, mask
    out["dk"] = out["dk"].to(dtype)
    out["dv"] = out["dv"].to(dtype)
    return out


def mtrain_reference(b: Batch, src: Source, single: Result, g: int) -> dict[str, torch.Tensor]:
    """mtrain's fp64 oracle (cpu-ref: float64 CPU tensors) on the single-device pattern."""
    import mtrain

    q, k, v = (t.detach().to("cpu", torch.float64).requires_grad_() for t in (b.q, b.k, b.v))
    if src.budgets is not None:
        assert single.pattern_objs is not None
        o, lse = mtrain.attention(
            q, k, v, pattern=list(single.pattern_objs), cu_seqlens=b.cu, return_lse=True
        )
    elif src.patterns:
        o, lse = mtrain.attention(q, k, v, pattern=src.patterns, cu_seqlens=b.cu, return_lse=True)
    else:
        o, lse = mtrain.attention(q, k, v, cu_seqlens=b.cu, granularity=g, return_lse=True)
    o.backward(b.do.to("cpu", torch.float64))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"o": o.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def max_err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref|, max |ref|); inf when got has a non-finite value."""
    ref = ref.to(got.device)
    if not bool(torch.isfinite(got).all()):
        return math.inf, float(ref.double().abs().max())
    return float((got.double() - ref.double()).abs().max()), float(ref.double().abs().max())


# ---- the cases ---------------------------------------------------------------------------------


@dataclass
class Refs:
    single: Result
    ref64: dict[str, torch.Tensor] | None
    naive: dict[str, torch.Tensor] | None
    ref64_kind: str
    seconds: float
    density: float  # allowed pairs over causal pairs, over heads and sequences


def density(b: Batch, src: Source, single: Result, hq: int) -> float:
    """The pattern's allowed pairs over the causal pairs of the batch."""
    pats = single.pattern_objs if src.budgets is not None else src.patterns
    if not pats:
        return 1.0
    pairs = sum(p.count_pairs(h) for p in pats for h in range(p.num_heads))
    return pairs / sum(hq * n * (n + 1) // 2 for n in b.lens)


def make_refs(
    b: Batch, src: Source, g: int, dtype_name: str, device: torch.device, args: argparse.Namespace
) -> Refs:
    t0 = time.perf_counter()
    single = run_single(b, src, g, args)
    kind = args.ref64
    if kind == "auto":
        kind = "mtrain" if sum(b.lens) <= REF64_AUTO_TOKENS else "torch"
    ref64 = naive = None
    if kind == "mtrain":
        ref64 = mtrain_reference(b, src, single, g)
    elif kind == "torch":
        ref64 = masked_reference(b, src, single, g, torch.float64, device)
    if kind != "off" and dtype_name != "fp32":
        naive = masked_reference(b, src, single, g, DTYPES[dtype_name], device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dens = density(b, src, single, int(b.q.shape[1]))
    return Refs(single, ref64, naive, kind, time.perf_counter() - t0, dens)


def compare(got: Result, refs: Refs, src: Source, dtype_name: str) -> dict[str, Any]:
    """The case's verdict: patterns, the group against one device, against fp64."""
    row: dict[str, Any] = {}
    ok = True
    if src.budgets is not None:
        equal = got.patterns == refs.single.patterns
        row["patterns_equal"] = equal
        ok &= equal
    tol = DIST_TOL[dtype_name]
    row["dist_tol"] = tol
    row["vs_single"] = {}
    for name in OUTPUTS:
        e, m = max_err(got.out[name], refs.single.out[name])
        passed = e <= tol * m
        row["vs_single"][name] = {
            "err": e,
            "max_ref": m,
            "rel": e / m if m > 0 else e,
            "passed": passed,
        }
        ok &= passed
    if refs.ref64 is not None:
        row["vs_fp64"] = {}
        for name in OUTPUTS:
            e, m = max_err(got.out[name], refs.ref64[name])
            bound = 1e-4 * m
            e_naive = None
            if refs.naive is not None:
                e_naive, _ = max_err(refs.naive[name], refs.ref64[name])
                bound = max(bound, 2 * e_naive)
            passed = e <= bound
            row["vs_fp64"][name] = {
                "err": e,
                "max_ref": m,
                "e_naive": e_naive,
                "bound": bound,
                "passed": passed,
            }
            ok &= passed
    row["passed"] = bool(ok)
    return row


def fmt_row(row: dict[str, Any]) -> str:
    case = f"{row['layout']:<10} {row['source']:<9} d{row['head_dim']:<3} {row['dtype']:<4}"
    if "error" in row:
        return f"| {case} | {'ERROR: ' + row['error'].splitlines()[-1][:90]} | FAIL |"
    pat = {True: "equal", False: "DIFFER"}.get(row.get("patterns_equal"), "-")  # type: ignore[arg-type]
    vs = " | ".join(f"{row['vs_single'][n]['rel']:.2e}" for n in OUTPUTS)
    fp64 = "-"
    if "vs_fp64" in row:
        worst = max(
            (x["err"] / x["bound"] if x["bound"] > 0 else (0.0 if x["err"] == 0 else math.inf))
            for x in row["vs_fp64"].values()
        )
        fp64 = f"{worst:.2f}"
    return f"| {case} | {pat:<6} | {vs} | {fp64:>5} | {'pass' if row['passed'] else 'FAIL'} |"


def gather_errors(env: Env, err: str | None) -> list[str | None]:
    """Every rank's error of the case (a torch collective, not mtrain's)."""
    out: list[str | None] = [None] * env.world
    dist.all_gather_object(out, err, group=env.group)
    return out


def run_cases(env: Env, args: argparse.Namespace, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import mtrain

    rows: list[dict[str, Any]] = []
    lens, g, hq, hkv = cfg["seq_lens"], cfg["granularity"], args.heads, args.kv_heads
    budget_heads = None
    for di, dtype_name in enumerate(cfg["dtypes"]):
        for d in cfg["head_dims"]:
            seed = args.seed * 1000003 + d * 101 + di
            b = make_batch(lens, hq, hkv, d, DTYPES[dtype_name], env.device, seed)
            log(env, f"{PROG}: batch seed {seed} (dtype {dtype_name}, head dim {d})")
            for sname in cfg["sources"]:
                src = Source(sname)
                if sname == "topk":
                    src.budgets, src.layer = mtrain.TopK(*cfg["topk"]), None
                elif sname == "budgets":
                    if budget_heads is None:
                        budget_heads = budget_file_heads(args.budgets, args.layer)
                    if budget_heads != hq:
                        log(
                            env,
                            f"{PROG}: source budgets skipped: layer {args.layer} of "
                            f"{args.budgets} has {budget_heads} query heads, --heads is {hq}",
                        )
                        continue
                    src.budgets, src.layer = args.budgets, args.layer
                elif sname == "blockmask":
                    mseed = seed + 17
                    log(env, f"{PROG}: block masks seed {mseed} (density {args.block_density})")
                    src.masks = block_masks(lens, hq, g, args.block_density, mseed)
                    src.patterns = [
                        mtrain.block_mask_pattern(m, n, g)
                        for m, n in zip(src.masks, lens, strict=True)
                    ]
                refs = None
                err = None
                if env.rank == 0:
                    try:
                        refs = make_refs(b, src, g, dtype_name, env.device, args)
                        log(
                            env,
                            f"{PROG}: references of {sname} d{d} {dtype_name}: one device "
                            f"+ fp64 ({refs.ref64_kind}) in {refs.seconds:.1f} s; pattern density "
                            f"{refs.density:.4f}",
                        )
                    except Exception:
                        err = traceback.format_exc()
                errs = gather_errors(env, err)  # also the barrier while rank 0 computes
                for layout in cfg["layouts"]:
                    row: dict[str, Any] = {
                        "layout": layout,
                        "source": sname,
                        "head_dim": d,
                        "dtype": dtype_name,
                        "seed": seed,
                    }
                    if errs[0] is not None:
                        row["error"] = f"rank 0, the single-device reference:\n{errs[0]}"
                        row["passed"] = False
                        rows.append(row)
                        if env.rank == 0:
                            print(fmt_row(row), flush=True)
                        continue
                    got = None
                    err = None
                    try:
                        got = run_group(env, b, src, layout, g, args)
                    except Exception:
                        err = traceback.format_exc()
                    case_errs = gather_errors(env, err)
                    if any(e is not None for e in case_errs):
                        r, e = next((r, e) for r, e in enumerate(case_errs) if e is not None)
                        row["error"] = f"rank {r}:\n{e}"
                        row["passed"] = False
                        if env.rank == 0:
                            print(
                                f"{PROG}: case {layout} {sname} d{d} {dtype_name} failed on "
                                f"rank {r}:\n{e}",
                                file=sys.stderr,
                                flush=True,
                            )
                        mtrain.reset()  # a failed collective leaves the communicator unusable
                    elif env.rank == 0:
                        assert got is not None and refs is not None
                        row.update(compare(got, refs, src, dtype_name))
                        row["density"] = refs.density
                    rows.append(row)
                    if env.rank == 0:
                        print(fmt_row(row), flush=True)
                    del got
                del refs, src
            del b
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def budget_file_heads(path: str, layer: int) -> int:
    with open(path) as f:
        data = json.load(f)
    if not 0 <= layer < len(data):
        die(f"--layer {layer}: {path} has layers 0..{len(data) - 1}")
    return len(data[layer])


# ---- error paths -------------------------------------------------------------------------------


def error_checks(env: Env, cfg: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Ranks that ask for different things must all fail with a clear error."""
    import mtrain

    g, w = cfg["granularity"], env.world
    dtype = DTYPES[cfg["dtypes"][0]]
    d = cfg["head_dims"][-1]
    gen = torch.Generator().manual_seed(args.seed + 5)

    def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randn(n, args.heads, d, generator=gen).to(dtype).to(env.device)
        k = torch.randn(n, args.kv_heads, d, generator=gen).to(dtype).to(env.device)
        return q, k

    def attend(q: torch.Tensor, k: torch.Tensor, **dispatch_kw: Any) -> str:
        ql, _, info = mtrain.dispatch(q, env.group, **dispatch_kw)
        kl = mtrain.dispatch(k, info=info).local
        try:
            mtrain.attention(ql, kl, kl, **info.attention_kwargs())
        except mtrain.MtrainError as e:
            return f"{e.status}: {e.message}"
        return "no error"

    checks = []
    # 1. layouts: 4W blocks minus a few tokens, so striped and zigzag give equal slot counts
    n = 4 * w * g - 3
    q, k = qkv(n)
    lay = "striped" if env.rank == 0 else "zigzag"
    checks.append(
        (
            "layouts differ (rank 0 striped, the others zigzag; equal slot counts)",
            "MTRAIN_ERR_INVALID_CONFIG",
            "layout",
            lambda: attend(q, k, layout=lay, granularity=g),
        )
    )
    # 2. granularities
    gr = g if env.rank == 0 else 2 * g
    checks.append(
        (
            "granularities differ (rank 0 G, the others 2G)",
            "MTRAIN_ERR_INVALID_CONFIG",
            "granularity",
            lambda: attend(q, k, layout="striped", granularity=gr),
        )
    )
    # 3. batches: the same tokens, cut into two sequences at different places
    cut = g + 5 if env.rank == 0 else 2 * g + 5
    cu = torch.tensor([0, cut, n])
    checks.append(
        (
            "batches differ (cu_seqlens [0, G+5, n] on rank 0, [0, 2G+5, n] on the others)",
            "MTRAIN_ERR_SHAPE_MISMATCH",
            "",
            lambda: attend(q, k, layout="striped", granularity=g, cu_seqlens=cu),
        )
    )
    out = []
    for what, status, word, fn in checks:
        try:
            got = fn()
        except Exception as e:  # anything but an MtrainError is a failure of the check
            got = f"{type(e).__name__}: {e}"
        allr: list[str | None] = [None] * w
        dist.all_gather_object(allr, got, group=env.group)
        ok = all(
            x is not None and x.startswith(status + ":") and word in x.split(":", 1)[1]
            for x in allr
        )
        out.append({"check": what, "expected": status, "got": allr, "passed": ok})
        log(env, f"{PROG}: error check: {what}: {'pass' if ok else 'FAIL'}; rank 0 got {allr[0]!r}")
        if not ok:
            log(env, f"{PROG}:   every rank: {allr}")
        mtrain.reset()
        dist.barrier(group=env.group)
    return out


# ---- main --------------------------------------------------------------------------------------


def config(args: argparse.Namespace, env: Env) -> dict[str, Any]:
    gpu = env.device.type == "cuda"
    cfg: dict[str, Any] = {
        "seq_lens": ints(args.seq_lens)
        if args.seq_lens
        else ([7001, 5003, 2950] if gpu else [301, 187, 122]),
        "granularity": args.granularity or (128 if gpu else 32),
        "head_dims": ints(args.head_dims),
        "dtypes": words(args.dtypes) if args.dtypes else (["bf16", "fp16"] if gpu else ["fp32"]),
        "layouts": words(args.layouts),
        "sources": words(args.sources),
        "topk": ints(args.topk) if args.topk else ([1024, 128] if gpu else [8, 48]),
    }
    if len(cfg["topk"]) != 2:
        die("--topk takes V,S")
    if any(n <= 0 for n in cfg["seq_lens"]) or cfg["granularity"] <= 0:
        die("sequence lengths and the granularity must be positive")
    if not gpu and any(x != "fp32" for x in cfg["dtypes"]):
        log(env, f"{PROG}: note: {cfg['dtypes']} on the CPU: the cpu backend computes them too")
    return cfg


def main() -> None:
    args = parse_args()
    env = setup(args)
    import mtrain

    cfg = config(args, env)
    n = sum(cfg["seq_lens"])
    log(
        env,
        f"{PROG}: W={env.world} device={env.device.type} "
        f"({torch.cuda.get_device_name(env.device) if env.device.type == 'cuda' else 'cpu'}) "
        f"backend={dist.get_backend()} torch={torch.__version__} "
        f"libmtrain={mtrain.library_path()}",
    )
    log(
        env,
        f"{PROG}: batch {cfg['seq_lens']} ({n} tokens; W*G = {env.world * cfg['granularity']}), "
        f"heads {args.heads}:{args.kv_heads}, head dims {cfg['head_dims']}, dtypes "
        f"{cfg['dtypes']}, G {cfg['granularity']}, layouts {cfg['layouts']}, sources "
        f"{cfg['sources']} (topk {cfg['topk']}, budgets layer {args.layer}, block density "
        f"{args.block_density}); seed {args.seed}; fp64 reference {args.ref64}",
    )
    if args.perturb_rank >= 0:
        log(
            env,
            f"{PROG}: TEST MODE: rank {args.perturb_rank}'s local q is perturbed (+0.5): "
            "every case must fail",
        )
    tols = ", ".join(f"{k} {v:.3g}" for k, v in DIST_TOL.items())
    log(
        env,
        f"{PROG}: columns o..dv: max|group - one device| / max|one device| (bound: {tols}); "
        "fp64: the worst max|group - fp64| / bound over the five (pass <= 1)",
    )
    log(env, "| case | patterns | o | lse | dq | dk | dv | fp64 | result |")
    log(env, "|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    rows = run_cases(env, args, cfg)
    checks = error_checks(env, cfg, args) if args.error_checks and env.world > 1 else []
    status = 0
    if env.rank == 0:
        failed = [r for r in rows if not r.get("passed")]
        cfailed = [c for c in checks if not c["passed"]]
        print(
            f"{PROG}: {len(rows)} cases, {len(failed)} failed; {len(checks)} error checks, "
            f"{len(cfailed)} failed; {time.perf_counter() - t0:.1f} s: "
            f"{'PASS' if not failed and not cfailed and rows else 'FAIL'}",
            flush=True,
        )
        status = 0 if rows and not failed and not cfailed else 1
        if args.json:
            doc = {
                "world": env.world,
                "device": str(env.device),
                "torch": torch.__version__,
                "seed": args.seed,
                "config": cfg,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "ref64": args.ref64,
                "perturb_rank": args.perturb_rank,
                "cases": rows,
                "error_checks": checks,
                "passed": status == 0,
            }
            Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    st = torch.tensor([status], device=env.device if env.device.type == "cuda" else "cpu")
    dist.broadcast(st, 0, group=env.group)
    # the orderly teardown, then an exit that skips the interpreter's own (docs/PYTORCH.md)
    try:
        dist.barrier(group=env.group)
        mtrain.reset()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(st.item()))


if __name__ == "__main__":
    main()
