#!/usr/bin/env python3
"""bench_cp_torch.py: context-parallel attention on W GPUs from PyTorch, four ways, timed alike.

    torchrun --nproc_per_node W tools/bench_cp_torch.py --json out.json        # GPUs, NCCL
    torchrun --nproc_per_node 2 tools/bench_cp_torch.py --device cpu --seq-lens 512 \\
        --heads 16 --kv-heads 2 --head-dim 64                                  # CPU, gloo

One sequence of N tokens (--seq-lens, default 131072,524288,1048576), Hq:Hkv = 16:2 heads (GQA),
head dim 128, bf16 (fp32 on the CPU), causal, scale 1/sqrt(d). Methods (--methods):

  mtrain-sparse  mtrain's Python API with group= (docs/PYTORCH.md "Context parallel"): the
                 striped layout (mtrain.dispatch); at every iteration the pattern is estimated
                 online on the group from the static budgets (--budgets, --layer; Qwen2.5-3B
                 layer 31) with mtrain.estimate_pattern, then mtrain.attention forward and
                 backward on that plan. The forward time includes the estimate (also given
                 alone).
  mtrain-dense   the same API with pattern=None (the dense causal pattern), zigzag layout.
  torch-cp       torch's own context parallel:
                 torch.distributed.tensor.experimental.context_parallel over a 1-d DeviceMesh,
                 F.scaled_dot_product_attention(is_causal=True) under
                 sdpa_kernel(--torch-cp-backend, flash by default) with torch's head-tail load
                 balancing; the K/V rotation is
                 --torch-cp-rotate (torch's default allgather). GQA: --torch-cp-gqa expand (k, v
                 repeated to Hq heads inside the step, as torchtitan's models do; default) or
                 native (enable_gqa=True). Which tokens a rank holds is taken from
                 context_parallel itself: a position buffer [1, N] is the one buffer it shards, and
                 q, k, v, dout are cut from the global tensors at those positions (so that the
                 global tensors are freed, not kept by the context). Checked first against
                 single-device SDPA at --check-n tokens (rows of this rank, rel. error <= 2e-2).
  ring-peer      the dense zigzag ring of tools/bench_ring_torch_peer.py (ring-flash-attention
                 style: the flash kernels per step, LSE merge in fp32, K/V and dK/dV moved with
                 batch_isend_irecv), imported from that file (its ring_forward / ring_backward,
                 kernels and inputs); on the CPU its plain-math attention.

Timing, the same for every method: per iteration, torch.cuda.synchronize and a barrier, then
CUDA events (perf_counter on the CPU) at the start, after the forward and after the backward of
that iteration, so that one forward+backward run gives both the forward and the forward+backward
time; --warmup runs, then --reps timed runs; for each run the slowest rank (all_reduce MAX), the
median over runs is reported. tokens/s = N / (forward+backward). Peak memory per rank:
torch.cuda.max_memory_allocated from after the inputs were made (local inputs included, global
ones freed) to the end of the method's runs (mtrain's buffers come from torch's allocator too); on
the CPU the process peak RSS (not per method).

Communication hidden: the C library reports, per attention call, the ring time (first to last
step, transfers included) and the steps' summed compute (mtrain_context_last_stats; device events
on the GPU). The Python package does not expose it; this script reads it through ctypes from the
context of the group, after one more untimed iteration, and prints ring / compute (max over ranks;
1.00 = transfers hidden). The torch methods have no per-step compute timing, and the same local
work without the ring is not available as a call: for them the column says n/a.

Every method runs in try/except on every rank; the ranks then agree on the outcome (a torch
collective), so an OOM, a missing API or an unsupported device is a row of the table with its
reason, not a crash. Writes one JSON (--json) and prints a markdown table on rank 0. Exit status:
0 when every method that was asked for ran or was skipped for a stated reason, 1 when one failed,
2 for bad arguments or environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NVLink SHARP (multicast) stays off on the lent GPU machines: set before torch/NCCL start.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import cp_launch  # tools/, beside this script
import torch
import torch.distributed as dist

PROG = "bench_cp_torch"
HERE = Path(__file__).resolve().parent
DEFAULT_BUDGETS = HERE.parent / "data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
METHODS = ("mtrain-sparse", "mtrain-dense", "torch-cp", "ring-peer")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NO_RING_STATS = (
    "n/a: no per-step compute timing in this method, and the same local work without the ring "
    "is not available as a call"
)


def die(msg: str, code: int = 2) -> None:
    """Prints an error (no traceback) and exits."""
    cp_launch.die(PROG, msg, code)


class Skip(Exception):  # noqa: N818 -- a method that does not apply, with the reason
    """The method does not run here (the reason is the message)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for the methods and the timing.",
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma list (all four)")
    p.add_argument("--seq-lens", default="131072,524288,1048576", help="tokens N, comma list")
    p.add_argument("--reps", type=int, default=3, help="timed runs, the median reported (3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs (1)")
    p.add_argument("--layer", type=int, default=31, help="budget file layer (31)")
    p.add_argument("--budgets", default=str(DEFAULT_BUDGETS), help="budget file (Qwen2.5-3B)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), help="bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--granularity", type=int, default=128, help="mtrain's block size (128)")
    p.add_argument("--torch-cp-backend", default="flash", choices=["flash", "efficient", "cudnn"])
    p.add_argument("--torch-cp-rotate", default="allgather", choices=["allgather", "alltoall"])
    p.add_argument("--torch-cp-gqa", default="expand", choices=["expand", "native"])
    p.add_argument("--peer-gqa", default="auto", choices=["auto", "native", "expand"])
    p.add_argument("--check-n", type=int, default=4096, help="torch-cp's check size (0: none)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--timeout-min", type=float, default=15.0, help="process group timeout")
    a = p.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        p.error(f"--methods: {bad or 'none'} not in {', '.join(METHODS)}")
    try:
        a.seq_lens = [int(x) for x in a.seq_lens.split(",") if x.strip()]
    except ValueError:
        p.error("--seq-lens takes integers")
    if not a.seq_lens or min(a.seq_lens) <= 0:
        p.error("--seq-lens must be positive")
    if a.reps < 1 or a.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    if a.heads <= 0 or a.kv_heads <= 0 or a.heads % a.kv_heads or a.head_dim <= 0:
        p.error("--heads must be a positive multiple of --kv-heads, --head-dim positive")
    return a


# ---- processes, clocks ---------------------------------------------------------------------------


@dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    group: Any


def setup(args: argparse.Namespace) -> Env:
    rank, world, device, group = cp_launch.init_group(PROG, args.device, args.timeout_min)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    return Env(rank, world, device, dtype, group)


class Clock:
    """CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1000.0
        return float(b - a)


Step = Callable[[Clock], dict[str, Any]]  # one iteration: marks "start", "fwd", "bwd" (+ "est")


def time_step(env: Env, clock: Clock, step: Step, args: argparse.Namespace) -> dict[str, Any]:
    """--warmup then --reps iterations; per run the slowest rank; medians."""
    keys = ("fwd", "fwdbwd", "est")
    runs: list[list[float]] = []
    for i in range(args.warmup + args.reps):
        clock.sync()
        dist.barrier(group=env.group)
        clock.sync()
        m = step(clock)
        clock.sync()
        t = [
            clock.seconds(m["start"], m["fwd"]),
            clock.seconds(m["start"], m["bwd"]),
            clock.seconds(m["start"], m["est"]) if "est" in m else math.nan,
        ]
        if i >= args.warmup:
            runs.append(t)
        elif env.rank == 0:
            print(
                f"{PROG}:   warm-up {i + 1}: fwd {t[0]:.4f} s, fwd+bwd {t[1]:.4f} s (rank 0)",
                file=sys.stderr,
                flush=True,
            )
    mine = torch.tensor(runs, dtype=torch.float64)
    slowest = collective_tensor(env, mine)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=env.group)
    slowest = slowest.cpu()
    out: dict[str, Any] = {}
    for j, key in enumerate(keys):
        col = slowest[:, j].tolist()
        if all(math.isnan(x) for x in col):
            continue
        out[f"{key}_s"] = statistics.median(col)
        out[f"{key}_runs"] = col
    out["bwd_s"] = out["fwdbwd_s"] - out["fwd_s"]
    return out


def collective_tensor(env: Env, t: torch.Tensor) -> torch.Tensor:
    """t on the device the group's backend moves (NCCL: the GPU)."""
    return t.to(env.device) if env.device.type == "cuda" else t.clone()


def gather_floats(env: Env, x: list[float]) -> list[list[float]]:
    t = collective_tensor(env, torch.tensor(x, dtype=torch.float64))
    parts = [torch.empty_like(t) for _ in range(env.world)]
    dist.all_gather(parts, t, group=env.group)
    return [p.cpu().tolist() for p in parts]


def randn(shape: tuple[int, ...], env: Env, gen: torch.Generator) -> torch.Tensor:
    """N(0, 1) in the run's dtype, drawn on the device (the same on every rank)."""
    return torch.randn(*shape, generator=gen, device=env.device, dtype=env.dtype)


def generator(env: Env, seed: int) -> torch.Generator:
    return torch.Generator(device=env.device).manual_seed(seed)


# ---- mtrain ------------------------------------------------------------------------------------


class CallStats(ctypes.Structure):
    """mtrain_call_stats_t (include/mtrain/mtrain.h)."""

    _fields_ = (
        ("seconds", ctypes.c_double),
        ("ring_seconds", ctypes.c_double),
        ("compute_seconds", ctypes.c_double),
        ("wait_seconds", ctypes.c_double),
        ("steps", ctypes.c_int32),
    )


def last_stats(ctx: Any) -> CallStats:
    """mtrain_context_last_stats of a context (not bound by the Python package)."""
    from mtrain import _lib

    fn = _lib.lib().dll.mtrain_context_last_stats
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(CallStats)]
    out = CallStats()
    _lib.check(fn(ctx.ptr, ctypes.byref(out)), "mtrain_context_last_stats")
    return out


def group_context(env: Env) -> Any:
    """The cached mtrain context of the group on this device (one: the sparse and the dense calls
    share it, the layout is not part of a context)."""
    from mtrain import _core

    found = [
        c
        for c in list(_core._contexts.values())
        if c.world == env.world and c.device.type == env.device.type
    ]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} mtrain contexts of world {env.world}: expected one")
    return found[0]


def bench_mtrain(env: Env, clock: Clock, args: argparse.Namespace, n: int, sparse: bool) -> dict:
    import mtrain

    layout = "striped" if sparse else "zigzag"
    gen = generator(env, args.seed * 1000 + 1)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    info = None
    local = []
    for h in (hq, hkv, hkv, hq):  # q, k, v, dout: the global tensor, this rank's slots, freed
        x = randn((n, h, d), env, gen)
        if info is None:
            t, _, info = mtrain.dispatch(x, env.group, layout=layout, granularity=args.granularity)
        else:
            t = mtrain.dispatch(x, info=info).local
        local.append(t.contiguous())
        del x
    assert info is not None
    ql, kl, vl, dol = local
    ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
    kw = info.attention_kwargs()
    reset_peak(env)
    # the C library's statistics of the last call, read after each forward and backward (the
    # ring's calls return after reading their device timers: no synchronisation is added)
    stats: list[list[float]] = []
    ctx: list[Any] = []

    def step(c: Clock) -> dict[str, Any]:
        m = {"start": c.mark()}
        pairs = math.nan
        parts = [math.nan] * 4
        if sparse:
            plan = mtrain.estimate_pattern(ql, kl, args.budgets, args.layer, **kw)
            m["est"] = c.mark()
            pairs = float(plan.computed_pairs)
            t = mtrain.last_estimate_times()  # the estimate's parts (the plan is the rest)
            parts = [t["stages"], t["reduce"], t["copies"], t["select"]]
            o = mtrain.attention(ql, kl, vl, pattern=plan)
        else:
            o = mtrain.attention(ql, kl, vl, **kw)
        m["fwd"] = c.mark()
        if not ctx:
            ctx.append(group_context(env))
        fs = last_stats(ctx[0])
        o.backward(dol)
        m["bwd"] = c.mark()
        bs = last_stats(ctx[0])
        stats.append([fs.ring_seconds, fs.compute_seconds, fs.wait_seconds, float(fs.steps),
                      bs.ring_seconds, bs.compute_seconds, bs.wait_seconds, float(bs.steps),
                      pairs, *parts])  # fmt: skip
        ql.grad = kl.grad = vl.grad = None
        return m  # the plan and the graph die here: the next iteration estimates and plans anew

    res = time_step(env, clock, step, args)
    res["peak_gib_per_rank"] = peak_per_rank(env)
    rows = gather_floats(env, stats[-1])  # the last timed iteration

    def ratio(r: list[float], i: int) -> float:
        return r[i] / r[i + 1] if r[i + 1] > 0 else math.nan

    keys = ("ring_s", "compute_s", "wait_s", "steps")
    res["ring_over_compute"] = {
        "fwd": max(ratio(r, 0) for r in rows),
        "bwd": max(ratio(r, 4) for r in rows),
        "per_rank": [
            {**{f"fwd_{k}": r[i] for i, k in enumerate(keys)},
             **{f"bwd_{k}": r[4 + i] for i, k in enumerate(keys)}}
            for r in rows
        ],
        "source": "mtrain_context_last_stats (C library) of the last timed iteration",
    }  # fmt: skip
    if sparse:
        total = sum(r[8] for r in rows)
        res["density"] = total / (hq * n * (n + 1) / 2)
        res["estimate"] = f"budgets {Path(args.budgets).name} layer {args.layer}, every iteration"
        names = ("stages", "reduce", "copies", "select")
        res["estimate_parts_s"] = {
            **{k: max(r[9 + i] for r in rows) for i, k in enumerate(names)},
            "per_rank": [{k: r[9 + i] for i, k in enumerate(names)} for r in rows],
            "source": "mtrain.last_estimate_times() of the last timed iteration; max over ranks "
            "(the estimate's wall time minus these parts is its plan, on the host)",
        }
    res["layout"] = layout
    return res


# ---- torch's context parallel ------------------------------------------------------------------


def torch_cp_api() -> tuple[Any, Any]:
    """(context_parallel, init_device_mesh), or Skip naming what is missing."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        raise Skip(
            f"torch {torch.__version__} has no torch.distributed.tensor.experimental."
            f"context_parallel / init_device_mesh ({e})"
        ) from e
    params = inspect.signature(context_parallel).parameters
    need = ("mesh", "buffers", "buffer_seq_dims", "no_restore_buffers")
    wrapper = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not wrapper and any(p not in params for p in need):  # some releases export a wrapper
        raise Skip(
            f"torch {torch.__version__}: context_parallel{inspect.signature(context_parallel)} "
            f"lacks one of {need} (written for torch 2.11's signature)"
        )
    return context_parallel, init_device_mesh


def sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]


_MESH: list[Any] = []  # one DeviceMesh over the world for every torch-cp run


@contextlib.contextmanager
def torch_cp_positions(env: Env, args: argparse.Namespace, n: int) -> Iterator[torch.Tensor]:
    """Inside torch's context_parallel for a sequence of n tokens: yields the global positions
    this rank holds (in its local order), as context_parallel sharded them."""
    context_parallel, init_device_mesh = torch_cp_api()
    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(args.torch_cp_rotate)
    except ImportError as e:
        if args.torch_cp_rotate != "allgather":
            raise Skip(f"torch {torch.__version__}: no set_rotate_method ({e})") from e
    if not _MESH:
        _MESH.append(init_device_mesh(env.device.type, (env.world,)))
    mesh = _MESH[0]
    pos = torch.arange(n, device=env.device, dtype=torch.int64).view(1, n)
    with context_parallel(mesh, buffers=[pos], buffer_seq_dims=[1], no_restore_buffers={pos}):
        yield pos.view(-1).clone()


def torch_cp_sdpa(
    args: argparse.Namespace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """F.scaled_dot_product_attention, causal, on [1, H, S, D] local shards (inside the context)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    g = q.shape[1] // k.shape[1]
    with sdpa_kernel([sdpa_backend(args.torch_cp_backend)]):
        if args.torch_cp_gqa == "native" or g == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal=True
        )


def torch_cp_inputs(
    env: Env, args: argparse.Namespace, n: int, pos: torch.Tensor, seed: int
) -> list[torch.Tensor]:
    """q, k, v, dout [1, H, S_local, D] at this rank's positions; the global tensors freed."""
    gen = generator(env, seed)
    out = []
    for h in (args.heads, args.kv_heads, args.kv_heads, args.heads):
        x = randn((1, h, n, args.head_dim), env, gen)
        out.append(x.index_select(2, pos).contiguous())
        del x
    return out


def torch_cp_check(env: Env, args: argparse.Namespace) -> dict[str, Any]:
    """torch-cp at --check-n tokens against SDPA on the whole sequence (every rank its rows)."""
    n = args.check_n
    with torch_cp_positions(env, args, n) as pos:
        q, k, v, do = torch_cp_inputs(env, args, n, pos, args.seed + 99)
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        o = torch_cp_sdpa(args, ql, kl, vl)
        o.backward(do)
        got = {"o": o.detach(), "dq": ql.grad}
    # the reference outside the context: the same global tensors, the usual SDPA
    gen = generator(env, args.seed + 99)
    full = [
        randn((1, h, n, args.head_dim), env, gen)
        for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)
    ]
    qf, kf, vf = (t.detach().requires_grad_() for t in full[:3])
    of = torch_cp_sdpa(args, qf, kf, vf)
    of.backward(full[3])
    assert qf.grad is not None
    ref = {"o": of.detach().index_select(2, pos), "dq": qf.grad.index_select(2, pos)}
    errs = {}
    for name in ("o", "dq"):
        g, r = got[name].double(), ref[name].double()
        errs[name] = float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
    worst = gather_floats(env, [errs["o"], errs["dq"]])
    e = {"o": max(w[0] for w in worst), "dq": max(w[1] for w in worst)}
    return {"n": n, "max_rel_err": e, "tol": 2e-2, "passed": all(x <= 2e-2 for x in e.values())}


def bench_torch_cp(env: Env, clock: Clock, args: argparse.Namespace, n: int) -> dict:
    torch_cp_api()
    res: dict[str, Any] = {}
    if args.check_n > 0:
        res["check"] = torch_cp_check(env, args)
        if not res["check"]["passed"]:
            raise RuntimeError(f"torch-cp check against SDPA failed: {res['check']}")
    with torch_cp_positions(env, args, n) as pos:
        balanced = bool(n % (2 * env.world) == 0)
        ql, kl, vl, dol = torch_cp_inputs(env, args, n, pos, args.seed * 1000 + 3)
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        reset_peak(env)

        def step(c: Clock) -> dict[str, Any]:
            m = {"start": c.mark()}
            o = torch_cp_sdpa(args, ql, kl, vl)
            m["fwd"] = c.mark()
            o.backward(dol)
            m["bwd"] = c.mark()
            ql.grad = kl.grad = vl.grad = None
            return m

        res.update(time_step(env, clock, step, args))
        res["peak_gib_per_rank"] = peak_per_rank(env)
    res["ring_over_compute"] = None
    res["comm_note"] = NO_RING_STATS
    res["torch_cp"] = {
        "backend": args.torch_cp_backend,
        "rotate": args.torch_cp_rotate,
        "gqa": args.torch_cp_gqa,
        "head_tail_load_balance": balanced,
    }
    return res


# ---- the ring peer -----------------------------------------------------------------------------


def bench_peer(env: Env, clock: Clock, args: argparse.Namespace, n: int) -> dict:
    sys.path.insert(0, str(HERE))
    import bench_ring_torch_peer as peer

    if env.world < 2:
        raise Skip("the peer's ring needs 2 or more ranks (it sends to itself otherwise)")
    if n % (2 * env.world):
        raise Skip(f"N = {n} is not a multiple of 2W = {2 * env.world} (the peer's zigzag chunks)")
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(d)
    if env.device.type == "cuda":
        attn = peer.FlashCuda(hq, hkv, d, scale)
        peer.probe_flash(attn, env.device, env.dtype)
    else:
        attn = peer.MathAttention(hq, hkv, d, scale)
    gqa = attn.probe_gqa(env.device, env.dtype, args.peer_gqa)
    ring = peer.Ring(env.rank, env.world)
    acc = torch.promote_types(env.dtype, torch.float32)
    q, kv, do = peer.local_inputs(
        env.rank, env.world, n, hq, hkv, d, env.dtype, env.device, args.seed + 7
    )
    reset_peak(env)

    def step(c: Clock) -> dict[str, Any]:
        m = {"start": c.mark()}
        out, lse, metas = peer.ring_forward(attn, ring, q, kv, acc)
        m["fwd"] = c.mark()
        peer.ring_backward(attn, ring, q, kv, out, lse, do, metas, acc)
        m["bwd"] = c.mark()
        return m

    res = time_step(env, clock, step, args)
    res["peak_gib_per_rank"] = peak_per_rank(env)
    res["ring_over_compute"] = None
    res["comm_note"] = NO_RING_STATS
    res["peer"] = {"attention": attn.name, "gqa": gqa, "layout": "zigzag"}
    return res


# ---- memory, the outcome of a method, the table ------------------------------------------------


def reset_peak(env: Env) -> None:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)


def peak_per_rank(env: Env) -> list[float]:
    if env.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(env.device) / 2**30
    else:  # the process's peak RSS (Linux: KiB), not per method
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return [r[0] for r in gather_floats(env, [mine])]


def cleanup(env: Env) -> None:
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.empty_cache()


def run_method(env: Env, clock: Clock, args: argparse.Namespace, method: str, n: int) -> dict:
    """One method at one length on every rank; the ranks agree on the outcome."""
    fns: dict[str, Callable[[], dict[str, Any]]] = {
        "mtrain-sparse": lambda: bench_mtrain(env, clock, args, n, sparse=True),
        "mtrain-dense": lambda: bench_mtrain(env, clock, args, n, sparse=False),
        "torch-cp": lambda: bench_torch_cp(env, clock, args, n),
        "ring-peer": lambda: bench_peer(env, clock, args, n),
    }
    res: dict[str, Any] = {"method": method, "seq_len": n}
    outcome = ("ok", "")
    trace = ""
    t0 = time.perf_counter()
    try:
        res.update(fns[method]())
    except Skip as e:
        outcome = ("skipped", str(e))
    except torch.OutOfMemoryError as e:
        outcome = ("failed", f"out of memory: {str(e).splitlines()[0]}")
    except (Exception, SystemExit) as e:  # SystemExit: the peer's die() on a kernel probe
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        outcome = ("failed", f"{type(e).__name__}: {first}"[:400])
        trace = traceback.format_exc()
    if method == "torch-cp" and env.device.type == "cpu" and outcome[0] == "failed":
        outcome = (
            "skipped",
            "torch's context_parallel runs the CUDA SDPA kernels only (flash, "
            "memory-efficient, cuDNN); on the CPU: " + outcome[1],
        )
    elif trace:
        print(
            f"{PROG}: [rank {env.rank}] {method} at N={n} failed:\n{trace}",
            file=sys.stderr,
            flush=True,
        )
    outcomes: list[Any] = [None] * env.world
    dist.all_gather_object(outcomes, outcome, group=env.group)
    bad = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
    if bad:
        r, (status, reason) = bad[0]
        res = {
            "method": method,
            "seq_len": n,
            "status": status,
            "reason": f"rank {r}: {reason}" if len(bad) < env.world else reason,
        }
        if method.startswith("mtrain") and status == "failed":
            import mtrain

            mtrain.reset()  # a failed collective leaves the communicator unusable
    else:
        res["status"] = "ok"
        if "fwdbwd_s" in res:
            res["tokens_per_s"] = n / res["fwdbwd_s"]
    res["wall_s"] = time.perf_counter() - t0
    cleanup(env)
    return res


def cell(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| N | method | status | fwd s | fwd+bwd s | tokens/s | peak GiB/rank (max) "
        "| ring/compute fwd, bwd | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        notes = []
        if r["status"] != "ok":
            notes.append(r.get("reason", ""))
        if "density" in r:
            notes.append(f"density {r['density']:.4f}, estimate {r.get('est_s', math.nan):.4f} s")
            ep = r.get("estimate_parts_s")
            if ep:
                notes.append(
                    f"(stages {ep['stages']:.4f}, reduce {ep['reduce']:.4f}, copies "
                    f"{ep['copies']:.4f}, select {ep['select']:.4f} s)"
                )
        if r.get("peer"):
            notes.append(f"{r['peer']['attention']}, gqa {r['peer']['gqa']}")
        if r.get("torch_cp"):
            t = r["torch_cp"]
            notes.append(
                f"{t['backend']}, {t['rotate']}, gqa {t['gqa']}"
                + ("" if t["head_tail_load_balance"] else ", NOT load-balanced")
            )
        if r.get("check"):
            e = r["check"]["max_rel_err"]
            notes.append(f"check N={r['check']['n']}: o {e['o']:.1e}, dq {e['dq']:.1e}")
        rc = r.get("ring_over_compute")
        ring = (
            f"{rc['fwd']:.3f}, {rc['bwd']:.3f}" if rc else ("n/a" if r["status"] == "ok" else "-")
        )
        peak = max(r["peak_gib_per_rank"]) if r.get("peak_gib_per_rank") else None
        lines.append(
            f"| {r['seq_len']} | {r['method']} | {r['status']} | {cell(r.get('fwd_s'), '.4f')} "
            f"| {cell(r.get('fwdbwd_s'), '.4f')} | {cell(r.get('tokens_per_s'), ',.0f')} "
            f"| {cell(peak, '.2f')} | {ring} | {'; '.join(n for n in notes if n)} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    env = setup(args)
    clock = Clock(env.device)
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    try:
        import mtrain

        lib = mtrain.library_path()
    except Exception as e:  # the mtrain methods will report it
        lib = f"unavailable ({type(e).__name__}: {e})"
    if env.rank == 0:
        print(
            f"{PROG}: W={env.world} {env.device.type} ({name}), torch {torch.__version__}, "
            f"{str(env.dtype).replace('torch.', '')}, {args.heads}:{args.kv_heads} heads, d "
            f"{args.head_dim}, causal; N {args.seq_lens}; methods {args.methods}; warm-up "
            f"{args.warmup}, reps {args.reps}; seed {args.seed}; libmtrain {lib}; NCCL_NVLS_ENABLE="
            f"{os.environ.get('NCCL_NVLS_ENABLE')}",
            flush=True,
        )
    results = []
    for n in args.seq_lens:
        for method in args.methods:
            if env.rank == 0:
                print(f"{PROG}: {method} at N={n} ...", flush=True)
            r = run_method(env, clock, args, method, n)
            results.append(r)
            if env.rank == 0:
                extra = r.get("reason", "")
                print(
                    f"{PROG}: {method} at N={n}: {r['status']} {extra} "
                    f"fwd {cell(r.get('fwd_s'), '.4f')} s, fwd+bwd "
                    f"{cell(r.get('fwdbwd_s'), '.4f')} s ({r['wall_s']:.1f} s)",
                    flush=True,
                )
    failed = [r for r in results if r["status"] == "failed"]
    if env.rank == 0:
        print()
        print(table(results))
        print()
        print(
            "ring/compute: the C library's ring time over the steps' summed compute "
            "(mtrain_context_last_stats, max over ranks; 1.00 = transfers hidden). "
            f"torch-cp, ring-peer: {NO_RING_STATS}.",
            flush=True,
        )
        if args.json:
            doc = {
                "tool": PROG,
                "world": env.world,
                "device": env.device.type,
                "device_name": name,
                "torch": torch.__version__,
                "libmtrain": lib,
                "dtype": str(env.dtype)[6:],
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "causal": True,
                "granularity": args.granularity,
                "budgets": args.budgets,
                "layer": args.layer,
                "reps": args.reps,
                "warmup": args.warmup,
                "seq_lens": args.seq_lens,
                "methods": args.methods,
                "seed": args.seed,
                "timing": "CUDA events (perf_counter on the CPU); per run the slowest rank; "
                "median of runs; fwd and fwd+bwd from the same runs",
                "env": {
                    k: os.environ.get(k)
                    for k in (
                        "NCCL_NVLS_ENABLE",
                        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                        "NVSHMEM_DISABLE_NVLS",
                        "MTRAIN_COMM_TIMEOUT",
                        "MTRAIN_NUM_THREADS",
                    )
                },
                "results": results,
                "failed": len(failed),
            }
            Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    status = 1 if failed else 0
    try:
        dist.barrier(group=env.group)
        with contextlib.suppress(Exception):
            import mtrain

            mtrain.reset()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    main()
