"""mtrain.estimate_pattern of a packed batch on the GPU, this package and library against the
tree given by PYTHONPATH/MTRAIN_LIBRARY: 65536 tokens as 64 and 256 documents, 4:2 heads of d
64, bf16, granularity 128, top-k 94/132. 'new plan': the previous result dropped before each
call, so the plan is built; 'live plan': the previous result kept, so the digest finds it.
Medians of 7 after 2 warm-up."""
import statistics
import sys
import time

import torch

import mtrain

dev = torch.device("cuda")
T, H, KV, D, G = 65536, 4, 2, 64, 128
torch.manual_seed(0)
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16)
budget = mtrain.TopK(94, 132)


def timed(fn, keep):
    ts, held = [], None
    for i in range(9):
        if not keep:
            held = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        held = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:]) * 1e3


tag = sys.argv[1]
for docs in (16, 64, 256):
    cu = torch.tensor([round(i * T / docs) for i in range(docs + 1)], dtype=torch.int32)
    f = lambda: mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, granularity=G)
    a, b = timed(f, False), timed(f, True)
    print(f"{tag:6s} {docs:4d} documents: estimate_pattern new plan {a:.3f} ms, live plan {b:.3f} ms",
          flush=True)
