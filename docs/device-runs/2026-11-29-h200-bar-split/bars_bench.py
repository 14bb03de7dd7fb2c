"""Kernel times of mtrain's vertical-slash forward and backward at the training's shapes
(B x 32768 tokens, 8:2 heads, d 64, bf16) for given patterns: block diagonals alone, with
verticals spread over the sequence, and with verticals all early (every bar tile walks every
query block): is the key-major backward bound by its bar items? Per case the CUDA time of each
kernel per iteration (torch.profiler), the longest launch of the dK/dV kernel, and the density.
  python3 docs/device-runs/2026-11-29-h200-bar-split/bars_bench.py [B] [N]"""

import random
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import mtrain

B = int(sys.argv[1]) if len(sys.argv) > 1 else 2
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
HQ, HKV, D, G = 8, 2, 64, 128
rng = random.Random(0)
torch.manual_seed(0)
dev = "cuda"
q = torch.randn(B, N, HQ, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, N, HKV, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, N, HKV, D, device=dev, dtype=torch.bfloat16)
do = torch.randn_like(q)


def spread(n: int) -> list[int]:
    return sorted(rng.sample(range(N), n))


def early(n: int) -> list[int]:
    return list(range(0, 2 * n, 2))


CASES = {
    "diag 0-7": (list(range(8)), lambda: []),
    "diag 0-7 + 512 verticals spread": (list(range(8)), lambda: spread(512)),
    "diag 0-7 + 512 verticals early": (list(range(8)), lambda: early(512)),
    "diag 0-3 + 1024 verticals spread": (list(range(4)), lambda: spread(1024)),
    "diag 0-3 + 1024 verticals early": (list(range(4)), lambda: early(1024)),
}
for det in (True, False):
    for name, (diags, vf) in CASES.items():
        pats = [
            mtrain.vertical_slash_pattern(N, [(diags, vf()) for _ in range(HQ)], G)
            for _ in range(B)
        ]
        dens = sum(p.density() for p in pats) / B

        def it() -> None:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            o = mtrain.attention(qq, kk, vv, pattern=pats, deterministic=det)
            o.backward(do)

        for _ in range(2):
            it()
        torch.cuda.synchronize()
        reps = 5
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                it()
            torch.cuda.synchronize()
        agg: dict[str, float] = defaultdict(float)
        longest: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type.name != "CUDA":
                continue
            n = e.name
            key = (
                "fwd"
                if "fwd" in n
                else "dkdv"
                if "bwd_ws" in n or "bwd_kv" in n or "wgmma_bwd" in n
                else "dq"
                if "bwd_dq" in n
                else "split"
                if "kv_split" in n
                else None
            )
            if key is None:
                continue
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            agg[key] += us / reps / 1e3
            longest[key] = max(longest[key], us / 1e3)
        print(
            f"det {int(det)} | {name:34s} | density {dens:.4f} | "
            + " ".join(f"{kk} {agg[kk]:.3f}" for kk in ("fwd", "dq", "dkdv", "split"))
            + f" ms/iter | longest dkdv launch {longest['dkdv']:.3f} ms",
            flush=True,
        )
