"""Where the training step's wall time goes, from a torch.profiler timeline (chrome trace) of a
few steps of the training program at 32K: per step the wall time, the GPU's busy time (the union
of its kernels, copies and sets), its idle time, the kernel time of the attention and of the
rest, the host's synchronisations (which CPU op waited) and the largest idle gaps with the host
op that ran during each. From the repository root, MTRAIN_LIBRARY set, PYTHONPATH=python:.:

  python3 docs/device-runs/2026-11-29-h200-step-timeline/trace_step.py ARM WEIGHTS STEPS DETERMINISTIC OUT_PREFIX [extra training options]
"""

import bisect
import gzip
import json
import statistics
import sys

from torch.profiler import ProfilerActivity, profile

from examples.train.train import main

arm, weights, steps, det, prefix = sys.argv[1:6]
extra = sys.argv[6:]
COMMON = (
    "--size mini --task mix --num-keys 32 --num-values 32 --num-filler 256 --mqar-pairs 4"
    " --mqar-queries 24 --passkey-digits 5 --eval-seqs 2 --eval-batch 2 --seed 0 --data-seed 1"
    " --seq-len 32768 --batch 2 --lr 1e-3 --warmup 20 --eval-every 100000 --probe-every 100000"
)
args = COMMON.split() + ["--arm", arm, "--steps", steps, "--out", prefix + ".json"]
args += ["--deterministic", det] + (["--init-from", weights] if weights != "-" else [])
if arm == "mtrain-topp":
    args += ["--topp-forced", "1"]
args += extra
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    main(args)
trace = prefix + ".trace.json"
prof.export_chrome_trace(trace)
ev = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
with gzip.open(trace + ".gz", "wt") as f:
    json.dump({"traceEvents": ev}, f)

ATTN = (
    "wgmma",
    "mma2",
    "scores_batch",
    "select_batch",
    "plan::",
    "convert_kernel",
    "cudnn",
    "fmha",
    "flash",
    "attn",
    "sel::",
    "estimate",
    "rowstat",
    "gather",
)
gpu = sorted(
    (e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
)
cpu = [e for e in ev if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
opt = sorted(
    (
        e
        for e in ev
        if e["name"].startswith("Optimizer.step#") and e.get("cat") != "gpu_user_annotation"
    ),
    key=lambda e: e["ts"],
)
ends = [e["ts"] + e["dur"] for e in opt]
print(f"{arm} det {det}: {len(ends)} optimizer steps, {len(gpu)} GPU events")
starts = [g["ts"] for g in gpu]


def busy(a: float, b: float) -> tuple[float, float, float, list[tuple[float, float]]]:
    """GPU busy time in [a, b], attention-kernel time, other-kernel time, idle gaps."""
    i = bisect.bisect_left(starts, a - 1e6)
    t, cur_s, cur_e, at, ot, gaps = 0.0, None, None, 0.0, 0.0, []
    last = a
    for g in gpu[i:]:
        s, e = max(g["ts"], a), min(g["ts"] + g["dur"], b)
        if g["ts"] > b:
            break
        if e <= s:
            continue
        if any(k in g["name"] for k in ATTN):
            at += e - s
        else:
            ot += e - s
        if s > last:
            gaps.append((last, s))
        if e > last:
            t += e - max(s, last)
            last = e
    if b > last:
        gaps.append((last, b))
    return t, at, ot, gaps


top_cpu = sorted(cpu, key=lambda e: e["ts"])
# the outermost host ops of each thread (not inside another op of the same thread)
outermost: list[dict] = []
_end: dict[object, float] = {}
for e in top_cpu:
    if e.get("cat") != "cpu_op":
        continue
    if e["ts"] >= _end.get(e.get("tid"), -1.0):
        outermost.append(e)
        _end[e.get("tid")] = e["ts"] + e["dur"]


def host_during(a: float, b: float) -> str:
    """The outermost host ops overlapping [a, b] most, with their overlap."""
    over: dict[str, float] = {}
    for e in outermost + [c for c in top_cpu if c.get("cat") == "cuda_runtime"]:
        s, t = max(e["ts"], a), min(e["ts"] + e["dur"], b)
        if t > s:
            over[e["name"][:50]] = over.get(e["name"][:50], 0.0) + (t - s)
    best = sorted(over.items(), key=lambda x: -x[1])[:4]
    return "; ".join(f"{n} {v / 1e3:.2f} ms" for n, v in best)


SYNC = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMalloc",
    "cudaFree",
    "cudaHostAlloc",
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
)
rows = []
for k in range(3, len(ends)):
    a, b = ends[k - 1], ends[k]
    t, at, ot, gaps = busy(a, b)
    calls: dict[str, list[float]] = {}
    for e in cpu:
        if e.get("cat") == "cuda_runtime" and a <= e["ts"] < b:
            n = e["name"]
            calls.setdefault(n, []).append(e["dur"])
    host = sum(max(0.0, min(e["ts"] + e["dur"], b) - max(e["ts"], a)) for e in outermost)
    rows.append((k, (b - a) / 1e3, t / 1e3, at / 1e3, ot / 1e3, gaps, calls, host / 1e3))
    print(
        f"step {k}: wall {(b - a) / 1e3:.1f} ms, GPU busy {t / 1e3:.1f} ms "
        f"({t / (b - a):.0%}), attention kernels {at / 1e3:.1f} ms, other {ot / 1e3:.1f} ms, "
        f"idle {(b - a - t) / 1e3:.1f} ms in {len(gaps)} gaps; host ops {host / 1e3:.1f} ms"
    )
    sync = {n: (len(v), sum(v) / 1e3) for n, v in calls.items()}
    print(
        "  runtime calls: "
        + ", ".join(
            f"{n} {c}x {s:.1f} ms" for n, (c, s) in sorted(sync.items(), key=lambda x: -x[1][1])[:8]
        )
    )
    for ga, gb in sorted(gaps, key=lambda g: g[0] - g[1])[:6]:
        print(f"  gap {(gb - ga) / 1e3:.2f} ms at +{(ga - a) / 1e3:.1f} ms: {host_during(ga, gb)}")
    for e in cpu:
        if e.get("cat") == "cuda_runtime" and a <= e["ts"] < b and "Synchronize" in e["name"]:
            outer = [
                c
                for c in cpu
                if c.get("cat") == "cpu_op"
                and c["ts"] <= e["ts"]
                and c["ts"] + c["dur"] >= e["ts"] + e["dur"]
            ]
            outer.sort(key=lambda c: c["ts"])
            chain = " > ".join(c["name"][:40] for c in outer[:4])
            print(
                f"  sync {e['name']} {e['dur'] / 1e3:.2f} ms at +{(e['ts'] - a) / 1e3:.1f} ms in: {chain}"
            )
med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
summary = {
    "arm": arm,
    "deterministic": int(det),
    "steps_measured": len(rows),
    "wall_ms": med(1),
    "gpu_busy_ms": med(2),
    "attention_kernels_ms": med(3),
    "other_kernels_ms": med(4),
    "host_ops_ms": med(7),
}
print("SUMMARY " + json.dumps(summary))
json.dump(summary, open(prefix + ".summary.json", "w"))
