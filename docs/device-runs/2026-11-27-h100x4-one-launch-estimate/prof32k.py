"""Where the mtrain-static forward of the training program goes at 32K (small model shapes:
8:2 heads, d 64, batch 2 x 32768, bf16), one layer: estimate (C parts), plan, forward, backward,
against SDPA (cuDNN) fwd+bwd; granularity 64 (the training arms') and 128; top-k budgets of
mtrain-static (TopK(30 + N/32, 100 + N/64)) and top-p 0.9 with caps N (mtrain-topp) and 8192."""

import statistics, sys, time, torch, mtrain
import torch.nn.functional as F
from mtrain import _core as C

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
B, N, H, KV, D = 2, int(sys.argv[2]) if len(sys.argv) > 2 else 32768, 8, 2, 64
torch.manual_seed(0)


def rnd(h):
    return torch.randn(B, N, h, D, device=dev, dtype=torch.bfloat16, requires_grad=True)


q, k, v = rnd(H), rnd(KV), rnd(KV)
do = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def t(fn, reps=4):
    ts = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:]) * 1e3, r


def sdpa():
    qq, kk, vv = (x.transpose(1, 2) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    o.backward(do.transpose(1, 2))


if dev.type == "cuda":
    ms, _ = t(sdpa)
    print(f"SDPA cuDNN fwd+bwd (B=2): {ms:.2f} ms", flush=True)
topk = mtrain.TopK(30 + round(N / 32), 100 + round(N / 64))
for g in (64, 128):
    for name, bud in (
        ("static", topk),
        ("top-p caps N", mtrain.TopP(0.9, 0.9, N, N)),
        ("top-p caps 8192", mtrain.TopP(0.9, 0.9, 8192, 8192)),
    ):
        qd, kd = q.detach(), k.detach()
        ms_est, plan = t(lambda: mtrain.estimate_pattern(qd, kd, bud, granularity=g))
        et = mtrain.last_estimate_times()
        ms_c, _ = t(
            lambda: C._estimate(
                plan._plan().ctx,
                C.decode_options(plan.options),
                qd.reshape(B * N, H, D),
                kd.reshape(B * N, KV, D),
                [N] * B,
                [N] * B,
                None,
            )
        )

        def fwd():
            return mtrain.attention(q, k, v, pattern=plan, granularity=g)

        ms_f, o = t(fwd)

        def fb():
            o = mtrain.attention(q, k, v, pattern=plan, granularity=g)
            o.backward(do)

        ms_fb, _ = t(fb)

        def online():
            o = mtrain.attention(q, k, v, budgets=bud, granularity=g)
            o.backward(do)

        ms_on, _ = t(online)
        dens = statistics.mean(p.density() for p in plan.patterns)
        print(
            f"G {g} {name}: density {dens:.3f}; estimate_pattern {ms_est:.2f} ms (C estimate of both "
            f"{ms_c:.2f}; last parts ms: "
            + ", ".join(f"{k2} {1e3 * v2:.2f}" for k2, v2 in et.items())
            + f"); fwd with plan {ms_f:.2f}; fwd+bwd with plan {ms_fb:.2f}; online (budgets=) fwd+bwd {ms_on:.2f}",
            flush=True,
        )
