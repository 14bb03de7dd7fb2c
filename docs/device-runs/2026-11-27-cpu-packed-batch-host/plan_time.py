"""mtrain_plan_create of a packed batch on the CPU backend: 65536 tokens as 1 to 256 documents,
4 heads of 4 diagonals and 94 verticals, granularity 128; medians of 11 builds (each plan
destroyed). Run once per library (MTRAIN_LIBRARY) to compare two builds."""
import ctypes
import statistics
import time

import torch
from mtrain import _core as C, _lib as L
g = torch.Generator().manual_seed(0)
opts = C.Options(backend="cpu")
ctx = C.context(opts, torch.device("cpu"), torch.float32)
def med(fn, reps=11):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for docs in (1, 16, 64, 256):
    n = 65536 // docs
    pats = []
    for i in range(docs):
        heads = [(list(range(min(4, -(-n // 128)))), sorted(set(torch.randint(0, n, (min(94, n),), generator=g).tolist()))) for _ in range(4)]
        pats.append(C.vertical_slash_pattern(n, heads, 128))
    arr = (ctypes.c_void_p * len(pats))(*[p.ptr.value for p in pats])
    seqs, keep = C._seqs([n] * docs)
    def build():
        out = ctypes.c_void_p()
        L.check(L.lib().plan_create(ctx.ptr, ctypes.byref(seqs), arr, ctypes.byref(out)), "plan")
        L.lib().plan_destroy(out)
    print(f"{docs:4d} docs: plan_create {med(build):.3f} ms")
