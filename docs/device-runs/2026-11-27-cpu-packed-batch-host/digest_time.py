"""The plan cache's content key of a packed batch: the former per-head Python
digest (blake2b over pattern_get_head views) against mtrain_pattern_digest (one
call). 65536 tokens as 16-256 documents, 4 heads, 4 diagonals and 94 verticals a head."""
import ctypes, hashlib, struct, time, statistics, torch
import mtrain
from mtrain import _core as C, _lib as L
def old_key(p):
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<qii", p.seq_len, p.num_heads, p.granularity))
    dp = ctypes.POINTER(ctypes.c_int32)(); vp = ctypes.POINTER(ctypes.c_int64)()
    nd, nv = ctypes.c_int32(), ctypes.c_int32()
    for head in range(p.num_heads):
        L.check(L.lib().pattern_get_head(p.ptr, head, ctypes.byref(dp), ctypes.byref(nd), ctypes.byref(vp), ctypes.byref(nv)))
        h.update(struct.pack("<ii", nd.value, nv.value))
        if nd.value: h.update(ctypes.string_at(dp, 4 * nd.value))
        if nv.value: h.update(ctypes.string_at(vp, 8 * nv.value))
    return h.digest()
def med(fn, reps=21):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
g = torch.Generator().manual_seed(0)
print("documents  per-head Python digest  mtrain_pattern_digest  speed-up")
for docs in (16, 64, 256):
    n = 65536 // docs
    pats = []
    for i in range(docs):
        heads = [(list(range(min(4, -(-n // 128)))), sorted(set(torch.randint(0, n, (min(94, n),), generator=g).tolist()))) for _ in range(4)]
        pats.append(C.vertical_slash_pattern(n, heads, 128))
    a = med(lambda: tuple(map(old_key, pats)))
    b = med(lambda: C._content_key(pats))
    print(f"{docs:9d}  {a:20.3f} ms  {b:19.3f} ms  {a / b:7.1f}x")
