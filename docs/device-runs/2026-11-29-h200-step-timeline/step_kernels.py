"""Kernel time per training step by kind, from the call's timelines (trace_step.py's
trace-ARM-detD.trace.json.gz): the steps between the 4th and the 12th optimizer step (8 steps),
each kernel's CUDA time summed and divided by 8, grouped. Usage: python3 step_kernels.py DIR"""

import collections
import gzip
import json
import sys

GROUPS = [
    ("attention forward", ("wgmma_fwd", "mma2_fwd", "sdpa_sm90_flash_fprop", "flash_fprop")),
    ("attention backward dK/dV (or fused)", ("wgmma_bwd", "mma2_bwd_kv", "flash_bprop")),
    ("attention backward dQ", ("bwd_dq",)),
    ("split schedule + reduce", ("kv_split",)),
    ("estimate scores", ("scores_batch",)),
    ("selection", ("select_batch",)),
    ("plan on the device", ("plan::",)),
    ("mtrain conversions", ("convert_kernel",)),
]


def group(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "rest of the model (torch)"


d = sys.argv[1]
for arm in (
    "dense-det1",
    "mtrain-static-det1",
    "mtrain-static-det0",
    "mtrain-topp-det1",
    "mtrain-topp-det0",
):
    ev = json.load(gzip.open(f"{d}/trace-{arm}.trace.json.gz", "rt"))["traceEvents"]
    opt = sorted(
        (
            e
            for e in ev
            if e["name"].startswith("Optimizer.step#") and e.get("cat") != "gpu_user_annotation"
        ),
        key=lambda e: e["ts"],
    )
    ends = [e["ts"] + e["dur"] for e in opt]
    a, b, n = ends[3], ends[11], 8
    agg: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and a <= e["ts"] < b:
            g = group(e["name"])
            agg[g] += e["dur"] / n / 1e3
            calls[g] += 1
    att = sum(v for k, v in agg.items() if not k.startswith("rest"))
    print(
        f"== {arm}: wall {(b - a) / n / 1e3:.1f} ms a step; kernels {sum(agg.values()):.1f} ms, of them attention {att:.1f} ms"
    )
    for g, _ in GROUPS + [("rest of the model (torch)", ())]:
        if g in agg:
            print(f"   {g:40s} {agg[g]:7.2f} ms  ({calls[g] / n:.0f} launches a step)")
