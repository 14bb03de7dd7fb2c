"""Bars against block diagonals in mtrain's kernels at the training's shapes (2 x 32768 tokens,
8:2 heads of d 64, bf16, granularity 128): forward + backward of (V) the training's mtrain-static
shape of pattern, 1054 verticals per head (the 30 sinks and 1024 random keys) and block diagonals
0-5, (S) block diagonals only with about the same pairs, (D) mtrain's dense pattern; and SDPA
cuDNN. Time per computed pair shows what the bars cost. Medians of 5 after 1 warm-up."""

import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mtrain

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
N = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
B, H, KV, D, G = 2, 8, 2, 64, 128
torch.manual_seed(0)
rng = random.Random(0)


def rnd(h: int) -> torch.Tensor:
    return torch.randn(B, N, h, D, device=dev, dtype=torch.bfloat16, requires_grad=True)


q, k, v = rnd(H), rnd(KV), rnd(KV)
do = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16)


def sync() -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> float:
    ts = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) * 1e3


nv = 30 + round(N / 32) - 30
vs = [sorted(set(range(30)) | set(rng.sample(range(30, N - G), nv))) for _ in range(H)]
pat_v = mtrain.vertical_slash_pattern(N, [(list(range(6)), vs[h]) for h in range(H)], G)
pairs_v = sum(pat_v.count_pairs(h) for h in range(H))
nd = 6
while True:
    pat_s = mtrain.vertical_slash_pattern(N, [(list(range(nd)), []) for _ in range(H)], G)
    if sum(pat_s.count_pairs(h) for h in range(H)) >= pairs_v or nd >= N // G:
        break
    nd += 1
pats = {
    "V: 1054 verticals + diagonals 0-5": pat_v,
    f"S: diagonals 0-{nd - 1}": pat_s,
    "D: dense": mtrain.dense_pattern(N, H, G),
}
causal_pairs = H * N * (N + 1) // 2
if dev.type == "cuda":

    def sdpa() -> None:
        qq, kk, vv = (x.transpose(1, 2) for x in (q, k, v))
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        o.backward(do.transpose(1, 2))

    ms = timed(sdpa)
    print(
        f"SDPA cuDNN fwd+bwd: {ms:.2f} ms, {ms / (B * causal_pairs / 1e9):.3f} ms per Gpair",
        flush=True,
    )
for name, p in pats.items():
    pairs = sum(p.count_pairs(h) for h in range(H))

    def fb() -> None:
        o = mtrain.attention(q, k, v, pattern=[p] * B, granularity=G)
        o.backward(do)

    def fw() -> None:
        with torch.no_grad():
            mtrain.attention(q, k, v, pattern=[p] * B, granularity=G)

    ms_f, ms_fb = timed(fw), timed(fb)
    print(
        f"{name}: density {pairs / causal_pairs:.3f}; fwd {ms_f:.2f} ms, fwd+bwd {ms_fb:.2f} ms, "
        f"{ms_fb / (B * pairs / 1e9):.3f} ms per Gpair",
        flush=True,
    )
