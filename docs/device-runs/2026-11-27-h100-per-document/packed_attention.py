"""Per-document cost of mtrain.attention on a packed batch (the training program's mini shapes), one GPU:
forward and forward+backward with the online estimate (TopK) and dense, for 1 to 64 documents; log per-document.log."""

import statistics
import time

import torch

import mtrain

dev = torch.device("cuda")
T, H, KV, D = 65536, 4, 2, 64
torch.manual_seed(0)
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
print("| docs | budgets | fwd ms | fwd+bwd ms | estimate ms (last) | per extra doc ms (fwd+bwd) |")
print("|---|---|---|---|---|---|")
for label, kw in (("TopK(94,132)", dict(budgets=mtrain.TopK(94, 132))), ("dense", {})):
    base = None
    for docs in (1, 4, 16, 32, 64):
        cu = torch.tensor([round(i * T / docs) for i in range(docs + 1)], dtype=torch.int32)

        def run(bwd):
            o = mtrain.attention(q, k, v, cu_seqlens=cu, granularity=128, **kw)
            if bwd:
                o.backward(g)
            torch.cuda.synchronize()

        for bwd in (False, True):
            run(bwd)
        tf, tb = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            run(False)
            tf.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run(True)
            tb.append(time.perf_counter() - t0)
        f, b = statistics.median(tf) * 1e3, statistics.median(tb) * 1e3
        est = mtrain.last_estimate_times() if kw else None
        e = f"{(est['scores'] + est['select']) * 1e3:.2f}" if est else "-"
        if base is None:
            base = (docs, b)
        per = (b - base[1]) / (docs - base[0]) if docs > base[0] else float("nan")
        print(f"| {docs} | {label} | {f:.2f} | {b:.2f} | {e} | {per:.3f} |", flush=True)
