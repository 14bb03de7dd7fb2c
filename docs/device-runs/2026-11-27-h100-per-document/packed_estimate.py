"""The estimate and plan (mtrain.estimate_pattern) against the attention with that plan, for 1, 16 and 64
packed documents (the training program's mini shapes), one GPU; log per-document.log."""

import statistics
import time

import torch

import mtrain

dev = torch.device("cuda")
T, H, KV, D = 65536, 4, 2, 64
torch.manual_seed(0)
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
print("| docs | estimate_pattern ms | attention with the plan, fwd ms |")
print("|---|---|---|")
for docs in (1, 16, 64):
    cu = torch.tensor([round(i * T / docs) for i in range(docs + 1)], dtype=torch.int32)
    te, ta = [], []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = mtrain.estimate_pattern(q, k, mtrain.TopK(94, 132), cu_seqlens=cu, granularity=128)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        mtrain.attention(q, k, v, plan, cu_seqlens=cu, granularity=128)
        torch.cuda.synchronize()
        te.append(t1 - t0)
        ta.append(time.perf_counter() - t1)
    print(
        f"| {docs} | {statistics.median(te[1:]) * 1e3:.2f} | {statistics.median(ta[1:]) * 1e3:.2f} |",
        flush=True,
    )
