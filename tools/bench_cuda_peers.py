#!/usr/bin/env python3
"""bench_cuda_peers.py: the peers of mtrain-bench-cuda, measured in the same run.

On the GPU machine (python3 with torch), for the shape of mtrain-bench-cuda
(one sequence, Hq query heads, Hkv kv heads, head_dim d, bf16, causal):

- SDPA flash: torch.nn.functional.scaled_dot_product_attention with the flash
  backend, causal, GQA through enable_gqa (or k/v repeated to Hq heads where
  that backend refuses it), forward and forward+backward; SDPA cuDNN beside it
  where this torch has it;
- FlexAttention (torch.nn.attention.flex_attention, compiled with
  torch.compile): dense causal, and the vertical-slash pattern of
  mtrain-bench-cuda --pattern-out as a BlockMask of the pattern's granularity:
  the block diagonals of a head are full blocks, its diagonal block and the
  key blocks holding its vertical columns are partial blocks, and a mask_mod
  that reads tensors of the head's block diagonals and verticals keeps
  exactly the pairs of SPEC.md section 1 (the pair count is checked against
  mtrain's);

timed like mtrain-bench-cuda: CUDA events around each call, --warmup runs
first, the median of --reps runs, two input sets used in turn, N(0, 1)
inputs. Effective FLOPs: forward 4*d*pairs, forward+backward 3.5x that
(SPEC.md section 6), pairs = the pattern's allowed (query, key) pairs.

The independent check (issue 6): with --dump-dir (mtrain-bench-cuda
--dump-dir), the dumped validation problems (inputs, pattern, every variant's
o, lse, dq, dk, dv) are recomputed with FlexAttention on the same inputs and
with an fp32 dense-masked reference; the script prints max|mtrain - flex| and
the errors of both against the fp32 reference, and fails (exit 3) when
mtrain's error exceeds twice flex's (floor 1e-3 * max|reference|) or when the
mask does not select exactly mtrain's pairs.

Prints one table last: peer, pattern, fwd ms, fwd TFLOP/s, fwd+bwd ms,
TFLOP/s, with mtrain's rows from --ours (mtrain-bench-cuda --json).

The strongest peers of issue 21 (tools/peers_run.py and the modules it names): the MInference
authors' vertical-slash kernel (minference), cuDNN through nvidia-cudnn-frontend (cudnn-fe:
dense, and a block mask with --block-keep), flash-attn, FlashInfer; a peer that cannot run is
one line "cannot run: <why>" and a row of the table. --dry-run checks the index conversions,
pair counts and imports without timing (on the CPU too).
"""
import argparse
import json
import math
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_common  # noqa: E402
import peers_run  # noqa: E402

ALL_PEERS = "sdpa-flash,sdpa-cudnn,flex,minference,cudnn-fe,flash-attn,flashinfer"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pattern", help="vertical-slash pattern JSON (mtrain-bench-cuda --pattern-out)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens (default: the pattern's, else 32768)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--peers", default="sdpa-flash,sdpa-cudnn,flex",
                   help=f"comma-separated subset of {ALL_PEERS}")
    p.add_argument("--block-keep", type=int, default=0,
                   help="also time bench_block_kernels' random block mask keeping this many key "
                        "blocks per query block (0: not)")
    p.add_argument("--wheels-dir", default=os.path.join(os.path.dirname(__file__), "..", ".whl"),
                   help="where minference's source distribution is (minference-*.tar.gz)")
    p.add_argument("--work-dir", default="/tmp/mtrain-peers",
                   help="where minference's extension is built (kept between runs)")
    p.add_argument("--peer-limit", type=float, default=240.0,
                   help="seconds allowed to each peer (build and timing); past it: cannot run")
    p.add_argument("--dry-run", action="store_true",
                   help="no timing: check the index conversions, pair counts and imports")
    p.add_argument("--dump-dir", help="mtrain-bench-cuda --dump-dir: run the independent check")
    p.add_argument("--ours", help="mtrain-bench-cuda --json output: mtrain's rows in the table")
    p.add_argument("--json", help="write the results as JSON to this file")
    p.add_argument("--check-only", action="store_true",
                   help="only the independent check of --dump-dir (no timing)")
    p.add_argument("--device", default="cuda", help="torch device (cuda; cpu only for --check-only)")
    return p.parse_args()


# ---- patterns ------------------------------------------------------------------------------

class Pattern:
    """A pattern JSON (SPEC.md section 8) as tensors: per head the block
    diagonals (diag[h, t]), the vertical key positions (vert[h, j]) or, for
    block-mask heads, the block mask (bm[h, qb, kb])."""

    def __init__(self, doc, device):
        self.G = int(doc["granularity"])
        self.N = int(doc["seq_len"])
        heads = doc["heads"]
        self.H = len(heads)
        self.nb = (self.N + self.G - 1) // self.G
        diag = torch.zeros(self.H, self.nb, dtype=torch.bool)
        vert = torch.zeros(self.H, self.N, dtype=torch.bool)
        bm = torch.zeros(self.H, self.nb, self.nb, dtype=torch.bool)
        is_bm = torch.zeros(self.H, dtype=torch.bool)
        for h, e in enumerate(heads):
            if "block_mask" in e:
                is_bm[h] = True
                for qb, kb in e["block_mask"]:
                    bm[h, qb, kb] = True
                for b in range(self.nb):
                    bm[h, b, b] = True  # the block diagonal is forced on
            else:
                d = torch.tensor(e.get("diagonals", []), dtype=torch.long)
                diag[h, d[d < self.nb]] = True
                diag[h, 0] = True  # diagonal 0 is always present
                v = torch.tensor(e.get("verticals", []), dtype=torch.long)
                vert[h, v] = True
        self.diag, self.vert, self.bm, self.is_bm = (x.to(device) for x in (diag, vert, bm, is_bm))
        self.any_bm = bool(is_bm.any())

    @staticmethod
    def dense(N, H, G, device):
        nb = (N + G - 1) // G
        doc = {"granularity": G, "seq_len": N,
               "heads": [{"diagonals": list(range(nb)), "verticals": []} for _ in range(H)]}
        return Pattern(doc, device)

    def blocks(self):
        """Full and partial blocks [H, nb, nb]: full blocks are allowed
        entirely, partial blocks in part (mask_mod decides)."""
        dev = self.diag.device
        qb = torch.arange(self.nb, device=dev)[:, None]
        kb = torch.arange(self.nb, device=dev)[None, :]
        t = qb - kb
        tc = t.clamp(min=0)
        on_diag = self.diag[:, tc] & (t >= 1)  # [H, nb, nb]
        vblock = torch.zeros(self.H, self.nb * self.G, dtype=torch.bool, device=dev)
        vblock[:, : self.N] = self.vert
        vblock = vblock.view(self.H, self.nb, self.G).any(-1)  # key block holds a vertical
        full = on_diag
        partial = (t == 0).expand(self.H, -1, -1) | ((t >= 1) & ~on_diag & vblock[:, None, :])
        if self.any_bm:
            m = self.is_bm[:, None, None]
            full = torch.where(m, self.bm & (t >= 1), full)
            partial = torch.where(m, self.bm & (t == 0), partial)
        return full, partial

    def mask_mod(self):
        """SPEC.md allowed(h, i, j) as a FlexAttention mask_mod."""
        G, diag, vert, bm, is_bm = self.G, self.diag, self.vert, self.bm, self.is_bm
        any_bm = self.any_bm

        def allowed(b, h, q_idx, kv_idx):
            t = q_idx // G - kv_idx // G
            vs = (diag[h, t.clamp(min=0)] & (t >= 0)) | (vert[h, kv_idx] & (t > 0))
            if any_bm:
                vs = torch.where(is_bm[h], bm[h, q_idx // G, kv_idx // G], vs)
            return (kv_idx <= q_idx) & vs

        return allowed

    def pairs(self):
        """Number of allowed (query, key) pairs over all heads (exact)."""
        G, N, nb = self.G, self.N, self.nb
        rows = torch.full((nb,), G, dtype=torch.float64, device=self.diag.device)
        rows[-1] = N - (nb - 1) * G
        full, partial = self.blocks()
        t = (torch.arange(nb, device=rows.device)[:, None] -
             torch.arange(nb, device=rows.device)[None, :])
        cells = rows[:, None] * rows[None, :]
        total = (full.double() * cells).sum()
        diag_blocks = partial & (t == 0)
        total += (diag_blocks.double() * (rows * (rows + 1) / 2)[None, :, None]).sum()
        vcount = torch.zeros(self.H, nb * G, dtype=torch.float64, device=rows.device)
        vcount[:, :N] = self.vert.double()
        vcount = vcount.view(self.H, nb, G).sum(-1)
        bars = partial & (t >= 1) & ~self.is_bm[:, None, None]
        total += (bars.double() * rows[None, :, None] * vcount[:, None, :]).sum()
        return int(total.item())


def to_block_mask(pattern, mask_mod):
    """A BlockMask of the pattern's blocks (block size = its granularity)."""
    from torch.nn.attention.flex_attention import BlockMask

    full, partial = pattern.blocks()

    def ordered(m):
        num = m.sum(-1).to(torch.int32)[None]
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
        return num.contiguous(), idx.contiguous()

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=pattern.G,
                                    mask_mod=mask_mod, seq_lengths=(pattern.N, pattern.N))


def causal_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


# ---- timing --------------------------------------------------------------------------------

def median_ms(fn, warmup, reps):
    """Median milliseconds of fn(i) over reps runs after warmup runs, CUDA events."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def make_sets(args, N, device):
    """Two input sets of N(0, 1) bf16 tensors in [1, heads, N, d] layout."""
    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    sets = []
    for _ in range(2):
        def rnd(h):
            return torch.randn(1, h, N, args.head_dim, generator=g, device=device,
                               dtype=torch.float32).to(torch.bfloat16)
        sets.append({"q": rnd(args.heads), "k": rnd(args.kv_heads), "v": rnd(args.kv_heads),
                     "dout": rnd(args.heads)})
    return sets


def time_peer(attn, sets, args):
    """(forward ms, forward+backward ms) of attn(q, k, v) on the input sets."""
    leaves = [{n: s[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
              for s in sets]

    def fwd(i):
        s = sets[i % 2]
        with torch.no_grad():
            attn(s["q"], s["k"], s["v"])

    def fwd_bwd(i):
        s, l = sets[i % 2], leaves[i % 2]
        for x in l.values():
            x.grad = None
        out = attn(l["q"], l["k"], l["v"])
        out.backward(s["dout"])

    return median_ms(fwd, args.warmup, args.reps), median_ms(fwd_bwd, args.warmup, args.reps)


def sdpa(backend_name, args):
    """SDPA restricted to one backend, GQA by enable_gqa or by repeating k/v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    group = args.heads // args.kv_heads
    state = {"gqa": True}

    def attn(q, k, v):
        with sdpa_kernel(backend):
            if state["gqa"]:
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                except RuntimeError as e:
                    print(f"  {backend_name}: enable_gqa refused ({str(e).splitlines()[0]}); "
                          "repeating k/v to Hq heads", file=sys.stderr)
                    state["gqa"] = False
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                                  v.repeat_interleave(group, dim=1),
                                                  is_causal=True)
    return attn, state


def flex(block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def attn(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
    return attn


# ---- the independent check ------------------------------------------------------------------

def load_npy(path, device):
    return torch.from_numpy(np.load(path).astype(np.float32)).to(device)


def check_problem(folder, device, compiled):
    """Recomputes one dumped validation problem with FlexAttention and an
    fp32 dense-masked reference; returns (lines, ok)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_mask, flex_attention

    meta = json.load(open(os.path.join(folder, "meta.json")))
    with open(os.path.join(folder, "pattern.json")) as f:
        pattern = Pattern(json.load(f), device)
    N, H, Hkv, d = meta["seq_len"], meta["heads"], meta["kv_heads"], meta["head_dim"]
    scale = meta.get("softmax_scale", 1.0 / math.sqrt(d))
    lines, ok = [], True
    # the mask selects exactly mtrain's pairs
    mod = pattern.mask_mod()
    dense = create_mask(mod, 1, H, N, N, device=device)[0]  # [H, N, N]
    n_mask = int(dense.sum().item())
    n_pat = pattern.pairs()
    full, partial = pattern.blocks()
    nb, G = pattern.nb, pattern.G
    pad = nb * G - N
    any_blk = F.pad(dense, (0, pad, 0, pad)).view(H, nb, G, nb, G).any(dim=(2, 4))
    padded = torch.ones(H, nb * G, nb * G, dtype=torch.bool, device=device)  # padding: neutral
    padded[:, :N, :N] = dense
    all_blk = padded.view(H, nb, G, nb, G).all(dim=(2, 4))
    blocks_ok = bool(((any_blk & ~(full | partial)).sum() == 0) and ((full & ~all_blk).sum() == 0))
    pairs_ok = n_mask == n_pat == meta["computed_pairs"]
    ok &= pairs_ok and blocks_ok
    lines.append(f"{meta['pattern']}: N={N} pairs: mtrain {meta['computed_pairs']}, mask_mod {n_mask}, "
                 f"from the blocks {n_pat}; block mask covers them: {blocks_ok} -> "
                 f"{'ok' if pairs_ok and blocks_ok else 'MISMATCH'}")

    def inp(name, h):
        x = load_npy(os.path.join(folder, name + ".npy"), device)  # [N, h, d]
        return x.view(N, h, d).permute(1, 0, 2)[None].contiguous()

    q, k, v, dout = inp("q", H), inp("k", Hkv), inp("v", Hkv), inp("dout", H)
    # fp32 reference: dense masked softmax over the bf16 values, autograd gradients
    group = H // Hkv
    q32, k32, v32 = (x.clone().requires_grad_(True) for x in (q, k, v))
    s = torch.einsum("bhid,bhjd->bhij", q32, k32.repeat_interleave(group, 1)) * scale
    s = s.masked_fill(~dense[None], float("-inf"))
    lse32 = torch.logsumexp(s, dim=-1)
    o32 = torch.einsum("bhij,bhjd->bhid", torch.softmax(s, -1), v32.repeat_interleave(group, 1))
    o32.backward(dout)
    ref = {"o": o32.detach(), "lse": lse32.detach(), "dq": q32.grad, "dk": k32.grad, "dv": v32.grad}
    del s
    # FlexAttention in bf16
    bm = to_block_mask(pattern, mod)
    fn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    grads = device.type == "cuda"  # FlexAttention has no backward on the CPU (local tests)
    qb, kb, vb = (x.to(torch.bfloat16).requires_grad_(grads) for x in (q, k, v))
    try:
        o_f, aux = fn(qb, kb, vb, block_mask=bm, scale=scale, enable_gqa=True,
                      return_aux=AuxRequest(lse=True))
        lse_f = aux.lse
    except TypeError:  # a torch before return_aux
        o_f, lse_f = fn(qb, kb, vb, block_mask=bm, scale=scale, enable_gqa=True, return_lse=True)
    flex_out = {"o": o_f.detach().float(), "lse": lse_f.detach().float()}
    if grads:
        o_f.backward(dout.to(torch.bfloat16))
        flex_out.update({"dq": qb.grad.float(), "dk": kb.grad.float(), "dv": vb.grad.float()})
    variants = sorted(int(f[3:-4]) for f in os.listdir(folder) if f.startswith("o_v"))
    for var in variants:
        for name, h in (("o", H), ("lse", H), ("dq", H), ("dk", Hkv), ("dv", Hkv)):
            x = load_npy(os.path.join(folder, f"{name}_v{var}.npy"), device)
            ours = x.view(N, h).t()[None] if name == "lse" else x.view(N, h, d).permute(1, 0, 2)[None]
            r, fl = ref[name], flex_out.get(name)
            if fl is None:  # no flex backward (cpu): the bf16 rounding of the reference instead
                fl = r.to(torch.bfloat16).float()
            e_flex = (ours - fl).abs().max().item()
            e_ours = (ours - r).abs().max().item()
            e_peer = (fl - r).abs().max().item()
            floor = 1e-3 * r.abs().max().item()
            good = math.isfinite(e_ours) and e_ours <= max(2 * e_peer, floor)
            ok &= good
            lines.append(f"  variant {var} {name:3s}: max|mtrain - flex| {e_flex:.3e}; vs fp32 "
                         f"reference: mtrain {e_ours:.3e}, flex {e_peer:.3e} -> "
                         f"{'ok' if good else 'FAIL'}")
    return lines, ok


# ---- main -----------------------------------------------------------------------------------

def main():
    args = parse_args()
    device = torch.device(args.device)
    ok = True
    print(f"torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    if args.dump_dir:
        print("== independent check: mtrain's dumped outputs against FlexAttention (bf16) and an "
              "fp32 dense-masked reference", flush=True)
        for sub in ("dense", "vs"):
            folder = os.path.join(args.dump_dir, sub)
            if not os.path.isdir(folder):
                continue
            lines, good = check_problem(folder, device, compiled=device.type == "cuda")
            ok &= good
            print("\n".join(lines), flush=True)
    if args.check_only:
        return 0 if ok else 3
    if device.type != "cuda" and not args.dry_run:
        print("timing needs --device cuda (or --dry-run)", file=sys.stderr)
        return 2

    doc = None
    if args.pattern:
        with open(args.pattern) as f:
            doc = json.load(f)
    N = args.seq_len or (doc["seq_len"] if doc else 32768)
    if doc and doc["seq_len"] != N:
        print(f"--seq-len {N} differs from the pattern's {doc['seq_len']}", file=sys.stderr)
        return 2
    G = doc["granularity"] if doc else 128
    if N % G:
        print(f"N={N} is not a multiple of the granularity {G}", file=sys.stderr)
        return 2
    H, d = args.heads, args.head_dim
    dense_pairs = H * N * (N + 1) // 2
    peers = set(args.peers.split(","))
    sets = make_sets(args, N, device)
    rows = []

    def add(peer, pattern, pairs, fwd_ms, fb_ms, note=""):
        """A timed row; fb_ms None: the peer has no backward."""
        flops = 4.0 * d * pairs
        rows.append({"peer": peer, "pattern": pattern, "pairs": pairs, "forward_ms": fwd_ms,
                     "forward_tflops": flops / (fwd_ms * 1e-3) * 1e-12,
                     "forward_backward_ms": fb_ms,
                     "forward_backward_tflops": (3.5 * flops / (fb_ms * 1e-3) * 1e-12
                                                 if fb_ms else None), "note": note})
        r = rows[-1]
        fb = (f"forward+backward {fb_ms:.3f} ms ({r['forward_backward_tflops']:.1f} TFLOP/s)"
              if fb_ms else "no backward")
        print(f"  {peer} {pattern}: forward {fwd_ms:.3f} ms ({r['forward_tflops']:.1f} TFLOP/s), "
              f"{fb} {note}", flush=True)

    def skip(peer, pattern, why):
        """A peer that cannot run (or, with --dry-run, is not timed): one line, one row."""
        rows.append({"peer": peer, "pattern": pattern, "cannot_run": why})
        print(f"  {peer} {pattern}: cannot run: {why}", flush=True)

    print(f"== peers: N={N} Hq={H} Hkv={args.kv_heads} d={d} bf16 causal, median of {args.reps} "
          f"after {args.warmup} warm-up, CUDA events{' (DRY RUN: nothing timed)' if args.dry_run else ''}",
          flush=True)
    vs = Pattern(doc, device) if doc else None
    if vs is not None and vs.H != H:
        print(f"the pattern has {vs.H} heads, --heads is {H}", file=sys.stderr)
        return 2
    for name, backend in (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION")):
        if name not in peers:
            continue
        if args.dry_run:
            skip(name, "dense", "dry run: not timed")
            continue
        try:
            with peers_common.time_limit(args.peer_limit, name):
                attn, state = sdpa(backend, args)
                fwd_ms, fb_ms = time_peer(attn, sets, args)
            add(name, "dense", dense_pairs, fwd_ms, fb_ms,
                "" if state["gqa"] else "(k/v repeated to Hq heads)")
        except Exception as e:
            skip(name, "dense", peers_common.reason(e))
    if "flex" in peers:
        todo = [("dense", dense_pairs, lambda: to_block_mask(Pattern.dense(N, H, G, device), causal_mod))]
        if vs is not None:
            todo.append(("vertical-slash", vs.pairs(), lambda: to_block_mask(vs, vs.mask_mod())))
        for pattern, pairs, make in todo:
            if args.dry_run:
                skip("flex", pattern, "dry run: not timed")
                continue
            try:
                with peers_common.time_limit(args.peer_limit, "flex " + pattern):
                    fwd_ms, fb_ms = time_peer(flex(make()), sets, args)
                add("flex", pattern, pairs, fwd_ms, fb_ms)
            except Exception as e:
                skip("flex", pattern, peers_common.reason(e))
    ctx = peers_run.Ctx(args, device, sets, sys.modules[__name__], add, skip)
    ok &= peers_run.run(ctx, peers, doc, vs, N, dense_pairs)

    ours = None
    if args.ours and os.path.exists(args.ours):
        ours = json.load(open(args.ours))
        for r in ours.get("results", []):
            if "forward_ms" not in r:
                continue
            pattern = r["pattern"]
            if pattern == "vertical-slash" and doc:
                mine = [x for x in rows if x["peer"] in ("flex", "minference") and x["pattern"] == pattern
                        and "pairs" in x]
                for m in mine:
                    if m["pairs"] != r["computed_pairs"]:
                        print(f"pair counts differ: {m['peer']} {m['pairs']}, mtrain "
                              f"{r['computed_pairs']}", file=sys.stderr)
                        ok = False
            rows.append({"peer": f"mtrain v{r['variant']}", "pattern": pattern,
                         "pairs": r["computed_pairs"], "forward_ms": r["forward_ms"],
                         "forward_tflops": r["forward_tflops"],
                         "forward_backward_ms": r["forward_backward_ms"],
                         "forward_backward_tflops": r["forward_backward_tflops"], "note": ""})

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__,
                       "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "seq_len": N, "heads": H, "kv_heads": args.kv_heads, "head_dim": d,
                       "reps": args.reps, "warmup": args.warmup, "rows": rows}, f, indent=2)
    print("== peers table (effective TFLOP/s: forward 4*d*pairs, forward+backward 3.5x)")
    print(f"{'peer':12s} {'pattern':15s} {'density':>8s} {'fwd ms':>9s} {'fwd TFLOP/s':>12s} "
          f"{'fwd+bwd ms':>11s} {'TFLOP/s':>8s}")
    for r in rows:
        if "cannot_run" in r:
            print(f"{r['peer']:12s} {r['pattern']:15s} cannot run: {r['cannot_run']}")
            continue
        fb = (f"{r['forward_backward_ms']:11.3f} {r['forward_backward_tflops']:8.1f}"
              if r["forward_backward_ms"] else f"{'n/a':>11s} {'n/a':>8s}")
        print(f"{r['peer']:12s} {r['pattern']:15s} {100.0 * r['pairs'] / dense_pairs:7.2f}% "
              f"{r['forward_ms']:9.3f} {r['forward_tflops']:12.1f} {fb} {r['note']}".rstrip())
    # mtrain against the peer of the same pattern (time ratios; > 1: mtrain is faster)
    for r in rows:
        if not r["peer"].startswith("mtrain"):
            continue
        for peer in ("flex", "sdpa-flash", "sdpa-cudnn", "cudnn-fe", "flash-attn", "minference",
                     "minference-api"):
            p = [x for x in rows if x["peer"] == peer and x["pattern"] == r["pattern"]
                 and "cannot_run" not in x]
            if p:
                fb = (f"{p[0]['forward_backward_ms'] / r['forward_backward_ms']:.2f}"
                      if p[0]["forward_backward_ms"] and r["forward_backward_ms"] else "n/a")
                print(f"{r['peer']} {r['pattern']}: {peer} time / mtrain time = forward "
                      f"{p[0]['forward_ms'] / r['forward_ms']:.2f}, forward+backward {fb}")
    if not ok:
        print("the independent check or the pair count FAILED (see above)")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
