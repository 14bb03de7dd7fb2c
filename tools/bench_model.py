"""bench_model.py: the attention of a whole model's training step on one GPU, through torch.

For every layer of a budget file (Qwen2.5-3B: 36 layers, 16:2 heads, d 128), at N tokens of the
library's structured inputs (RoPE'd vertical-slash structure, mtrain_generate_structured; one
input set for every layer, so the layers differ by their budgets only), times per layer, warm
(after --warmup steps) and per step, as a training step pays them:

  estimate   mtrain.estimate_pattern(q, k, budgets, layer): scores, selection, plan (host clock,
             with a synchronisation before and after: the call itself only queues on one GPU);
  fwd        mtrain.attention(q, k, v, pattern=plan) (CUDA events);
  fwd+bwd    the same with the backward through autograd (CUDA events);
  step       (--steps) the training step's view: estimate, forward and backward queued back to
             back and timed by CUDA events around all three, with the plan built on the GPU
             (mtrain_plan_create_estimated: no host round trip) and, in the same run, with
             MTRAIN_PLAN_ON_HOST=1 (the selection copied back and the plan built on the host);

and once (the shapes are the same for every layer): dense causal attention by mtrain (ours) and
by torch SDPA with the cuDNN backend (the strongest dense peer measured in docs/PERFORMANCE.md),
forward and forward+backward. Prints a table per layer and the model's totals: sparse step
(estimate + fwd+bwd summed over the layers) against 36 x dense ours and 36 x dense cuDNN, and
the ceiling the pair counts allow (dense pairs / computed pairs, summed over the layers: the
speed-up if the sparse kernels ran at the dense kernel's rate with nothing else to pay).

With --dense-above (default auto) every layer is also timed as mtrain.attention(...,
dense_above=...) runs it: torch's dense attention where the estimated pattern is denser than
the threshold (mtrain.fallback), the sparse kernels elsewhere; the totals add that step.

usage: python tools/bench_model.py [--budgets FILE] [--seq-len 131072] [--layers all|0,3,5-7]
       [--reps 2] [--warmup 1] [--kv-heads 2] [--head-dim 128] [--deterministic]
       [--dense-above auto|none|X] [--dense-recheck R] [--steps] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import mtrain
from mtrain import _lib as L
from mtrain.fallback import resolve_dense_above


def structured_inputs(n: int, hq: int, hkv: int, d: int) -> list[torch.Tensor]:
    """q, k, v of mtrain_generate_structured (defaults of MTRAIN_STRUCTURED_INIT), bf16, on the
    GPU, and a dout of normal noise."""
    q = torch.empty(n, hq, d, dtype=torch.bfloat16)
    k = torch.empty(n, hkv, d, dtype=torch.bfloat16)
    v = torch.empty(n, hkv, d, dtype=torch.bfloat16)
    opts = L.StructuredOptions(1, 10000.0, 2.0, 4, 16, 4.0)
    fn = L.lib().dll.mtrain_generate_structured
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4
    ts = [L.Tensor(t.data_ptr(), L.BF16, 3, (ctypes.c_int64 * 4)(*t.shape, 0)) for t in (q, k, v)]
    L.check(fn(ctypes.byref(opts), *(ctypes.byref(t) for t in ts)), "structured inputs")
    g = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(n, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    return [q.cuda(), k.cuda(), v.cuda(), do]


def event_ms(fn: Any, reps: int, warmup: int) -> float:
    """Median milliseconds of fn() over reps runs after warmup runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def parse_layers(text: str, count: int) -> list[int]:
    if text == "all":
        return list(range(count))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    bad = [x for x in out if not 0 <= x < count]
    if bad:
        raise SystemExit(f"bench_model: layers {bad} outside the file's 0..{count - 1}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--budgets", default="data/budgets/Qwen2.5_3B_kv_out_v32_fit_o_best_pattern.json"
    )
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--layers", default="all")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="mtrain's deterministic backward (default: the fused one, as cuDNN's)",
    )
    ap.add_argument(
        "--dense-above",
        default="auto",
        help="also time the step with mtrain's dense fallback at this density ('auto': the "
        "device's measured threshold; 'none': skip)",
    )
    ap.add_argument(
        "--dense-recheck",
        type=int,
        default=1,
        help="R > 1: also time R successive training calls per layer through "
        "mtrain.attention(budgets=, dense_above=, dense_recheck=R) (estimates included)",
    )
    ap.add_argument(
        "--steps",
        action="store_true",
        help="also time estimate + fwd + bwd queued back to back per layer, with the plan built "
        "on the GPU and on the host (MTRAIN_PLAN_ON_HOST=1)",
    )
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    with open(a.budgets) as f:
        doc = json.load(f)
    n_layers = len(doc) if isinstance(doc, list) else len(doc.get("layers", doc))
    layers = parse_layers(a.layers, n_layers)
    n, hkv, d = a.seq_len, a.kv_heads, a.head_dim
    first = doc[0] if isinstance(doc, list) else None
    hq = len(first) if isinstance(first, (list, dict)) else 16
    det = a.deterministic
    fallback: float | str | None = None
    if a.dense_above != "none":
        fallback = "auto" if a.dense_above == "auto" else float(a.dense_above)
    threshold = resolve_dense_above(fallback, torch.device("cuda"))
    q, k, v, do = structured_inputs(n, hq, hkv, d)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    causal_pairs = n * (n + 1) // 2 * hq

    # dense, once: mtrain (ours) and SDPA cuDNN
    def ours_fwd() -> None:
        with torch.no_grad():
            mtrain.attention(q, k, v, deterministic=det)

    def ours_fb() -> None:
        mtrain.attention(qg, kg, vg, deterministic=det).backward(do)

    qt, kt, vt, dot = (t.transpose(0, 1).unsqueeze(0) for t in (qg, kg, vg, do))
    qt, kt, vt = (t.detach().requires_grad_(True) for t in (qt, kt, vt))

    def sdpa() -> Any:  # a fresh context manager per use
        return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)

    def cudnn_fwd() -> None:
        with torch.no_grad(), sdpa():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    def cudnn_fb() -> None:
        with sdpa():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).backward(
                dot
            )

    dense = {
        "ours_fwd_ms": event_ms(ours_fwd, a.reps, a.warmup),
        "ours_fwdbwd_ms": event_ms(ours_fb, a.reps, a.warmup),
        "cudnn_fwd_ms": event_ms(cudnn_fwd, a.reps, a.warmup),
        "cudnn_fwdbwd_ms": event_ms(cudnn_fb, a.reps, a.warmup),
    }
    rows = []
    for layer in layers:
        plans: list[Any] = []

        def estimate(layer: int = layer, plans: list[Any] = plans) -> None:
            plans.append(mtrain.estimate_pattern(q, k, a.budgets, layer, deterministic=det))

        est = []
        for i in range(a.warmup + a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            estimate()
            torch.cuda.synchronize()
            if i >= a.warmup:
                est.append(1e3 * (time.perf_counter() - t0))
        plan = plans[-1]

        def fwd(plan: Any = plan) -> None:
            with torch.no_grad():
                mtrain.attention(q, k, v, pattern=plan, deterministic=det)

        def fb(plan: Any = plan) -> None:
            mtrain.attention(qg, kg, vg, pattern=plan, deterministic=det).backward(do)

        def hybrid_fb(plan: Any = plan) -> None:
            o = mtrain.attention(qg, kg, vg, pattern=plan, deterministic=det, dense_above=threshold)
            o.backward(do)

        row = {
            "layer": layer,
            "density": plan.computed_pairs / causal_pairs,
            "computed_pairs": plan.computed_pairs,
            "estimate_ms": statistics.median(est),
            "fwd_ms": event_ms(fwd, a.reps, a.warmup),
            "fwdbwd_ms": event_ms(fb, a.reps, a.warmup),
        }
        line = (
            f"layer {layer:3d} density {row['density']:.3f} estimate {row['estimate_ms']:7.1f} ms "
            f"fwd {row['fwd_ms']:7.1f} ms fwd+bwd {row['fwdbwd_ms']:7.1f} ms"
        )
        row["plan_on_device"] = bool(plan._plan().on_device)
        if a.steps:

            def step(layer: int = layer) -> None:
                p = mtrain.estimate_pattern(q, k, a.budgets, layer, deterministic=det)
                mtrain.attention(qg, kg, vg, pattern=p, deterministic=det).backward(do)

            row["step_ms"] = event_ms(step, a.reps, a.warmup)
            os.environ["MTRAIN_PLAN_ON_HOST"] = "1"
            try:
                row["step_host_plan_ms"] = event_ms(step, a.reps, a.warmup)
            finally:
                del os.environ["MTRAIN_PLAN_ON_HOST"]
            line += (
                f" | step (estimate+fwd+bwd) {row['step_ms']:7.1f} ms, plan on the host "
                f"{row['step_host_plan_ms']:7.1f} ms"
            )
        if threshold is not None:
            row["dense_fallback"] = row["density"] > threshold
            row["hybrid_fwdbwd_ms"] = event_ms(hybrid_fb, a.reps, a.warmup)
            line += (
                f" | with fallback ({'dense' if row['dense_fallback'] else 'sparse'}) fwd+bwd "
                f"{row['hybrid_fwdbwd_ms']:7.1f} ms"
            )
        if threshold is not None and a.dense_recheck > 1:

            def call(layer: int = layer) -> None:
                o = mtrain.attention(
                    qg, kg, vg, budgets=a.budgets, layer=layer, deterministic=det,
                    dense_above=threshold, dense_recheck=a.dense_recheck,
                )  # fmt: skip
                o.backward(do)

            mtrain.dense_fallback_counts(reset=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.dense_recheck):
                call()
            torch.cuda.synchronize()
            row["recheck_call_ms"] = 1e3 * (time.perf_counter() - t0) / a.dense_recheck
            row["recheck_counts"] = mtrain.dense_fallback_counts()
            line += (
                f" | {a.dense_recheck} calls with recheck: {row['recheck_call_ms']:7.1f} ms each"
            )
        rows.append(row)
        print(line, flush=True)
    mtrain.synchronize()
    nl = len(rows)
    sparse_step = sum(r["estimate_ms"] + r["fwdbwd_ms"] for r in rows)
    sparse_attn = sum(r["fwdbwd_ms"] for r in rows)
    estimate_total = sum(r["estimate_ms"] for r in rows)
    ceiling = nl * causal_pairs / sum(r["computed_pairs"] for r in rows)
    totals = {
        "layers": nl,
        "sparse_step_ms": sparse_step,
        "sparse_fwdbwd_ms": sparse_attn,
        "estimate_ms": estimate_total,
        "estimate_share_of_sparse_fwdbwd": estimate_total / sparse_attn,
        "dense_ours_ms": nl * dense["ours_fwdbwd_ms"],
        "dense_cudnn_ms": nl * dense["cudnn_fwdbwd_ms"],
        "speedup_vs_dense_ours": nl * dense["ours_fwdbwd_ms"] / sparse_step,
        "speedup_vs_dense_cudnn": nl * dense["cudnn_fwdbwd_ms"] / sparse_step,
        "ceiling_from_pairs": ceiling,
    }
    if a.steps:
        step_dev = sum(r["step_ms"] for r in rows)
        step_host = sum(r["step_host_plan_ms"] for r in rows)
        totals.update(
            {
                "step_ms": step_dev,
                "step_host_plan_ms": step_host,
                "plans_on_device": sum(1 for r in rows if r["plan_on_device"]),
                "step_estimate_share_of_sparse_fwdbwd": (step_dev - sparse_attn) / sparse_attn,
                "step_speedup_vs_dense_ours": nl * dense["ours_fwdbwd_ms"] / step_dev,
                "step_speedup_vs_dense_cudnn": nl * dense["cudnn_fwdbwd_ms"] / step_dev,
            }
        )
    if threshold is not None:
        hybrid = sum(r["estimate_ms"] + r["hybrid_fwdbwd_ms"] for r in rows)
        totals.update(
            {
                "dense_above": threshold,
                "dense_fallback_layers": sum(1 for r in rows if r["dense_fallback"]),
                "hybrid_step_ms": hybrid,
                "hybrid_speedup_vs_dense_ours": nl * dense["ours_fwdbwd_ms"] / hybrid,
                "hybrid_speedup_vs_dense_cudnn": nl * dense["cudnn_fwdbwd_ms"] / hybrid,
            }
        )
    dev = torch.cuda.get_device_name()
    print(
        f"\n{dev}, N={n}, {hq}:{hkv} heads, d {d}, bf16, causal, {nl} layers of {a.budgets}, "
        f"median of {a.reps} after {a.warmup} warm-up, backward "
        f"{'deterministic' if det else 'fused'}"
    )
    print(
        f"dense per layer: ours fwd {dense['ours_fwd_ms']:.1f} ms, fwd+bwd "
        f"{dense['ours_fwdbwd_ms']:.1f} ms; SDPA cuDNN fwd {dense['cudnn_fwd_ms']:.1f} ms, fwd+bwd "
        f"{dense['cudnn_fwdbwd_ms']:.1f} ms"
    )
    print(
        f"model: sparse step {sparse_step / 1e3:.2f} s (estimate {estimate_total / 1e3:.2f} s = "
        f"{100 * totals['estimate_share_of_sparse_fwdbwd']:.1f}% of the sparse fwd+bwd "
        f"{sparse_attn / 1e3:.2f} s); dense ours {totals['dense_ours_ms'] / 1e3:.2f} s, "
        f"cuDNN {totals['dense_cudnn_ms'] / 1e3:.2f} s"
    )
    print(
        f"speed-up: {totals['speedup_vs_dense_ours']:.2f}x over dense ours, "
        f"{totals['speedup_vs_dense_cudnn']:.2f}x over dense cuDNN; ceiling from the pair counts "
        f"{ceiling:.2f}x"
    )
    if a.steps:
        print(
            f"training-step view (estimate + fwd + bwd queued back to back, CUDA events): "
            f"{totals['step_ms'] / 1e3:.2f} s with the plans built on the GPU "
            f"({totals['plans_on_device']} of {nl} layers), "
            f"{totals['step_host_plan_ms'] / 1e3:.2f} s with them built on the host; "
            f"estimate + plan "
            f"{100 * totals['step_estimate_share_of_sparse_fwdbwd']:.1f}% of the sparse fwd+bwd; "
            f"{totals['step_speedup_vs_dense_ours']:.2f}x dense ours, "
            f"{totals['step_speedup_vs_dense_cudnn']:.2f}x dense cuDNN"
        )
    if threshold is not None and a.dense_recheck > 1:
        recheck = sum(r["recheck_call_ms"] for r in rows)
        totals.update(
            {
                "dense_recheck": a.dense_recheck,
                "recheck_step_ms": recheck,
                "recheck_speedup_vs_dense_ours": nl * dense["ours_fwdbwd_ms"] / recheck,
                "recheck_speedup_vs_dense_cudnn": nl * dense["cudnn_fwdbwd_ms"] / recheck,
            }
        )
        print(
            f"with the fallback and dense_recheck={a.dense_recheck} (estimates included, mean of "
            f"{a.dense_recheck} calls): step {recheck / 1e3:.2f} s: "
            f"{totals['recheck_speedup_vs_dense_ours']:.2f}x over dense ours, "
            f"{totals['recheck_speedup_vs_dense_cudnn']:.2f}x over dense cuDNN"
        )
    if threshold is not None:
        print(
            f"with the dense fallback above density {threshold}: "
            f"{totals['dense_fallback_layers']} of {nl} layers dense, step "
            f"{totals['hybrid_step_ms'] / 1e3:.2f} s: "
            f"{totals['hybrid_speedup_vs_dense_ours']:.2f}x over dense ours, "
            f"{totals['hybrid_speedup_vs_dense_cudnn']:.2f}x over dense cuDNN"
        )
    if a.json:
        out = {
            "device": dev,
            "torch": torch.__version__,
            "seq_len": n,
            "heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "budgets": a.budgets,
            "deterministic": det,
            "reps": a.reps,
            "warmup": a.warmup,
            "dense": dense,
            "layers": rows,
            "totals": totals,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
