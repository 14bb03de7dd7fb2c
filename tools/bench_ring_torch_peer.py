#!/usr/bin/env python3
"""bench_ring_torch_peer.py: a dense causal ring attention in torch, the peer of mtrain's GPU ring.

One process per GPU (NCCL), launched with

    torchrun --nproc_per_node 2 tools/bench_ring_torch_peer.py --seq-len 131072

One sequence of N tokens, Hq = 16 query heads, Hkv = 2 kv heads (GQA), head_dim 128, bf16,
causal, softmax scale 1/sqrt(d); the same shape as mtrain-run's dense ring benchmark
(docs/PERFORMANCE.md, "The ring on two GPUs").

Layout: zigzag. The sequence is cut into 2W chunks of N/(2W) tokens; rank r holds chunks r and
2W-1-r, in that order (q, k, v, dout, and its slices of o, dq, dk, dv). Tensors are kept as
[B, S, H, D] (B = 1) and passed to the attention kernels as [B, H, S, D] views, so that a half of
the local rows is a contiguous block.

Forward (W steps): at step s rank r holds the K/V block of rank src = (r - s) mod W. While it
computes that step it sends the block on to rank r+1 and receives the next one from rank r-1
(one torch.distributed.batch_isend_irecv of an isend and an irecv, waited before the next step).
Which pairs take part (the zigzag rule):
  - s = 0 (src = r): all local q against all local k/v, causal (the two chunks are in order);
  - src < r: all local q against the first half of the block (chunk src), no mask;
  - src > r: the second half of local q (chunk 2W-1-r) against the whole block, no mask.
Every step computes 2c^2 pairs per head (c = N/(2W)) except the diagonal one, so the ranks are
balanced. Each step runs torch.ops.aten._scaled_dot_product_flash_attention (FlashAttention-2,
output and log-sum-exp) and the partial outputs are merged in fp32 with their LSEs:
lse = logaddexp(lse, lse_i), o = exp(lse_old - lse) o + exp(lse_i - lse) o_i, i.e. o = sum_i
exp(lse_i - lse) o_i.

Backward: Q, O, dO and the final LSE stay on their rank; dQ accumulates locally in fp32. The K/V
blocks travel the same ring as in the forward, and with each block an fp32 dK/dV accumulator:
at step s a rank computes its contribution for the block it holds
(torch.ops.aten._scaled_dot_product_flash_attention_backward with the final O and LSE, the same
zigzag rule), adds it to the accumulator received from rank r-1 (the sum of the ranks before it)
and sends the sum on to rank r+1; after W steps the accumulator of each block arrives at its
owner. Transfers are posted before the compute they overlap and waited after it.

GQA (--gqa auto): on a small probe the flash op is run with K/V of Hkv heads (FlashAttention-2
takes Hq % Hkv == 0 natively, like SDPA's enable_gqa) and with K/V repeated to Hq heads
(repeat_interleave, inside the step only), both compared with an fp32 plain-math reference; the
Hkv-head call is used unless the op refuses it or it is less accurate (more than twice the
repeated call's error on any of o, lse, dq, dk, dv). With repeated K/V the dK/dV of a head group
are summed in fp32. The mode is in the JSON ("gqa"); --gqa native or expand forces one.

Memory: per rank the local q, dout, o (N/W tokens), two K/V blocks in flight, an fp32 output and
dQ accumulator and two fp32 dK/dV accumulators, plus the flash kernels' own workspace; no N x N
tensor (at N = 1M on 2 GPUs a few tens of GiB per GPU; the JSON has each rank's peak).

--check (default on for N <= 8192): the ring's o, lse, dq, dk, dv are gathered to rank 0 and
compared with a single-GPU reference (SDPA causal on the whole sequence in fp32, autograd
backward); prints max|ring - ref| / max|ref| per tensor and exits 3 if any is above --tol (2e-2).

Timing: CUDA events around each call, torch.cuda.synchronize and dist.barrier before each timed
region, --warmup runs (2) then --reps runs (5) of the forward and of forward+backward. For each
run the slowest rank's time is taken (all_reduce MAX), and the median over runs is reported.
Prints one line of JSON on stdout (rank 0): seq_len, world, fwd_seconds, fwdbwd_seconds,
tokens_per_second (N / fwdbwd_seconds), effective TFLOP/s (forward 4*d*pairs, pairs =
Hq*N*(N+1)/2, forward+backward 3.5 times that; the whole job's and per GPU) and each rank's own
medians and peak memory. Diagnostics go to stderr.

--cpu-check (no GPU needed): the same ring code on CPU over gloo with --cpu-world processes
(spawned by the script, or under torchrun --nproc_per_node W), with a plain-math attention that
returns (out, lse) and its analytic backward (--cpu-attn math), or torch's CPU flash kernels
(--cpu-attn flash-cpu), in place of the CUDA flash ops; checked against a CPU autograd reference.
It validates the zigzag rule, the LSE merge and the dK/dV ring; fp64 (--cpu-dtype float64)
makes the check tight.

Exit status: 0 ok, 2 bad environment or arguments (message, no traceback), 3 check failed,
4 out of memory.
"""
import os

# NVLink SHARP (multicast) stays off on the lent GPU machines: set before torch/NCCL start.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

PROG = "bench_ring_torch_peer"


def die(msg, code=2):
    rank = os.environ.get("RANK")
    where = f"[rank {rank}] " if rank is not None else ""
    print(f"{PROG}: {where}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover
    die(f"torch is not importable ({e}); this peer needs torch (2.11 with CUDA on the GPU machine)")


def log(msg, rank=0, all_ranks=False):
    if all_ranks or rank == 0:
        print(f"{PROG}: [rank {rank}] {msg}" if all_ranks else f"{PROG}: {msg}",
              file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring for the algorithm.")
    p.add_argument("--seq-len", type=int, default=131072, help="tokens N (default 131072)")
    p.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=2, help="kv heads (default 2)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="GPU dtype (bf16)")
    p.add_argument("--reps", type=int, default=5, help="timed runs, median reported (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up runs (default 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="check against a single-device reference (default: on for N <= 8192)")
    p.add_argument("--check-only", action="store_true", help="only the check, no timing")
    p.add_argument("--tol", type=float, default=2e-2,
                   help="max |ring - ref| / max |ref| allowed by the check (default 2e-2)")
    p.add_argument("--gqa", default="auto", choices=["auto", "native", "expand"],
                   help="GQA in the flash op: probe (auto), Hkv heads as is, or repeat k/v")
    p.add_argument("--json", help="also write the JSON line to this file (rank 0)")
    p.add_argument("--cpu-check", action="store_true",
                   help="run the ring on CPU (gloo) with a CPU attention and check it")
    p.add_argument("--cpu-world", type=int, default=2,
                   help="--cpu-check: processes to spawn when not under torchrun (default 2)")
    p.add_argument("--cpu-attn", default="math", choices=["math", "flash-cpu"],
                   help="--cpu-check: plain math attention or torch's CPU flash kernels")
    p.add_argument("--cpu-dtype", default="float32", choices=["float64", "float32", "bfloat16"],
                   help="--cpu-check: storage dtype (default float32)")
    a = p.parse_args(argv)
    if a.seq_len <= 0 or a.heads <= 0 or a.kv_heads <= 0 or a.head_dim <= 0:
        p.error("sizes must be positive")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    if a.reps < 1 or a.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    if a.check is None:
        a.check = a.seq_len <= 8192 or a.cpu_check
    return a


# ---- attention kernels: fwd(q, k, v, causal) -> (out, lse, meta); bwd(...) -> (dq, dk, dv) ----
# q, k, v, out, dout are [B, H, S, D] (views of [B, S, H, D] storage); k and v have Hkv heads;
# lse is [B, Hq, S]; dk, dv come back with Hkv heads.

class Attention:
    name = "?"

    def __init__(self, hq, hkv, d, scale):
        self.hq, self.hkv, self.g, self.d, self.scale = hq, hkv, hq // hkv, d, scale
        self.native_gqa = False

    def expand(self, x):
        return x if self.native_gqa or self.g == 1 else x.repeat_interleave(self.g, dim=1)

    def reduce(self, dx):
        """dK or dV of the (possibly expanded) call back to Hkv heads."""
        if dx.shape[1] == self.hkv:
            return dx
        return dx.unflatten(1, (self.hkv, self.g)).sum(2, dtype=torch.promote_types(
            dx.dtype, torch.float32))

    def probe_gqa(self, device, dtype, mode):
        """Decide whether the kernel gets K/V with Hkv heads (native GQA) or repeated to Hq.

        On a small causal problem both ways are compared with an fp32 plain-math reference
        (out, lse, dq, dk, dv; error = max|x - ref| / max|ref|). auto takes native when the
        kernel accepts it and no tensor is more than twice as far from the reference as with
        repeated K/V (a kernel that sums a group's dK/dV in 16 bits, head after head, loses
        that; a wrong head mapping is off by O(1)); native takes it unless the op refuses or
        is off by more than 5e-2 (1e-4 in fp32)."""
        if self.g == 1 or mode == "expand":
            self.native_gqa = False
            return "expand" if self.g > 1 else "none"
        B, S, D = 1, 192, self.d
        gen = torch.Generator(device=device)
        gen.manual_seed(12345)
        mk = lambda h: torch.randn(B, S, h, D, generator=gen, device=device,  # noqa: E731
                                   dtype=torch.float32).to(dtype).transpose(1, 2)
        q, k, v, do = mk(self.hq), mk(self.hkv), mk(self.hkv), mk(self.hq)
        math_ref = MathAttention(self.hq, self.hkv, self.d, self.scale)
        up = [x.float() for x in (q, k, v, do)]
        o_r, l_r, _ = math_ref.fwd(up[0], up[1], up[2], True)
        ref = (o_r, l_r) + tuple(math_ref.bwd(up[3], up[0], up[1], up[2], o_r, l_r, True, None))

        def errors(native):
            self.native_gqa = native
            o, lse, meta = self.fwd(q, k, v, True)
            got = (o, lse) + tuple(self.bwd(do, q, k, v, o, lse, True, meta))
            errs = []
            for a, b in zip(got, ref):
                if tuple(a.shape) != tuple(b.shape):
                    return None
                b = b.float()
                errs.append(((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30))
                            .item())
            return errs

        e_exp = errors(False)
        try:
            e_nat = errors(True)
        except Exception as e:  # the kernel refuses Hkv != Hq
            self.native_gqa = False
            if mode == "native":
                die(f"--gqa native: the {self.name} op refused Hq={self.hq}, Hkv={self.hkv}: "
                    f"{str(e).splitlines()[0]}")
            return "expand"
        names = ("o", "lse", "dq", "dk", "dv")
        if mode == "native":
            limit = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
            if e_nat is None or max(e_nat) > limit:
                die(f"--gqa native: the {self.name} op with Hkv heads is off the reference: "
                    + (", ".join(f"{n} {x:.3g}" for n, x in zip(names, e_nat)) if e_nat
                       else "wrong shapes"))
            self.native_gqa = True
            return "native"
        if e_nat is not None and all(x <= 2 * y + 1e-6 for x, y in zip(e_nat, e_exp)):
            self.native_gqa = True
            return "native"
        self.native_gqa = False
        if e_nat is not None and os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: note: GQA with Hkv heads in the {self.name} op is less accurate "
                  "than with repeated k/v (" + ", ".join(
                      f"{n} {x:.2g} vs {y:.2g}" for n, x, y in zip(names, e_nat, e_exp))
                  + "): repeating k/v", file=sys.stderr, flush=True)
        return "expand"


class FlashCuda(Attention):
    """torch.ops.aten._scaled_dot_product_flash_attention{,_backward} (FlashAttention-2)."""
    name = "flash"

    FWD_ARGS = ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"]
    FWD_RETS = ["output", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k"]
    BWD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"]

    def __init__(self, hq, hkv, d, scale):
        super().__init__(hq, hkv, d, scale)
        for op in ("_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_backward"):
            if not hasattr(torch.ops.aten, op):
                die(f"this torch ({torch.__version__}) has no torch.ops.aten.{op}: the flash "
                    "op is unavailable")
        self.fwd_op = torch.ops.aten._scaled_dot_product_flash_attention.default
        self.bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
        self.check_schemas()

    def check_schemas(self):
        fs, bs = self.fwd_op._schema, self.bwd_op._schema
        fa = [a.name for a in fs.arguments]
        fr = [r.name for r in fs.returns]
        ba = [a.name for a in bs.arguments]
        bkw = [a.name for a in bs.arguments if a.kwarg_only]
        ok = (fa == self.FWD_ARGS and len(fr) >= 8 and fr[:6] == self.FWD_RETS
              and len(ba) == 15 and ba[:12] == self.BWD_ARGS and bkw == ["scale"]
              and all(str(bs.arguments[i].type) == "Tensor" for i in (12, 13))
              and [r.name for r in bs.returns] == ["grad_query", "grad_key", "grad_value"])
        if not ok:
            die("the flash ops' signatures differ from the ones this script was written for "
                "(torch 2.11):\n  expected aten::_scaled_dot_product_flash_attention(query, key, "
                "value, dropout_p, is_causal, return_debug_mask, *, scale) -> (output, logsumexp, "
                "cum_seq_q, cum_seq_k, max_q, max_k, <rng>, <rng>, debug_attn_mask)\n  and "
                "aten::_scaled_dot_product_flash_attention_backward(grad_out, query, key, value, "
                "out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, "
                f"<rng>, <rng>, *, scale)\n  got: {fs}\n  and: {bs}")

    def fwd(self, q, k, v, causal):
        r = self.fwd_op(q, self.expand(k), self.expand(v), 0.0, causal, False, scale=self.scale)
        # meta: cum_seq_q, cum_seq_k, max_q, max_k and the two rng tensors, for the backward
        return r[0], r[1], (r[2], r[3], r[4], r[5], r[6], r[7])

    def bwd(self, dout, q, k, v, out, lse, causal, meta):
        cq, ck, mq, mk, r1, r2 = meta
        dq, dk, dv = self.bwd_op(dout, q, self.expand(k), self.expand(v), out, lse.contiguous(),
                                 cq, ck, mq, mk, 0.0, causal, r1, r2, scale=self.scale)
        return dq, self.reduce(dk), self.reduce(dv)


class FlashCpu(Attention):
    """torch's CPU flash kernels (aten._scaled_dot_product_flash_attention_for_cpu)."""
    name = "flash-cpu"

    def fwd(self, q, k, v, causal):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, self.expand(k), self.expand(v), 0.0, causal, scale=self.scale)
        return o, l, None

    def bwd(self, dout, q, k, v, out, lse, causal, meta):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, self.expand(k), self.expand(v), out, lse, 0.0, causal, scale=self.scale)
        return dq, self.reduce(dk), self.reduce(dv)


class MathAttention(Attention):
    """Plain math, the stand-in for the flash ops in --cpu-check: out, lse (natural log, fp32 or
    fp64) and the analytic backward from the final out and lse, like FlashAttention's."""
    name = "math"

    def _scores(self, q, k, causal):
        acc = torch.promote_types(q.dtype, torch.float32)
        s = torch.matmul(q.to(acc), self.expand(k).to(acc).transpose(-1, -2)) * self.scale
        if causal:
            sq, sk = s.shape[-2], s.shape[-1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(mask, -math.inf)
        return s

    def fwd(self, q, k, v, causal):
        s = self._scores(q, k, causal)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        o = torch.matmul(p, self.expand(v).to(p.dtype)).to(q.dtype)
        return o, lse, None

    def bwd(self, dout, q, k, v, out, lse, causal, meta):
        s = self._scores(q, k, causal)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        do, ke, ve = dout.to(acc), self.expand(k).to(acc), self.expand(v).to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, ve.transpose(-1, -2))
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, ke) * self.scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * self.scale
        t = q.dtype
        return dq.to(t), self.reduce(dk.to(t)), self.reduce(dv.to(t))


# ---- the ring ----------------------------------------------------------------------------------

class Ring:
    """Send to rank+1, receive from rank-1 (batch_isend_irecv), with a tag per traffic class."""
    TAG_KV, TAG_DKV = 1, 2

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world

    def exchange(self, send, recv, tag):
        ops = [dist.P2POp(dist.isend, send, self.next, tag=tag),
               dist.P2POp(dist.irecv, recv, self.prev, tag=tag)]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works):
        for w in works:
            w.wait()


def T(x):
    """[B, S, H, D] storage -> the [B, H, S, D] view the kernels take."""
    return x.transpose(1, 2)


def merge(out_acc, lse_acc, o, lse):
    """In place: out_acc [B, S, H, D] and lse_acc [B, H, S] (fp32 views) absorb the partial o
    ([B, H, S, D] view) with its lse: lse' = logaddexp(lse_acc, lse), out' = exp(lse_acc - lse')
    out_acc + exp(lse - lse') o."""
    lse = lse.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lse)
    a = torch.exp(lse_acc - new).transpose(1, 2).unsqueeze(-1)
    b = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(a).add_(T(o) * b)
    lse_acc.copy_(new)


def ring_forward(attn, ring, q, kv, acc):
    """q [1, 2c, Hq, D], kv [2, 1, 2c, Hkv, D] local (zigzag). Returns out (q's dtype, [1, 2c,
    Hq, D]), lse ([1, Hq, 2c], acc dtype) and the per-step kernel metadata for the backward."""
    W, r = ring.world, ring.rank
    c = q.shape[1] // 2
    metas = []
    cur = kv
    out_acc = lse_acc = None
    for s in range(W):
        works = None
        if s + 1 < W:
            nxt = torch.empty_like(cur)
            works = ring.exchange(cur, nxt, Ring.TAG_KV)
        src = (r - s) % W
        if s == 0:
            o, lse, m = attn.fwd(T(q), T(cur[0]), T(cur[1]), True)
            out_acc = T(o).to(acc).contiguous()
            lse_acc = lse.to(acc).contiguous()
        elif src < r:   # all of q against chunk src (the block's first half)
            o, lse, m = attn.fwd(T(q), T(cur[0, :, :c]), T(cur[1, :, :c]), False)
            merge(out_acc, lse_acc, o, lse)
        else:           # chunk 2W-1-r (q's second half) against the whole block
            o, lse, m = attn.fwd(T(q[:, c:]), T(cur[0]), T(cur[1]), False)
            merge(out_acc[:, c:], lse_acc[:, :, c:], o, lse)
        del o, lse
        metas.append(m)
        if works is not None:
            Ring.wait(works)
            cur = nxt
    return out_acc.to(q.dtype), lse_acc, metas


def ring_backward(attn, ring, q, kv, out, lse, dout, metas, acc):
    """Returns dq [1, 2c, Hq, D], dk, dv [1, 2c, Hkv, D] (q's dtype) of this rank's rows."""
    W, r = ring.world, ring.rank
    c = q.shape[1] // 2
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_hi = lse[:, :, c:].contiguous()
    lse = lse.contiguous()
    cur = kv
    dkv_works = dkv_in = None
    for s in range(W):
        kv_works = None
        if s + 1 < W:
            nxt = torch.empty_like(cur)
            kv_works = ring.exchange(cur, nxt, Ring.TAG_KV)
        src = (r - s) % W
        if s == 0:
            dq, dk, dv = attn.bwd(T(dout), T(q), T(cur[0]), T(cur[1]), T(out), lse, True,
                                  metas[s])
            dq_acc.add_(T(dq))
            kv_rows = slice(None)
        elif src < r:
            dq, dk, dv = attn.bwd(T(dout), T(q), T(cur[0, :, :c]), T(cur[1, :, :c]), T(out),
                                  lse, False, metas[s])
            dq_acc.add_(T(dq))
            kv_rows = slice(0, c)
        else:
            dq, dk, dv = attn.bwd(T(dout[:, c:]), T(q[:, c:]), T(cur[0]), T(cur[1]),
                                  T(out[:, c:]), lse_hi, False, metas[s])
            dq_acc[:, c:].add_(T(dq))
            kv_rows = slice(None)
        del dq
        # the travelling dK/dV of the block in hand: the ranks before this one, plus this one
        if s == 0:
            dkv = torch.empty(cur.shape, dtype=acc, device=q.device)
            dkv[0].copy_(T(dk))
            dkv[1].copy_(T(dv))
        else:
            Ring.wait(dkv_works)
            dkv = dkv_in
            dkv[0, :, kv_rows].add_(T(dk))
            dkv[1, :, kv_rows].add_(T(dv))
        del dk, dv
        dkv_in = torch.empty_like(dkv)
        dkv_works = ring.exchange(dkv, dkv_in, Ring.TAG_DKV)   # to rank+1; the last one: owner
        del dkv
        if kv_works is not None:
            Ring.wait(kv_works)
            cur = nxt
    Ring.wait(dkv_works)
    t = q.dtype
    return dq_acc.to(t), dkv_in[0].to(t), dkv_in[1].to(t)


# ---- inputs, layout ----------------------------------------------------------------------------

def gen_chunk(j, c, hq, hkv, d, dtype, device, seed):
    """Chunk j (tokens j*c .. (j+1)*c) of q, k, v, dout: N(0, 1), the same on every rank."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1000003 + j)

    def rnd(h):
        return torch.randn(1, c, h, d, generator=g, device=device, dtype=torch.float32).to(dtype)
    return rnd(hq), rnd(hkv), rnd(hkv), rnd(hq)


def local_inputs(rank, world, n, hq, hkv, d, dtype, device, seed):
    c = n // (2 * world)
    a = gen_chunk(rank, c, hq, hkv, d, dtype, device, seed)
    b = gen_chunk(2 * world - 1 - rank, c, hq, hkv, d, dtype, device, seed)
    q, k, v, do = (torch.cat([x, y], dim=1) for x, y in zip(a, b))
    kv = torch.stack([k, v])        # [2, 1, 2c, Hkv, D]: one message per ring step
    return q, kv, do


def unzigzag(parts, world, dim):
    """parts[r]: rank r's local tensor (chunks r, 2W-1-r along dim) -> the natural order."""
    chunks = [None] * (2 * world)
    for r, x in enumerate(parts):
        lo, hi = x.chunk(2, dim=dim)
        chunks[r], chunks[2 * world - 1 - r] = lo, hi
    return torch.cat(chunks, dim=dim)


# ---- check ---------------------------------------------------------------------------------------

def run_check(args, attn, ring, device, dtype, acc, collective_device):
    rank, world = ring.rank, ring.world
    n, hq, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    q, kv, do = local_inputs(rank, world, n, hq, hkv, d, dtype, device, args.seed)
    out, lse, metas = ring_forward(attn, ring, q, kv, acc)
    dq, dk, dv = ring_backward(attn, ring, q, kv, out, lse, do, metas, acc)
    got = {}
    for name, x, dim in (("o", out, 1), ("lse", lse, 2), ("dq", dq, 1), ("dk", dk, 1),
                         ("dv", dv, 1)):
        x = x.contiguous().to(collective_device)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        if rank == 0:
            got[name] = unzigzag([p.to(device) for p in parts], world, dim)
    failed = torch.zeros(1, dtype=torch.int32, device=collective_device)
    errors = {}
    if rank == 0:
        c = n // (2 * world)
        chunks = [gen_chunk(j, c, hq, hkv, d, dtype, device, args.seed) for j in range(2 * world)]
        Q, K, V, DO = (torch.cat(t, dim=1) for t in zip(*chunks))
        ref_t = torch.float64 if dtype == torch.float64 else torch.float32
        Qr, Kr, Vr = (T(x).to(ref_t).requires_grad_(True) for x in (Q, K, V))
        g = hq // hkv
        Ke, Ve = Kr.repeat_interleave(g, dim=1), Vr.repeat_interleave(g, dim=1)
        O = torch.nn.functional.scaled_dot_product_attention(
            Qr, Ke, Ve, is_causal=True, scale=attn.scale)
        O.backward(T(DO).to(ref_t))
        with torch.no_grad():
            mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
            L = torch.stack([torch.logsumexp(
                (Qr[:, h] @ Ke[:, h].transpose(-1, -2) * attn.scale).masked_fill(mask, -math.inf),
                dim=-1) for h in range(hq)], dim=1)
        ref = {"o": T(O.detach()), "lse": L, "dq": T(Qr.grad), "dk": T(Kr.grad),
               "dv": T(Vr.grad)}
        for name in ("o", "lse", "dq", "dk", "dv"):
            a, b = got[name].to(ref_t), ref[name]
            if a.shape != b.shape:   # no die() here: the other ranks wait in the broadcast
                log(f"check: {name} has shape {tuple(a.shape)}, the reference {tuple(b.shape)}")
                errors[name] = math.inf
                continue
            err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            if not math.isfinite(err):
                err = math.inf
            errors[name] = err
        ok = all(e <= args.tol for e in errors.values())
        log("check (N=%d, W=%d, %s, %s attention): max|ring - ref| / max|ref|: %s -> %s"
            % (n, world, str(dtype).replace("torch.", ""), attn.name,
               ", ".join(f"{k} {v:.3e}" for k, v in errors.items()),
               f"PASS (<= {args.tol:g})" if ok else f"FAIL (> {args.tol:g})"))
        failed[0] = 0 if ok else 1
    dist.broadcast(failed, 0)
    return (not bool(failed.item())), errors


# ---- timing --------------------------------------------------------------------------------------

class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn):
        self.sync()
        dist.barrier()
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def run_timing(args, attn, ring, device, dtype, acc, collective_device, gqa_mode, check):
    rank, world = ring.rank, ring.world
    n, hq, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    q, kv, do = local_inputs(rank, world, n, hq, hkv, d, dtype, device, args.seed + 7)
    timer = Timer(device)

    def fwd():
        ring_forward(attn, ring, q, kv, acc)

    def fwdbwd():
        out, lse, metas = ring_forward(attn, ring, q, kv, acc)
        ring_backward(attn, ring, q, kv, out, lse, do, metas, acc)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results = {}
    for name, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        for i in range(args.warmup):
            t = timer.measure(fn)
            log(f"{name} warm-up {i + 1}/{args.warmup}: {t:.4f} s (rank 0)", rank)
        mine = [timer.measure(fn) for _ in range(args.reps)]
        t = torch.tensor(mine, dtype=torch.float64, device=collective_device)
        slowest = t.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        results[name] = {
            "median_max_over_ranks": statistics.median(slowest.tolist()),
            "per_rank_median": [statistics.median(g.tolist()) for g in gathered],
            "runs_max_over_ranks": slowest.tolist(),
        }
        log(f"{name}: median {results[name]['median_max_over_ranks']:.4f} s (slowest rank), "
            f"per rank {['%.4f' % x for x in results[name]['per_rank_median']]}", rank)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                         else 0.0], dtype=torch.float64, device=collective_device)
    peaks = [torch.empty_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)

    pairs = hq * n * (n + 1) / 2
    fwd_flop = 4.0 * d * pairs
    fwdbwd_flop = 3.5 * fwd_flop
    tf = results["fwd"]["median_max_over_ranks"]
    tfb = results["fwdbwd"]["median_max_over_ranks"]
    doc = {
        "peer": "torch-ring-zigzag-flash" if isinstance(attn, FlashCuda)
                else f"torch-ring-zigzag-cpu-{attn.name}",
        "seq_len": n, "world": world, "heads": hq, "kv_heads": hkv, "head_dim": d,
        "dtype": str(dtype).replace("torch.", ""), "causal": True, "layout": "zigzag",
        "gqa": gqa_mode,
        "fwd_seconds": tf, "fwdbwd_seconds": tfb, "bwd_seconds": tfb - tf,
        "tokens_per_second": n / tfb,
        "pairs": pairs,
        "fwd_tflops": fwd_flop / tf / 1e12, "fwdbwd_tflops": fwdbwd_flop / tfb / 1e12,
        "fwd_tflops_per_gpu": fwd_flop / tf / 1e12 / world,
        "fwdbwd_tflops_per_gpu": fwdbwd_flop / tfb / 1e12 / world,
        "timing": "CUDA events; per run the slowest rank (max over ranks), median of runs"
                  if device.type == "cuda" else "perf_counter; slowest rank, median",
        "reps": args.reps, "warmup": args.warmup,
        "fwd_seconds_per_rank": results["fwd"]["per_rank_median"],
        "fwdbwd_seconds_per_rank": results["fwdbwd"]["per_rank_median"],
        "fwd_runs": results["fwd"]["runs_max_over_ranks"],
        "fwdbwd_runs": results["fwdbwd"]["runs_max_over_ranks"],
        "peak_gib_per_rank": [p.item() for p in peaks],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    if check is not None:
        doc["check"] = check
    return doc


# ---- process setup -------------------------------------------------------------------------------

def worker(args, rank, world, local_rank):
    """One rank, after the environment was checked. Returns the exit status."""
    cpu = args.cpu_check
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(d)
    if cpu:
        device = torch.device("cpu")
        dtype = getattr(torch, args.cpu_dtype)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        attn = (MathAttention if args.cpu_attn == "math" else FlashCpu)(hq, hkv, d, scale)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
        attn = FlashCuda(hq, hkv, d, scale)
    acc = torch.promote_types(dtype, torch.float32)

    # The kernel probe runs before the process group, so a failure here stops every rank alike.
    try:
        if not cpu:
            probe_flash(attn, device, dtype)
        gqa_mode = attn.probe_gqa(device, dtype, args.gqa)
    except SystemExit:
        raise
    except Exception as e:
        die(f"the {attn.name} attention op is unavailable or failed on a small probe: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    backend = "gloo" if cpu else "nccl"
    kw = {} if cpu else {"device_id": device}
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30), **kw)
    collective_device = device
    ring = Ring(rank, world)
    log(f"N={args.seq_len} W={world} Hq={hq} Hkv={hkv} d={d} {str(dtype)[6:]} "
        f"attention={attn.name} gqa={gqa_mode} torch={torch.__version__} "
        f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", rank)
    status = 0
    try:
        check = None
        if args.check:
            ok, errors = run_check(args, attn, ring, device, dtype, acc, collective_device)
            check = {"passed": ok, "tol": args.tol, "max_rel_err": errors if rank == 0 else None}
            if not ok:
                status = 3
        if status == 0 and not args.check_only:
            doc = run_timing(args, attn, ring, device, dtype, acc, collective_device, gqa_mode,
                             check)
            if rank == 0:
                line = json.dumps(doc)
                print(line, flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        f.write(line + "\n")
        dist.barrier()
    except torch.OutOfMemoryError as e:
        print(f"{PROG}: [rank {rank}] error: out of memory at N={args.seq_len}: "
              f"{str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(4)   # the peer is blocked in a collective: do not wait for it
    dist.destroy_process_group()
    return status


def probe_flash(attn, device, dtype):
    """Small causal call: the flash op runs here, its LSE is natural-log of the scaled scores."""
    B, S, D = 1, 256, attn.d
    gen = torch.Generator(device=device)
    gen.manual_seed(7)
    q = torch.randn(B, S, attn.hq, D, generator=gen, device=device).to(dtype)
    k = torch.randn(B, S, attn.hkv, D, generator=gen, device=device).to(dtype)
    o, lse, _ = attn.fwd(T(q), T(k), T(k), True)
    if tuple(lse.shape) != (B, attn.hq, S) or lse.dtype != torch.float32:
        die(f"the flash op returned a logsumexp of shape {tuple(lse.shape)} {lse.dtype}, "
            f"expected {(B, attn.hq, S)} float32")
    ke = T(k).float().repeat_interleave(attn.hq // attn.hkv, dim=1)
    s = (T(q).float() @ ke.transpose(-1, -2)) * attn.scale
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=device).triu(1), -math.inf)
    err = (torch.logsumexp(s, -1) - lse).abs().max().item()
    if not err < 0.05:
        die(f"the flash op's logsumexp is not log-sum-exp of the scaled scores (off by {err:.3g})")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, world, args, port):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    sys.exit(worker(args, rank, world, rank))


def main():
    args = parse_args()
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ

    if args.cpu_check:
        if not dist.is_available() or not dist.is_gloo_available():
            die("--cpu-check needs torch.distributed with the gloo backend")
        if under_launcher:
            world = int(os.environ["WORLD_SIZE"])
            check_sizes(args, world)
            sys.exit(worker(args, int(os.environ["RANK"]), world,
                            int(os.environ.get("LOCAL_RANK", "0"))))
        world = args.cpu_world
        check_sizes(args, world)
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_spawned, args=(r, world, args, port)) for r in range(world)]
        for p in procs:
            p.start()
        codes = []
        for p in procs:
            p.join()
            codes.append(p.exitcode)
        bad = [c for c in codes if c != 0]
        sys.exit(0 if not bad else (3 if 3 in bad else max(abs(c) for c in bad)))

    # GPU path: one process per GPU under torchrun, NCCL.
    if not torch.cuda.is_available():
        die("no CUDA GPU is visible (this peer needs 2 GPUs; --cpu-check runs it on the CPU)")
    ngpu = torch.cuda.device_count()
    if not under_launcher:
        if ngpu < 2:
            die(f"fewer than 2 GPUs ({ngpu} visible): the ring needs 2 GPUs, one process each")
        die("launch one process per GPU: torchrun --nproc_per_node 2 "
            "tools/bench_ring_torch_peer.py --seq-len N ...")
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world < 2:
        die(f"WORLD_SIZE is {world}: the ring needs 2 or more GPUs (torchrun --nproc_per_node 2)")
    if ngpu < local_world or local_rank >= ngpu:
        die(f"fewer GPUs ({ngpu} visible) than processes on this host ({local_world})")
    if not dist.is_nccl_available():
        die("this torch has no NCCL backend")
    check_sizes(args, world)
    sys.exit(worker(args, rank, world, local_rank))


def check_sizes(args, world):
    n = args.seq_len
    if world < 2:
        die(f"the ring needs 2 or more ranks (got {world})")
    if n % (2 * world):
        die(f"--seq-len {n} must be a multiple of 2 * world = {2 * world} (zigzag: 2W chunks)")


if __name__ == "__main__":
    main()
