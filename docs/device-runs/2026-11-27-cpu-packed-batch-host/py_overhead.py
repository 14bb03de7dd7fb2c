"""Two per-document costs of estimate_pattern for a packed batch that the package no longer pays
(commit after 8506eb7): a handle tensor per estimated pattern (now made on first use), and
reading back each pattern's shape (now only for patterns the caller gave). 256 documents."""
import time, statistics, torch
from mtrain import _core as C
pats = [C.vertical_slash_pattern(256, [([0, 1], list(range(0, 256, 3)))] * 4, 128) for _ in range(256)]
def med(fn, reps=31):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
handles = lambda: [C._handle_tensor(C.KIND_PATTERN, i) for i in range(256)]
check = lambda: [(p.seq_len, p.num_heads, p.granularity) for p in pats]
for r in range(2):
    print(f"256 handle tensors {med(handles):.3f} ms; 256 shape reads (3 ctypes calls each) {med(check):.3f} ms")
