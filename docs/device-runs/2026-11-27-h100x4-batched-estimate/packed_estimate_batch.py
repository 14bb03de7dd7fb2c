"""The packed batch's estimate, one call for the batch (mtrain_pattern_estimate_batch, what
mtrain.estimate_pattern runs since this commit) against one mtrain_pattern_estimate call per
document (what it ran before), for 1 to 256 packed documents of 65536 tokens at the training
program's mini shapes (4:2 heads, d 64, bf16), top-k and top-p budgets; then the whole
mtrain.estimate_pattern (estimate, plan) and the attention with its plan. Medians of 5 warm."""

import ctypes
import json
import statistics
import sys
import time

import torch

import mtrain
from mtrain import _core as C
from mtrain import _lib as L

dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
T, H, KV, D, G = int(sys.argv[3]) if len(sys.argv) > 3 else 65536, 4, 2, 64, 128
torch.manual_seed(0)
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)


def per_document(ctx: C.Context, opts: C.Options, lens: list[int]) -> list[C.Pattern]:
    """The loop the package ran before: one mtrain_pattern_estimate per document."""
    budgets = C.head_budgets(json.loads(opts.budgets), H)
    eo = L.EstimateOptions(last_q=opts.last_q, num_sinks=opts.num_sinks, window=opts.window)
    out, row = [], 0
    ctx.bind_stream()
    for n in lens:
        qd, kd = C.descriptor(q, (row, row + n)), C.descriptor(k, (row, row + n))
        res = ctypes.c_void_p()
        L.check(
            L.lib().pattern_estimate(
                ctx.ptr,
                ctypes.byref(qd),
                ctypes.byref(kd),
                budgets,
                ctypes.byref(eo),
                ctypes.byref(res),
            )
        )
        out.append(C.Pattern(int(res.value or 0)))
        row += n
    return out


def timed(fn, reps=6):
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) * 1e3, r


rows = []
print(
    "| budgets | docs | per-document calls ms | one batch call ms | saved per document ms | "
    "estimate_pattern (with plan) ms | attention fwd ms |"
)
print("|---|---|---|---|---|---|---|")
for name, budget in (("top-k 94/132", mtrain.TopK(94, 132)), ("top-p 0.9", mtrain.TopP(0.9, 0.9))):
    for docs in (1, 16, 64, 256):
        cu = torch.tensor([round(i * T / docs) for i in range(docs + 1)], dtype=torch.int32)
        lens = (cu[1:] - cu[:-1]).tolist()
        plan = mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, granularity=G)
        ctx, opts = plan._plan().ctx, C.decode_options(plan.options)
        t_loop, pats_loop = timed(lambda: per_document(ctx, opts, lens))
        t_batch, pats_batch = timed(lambda: C._estimate(ctx, opts, q, k, lens, lens, None))
        same = all(a.head(h) == b.head(h) for a, b in zip(pats_loop, pats_batch) for h in range(H))
        t_est, plan = timed(
            lambda: mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, granularity=G)
        )
        t_att, _ = timed(lambda: mtrain.attention(q, k, v, plan, cu_seqlens=cu, granularity=G))
        saved = (t_loop - t_batch) / docs
        rows.append(
            dict(
                budgets=name,
                docs=docs,
                per_document_ms=t_loop,
                batch_ms=t_batch,
                estimate_pattern_ms=t_est,
                attention_fwd_ms=t_att,
                same=same,
            )
        )
        print(
            f"| {name} | {docs} | {t_loop:.2f} | {t_batch:.2f} | {saved:.3f} | {t_est:.2f} | "
            f"{t_att:.2f} |{'' if same else ' PATTERNS DIFFER'}",
            flush=True,
        )
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "packed-estimate.json", "w"), indent=1)
