"""A packed batch's training-step attention on one GPU with the plan built on the device
(mtrain_plan_create_estimated) and on the host (MTRAIN_PLAN_ON_HOST=1), in one process:
65536 tokens as 1, 16, 64 and 256 documents, 4:2 heads of d 64, bf16, granularity 128, top-k
94/132 (the shapes of docs/PERFORMANCE.md's packed-batch tables). Per configuration, medians of
7 after 2 warm-up: 'call' the host time of mtrain.estimate_pattern alone (device plan: it only
queues), 'step' CUDA events around estimate + forward + backward queued back to back.
Usage: MTRAIN_LIBRARY=... PYTHONPATH=python python3 packed_plan.py OUT.json"""

import json
import os
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
v = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16)
do = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
budget = mtrain.TopK(94, 132)


def measure(cu: torch.Tensor | None) -> dict[str, float]:
    calls, steps = [], []
    for i in range(9):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan = mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, granularity=G)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        p = mtrain.estimate_pattern(q, k, budget, cu_seqlens=cu, granularity=G)
        mtrain.attention(qg, kg, vg, pattern=p, cu_seqlens=cu).backward(do)
        end.record()
        end.synchronize()
        if i >= 2:
            calls.append(1e3 * (t1 - t0))
            steps.append(start.elapsed_time(end))
        del plan, p
    return {"call_ms": statistics.median(calls), "step_ms": statistics.median(steps)}


rows = []
for docs in (1, 16, 64, 256):
    cu = None if docs == 1 else torch.tensor(
        [round(i * T / docs) for i in range(docs + 1)], dtype=torch.int32)
    row = {"documents": docs}
    for where in ("device", "host"):
        if where == "host":
            os.environ["MTRAIN_PLAN_ON_HOST"] = "1"
        m = measure(cu)
        os.environ.pop("MTRAIN_PLAN_ON_HOST", None)
        row.update({f"{where}_{key}": val for key, val in m.items()})
    rows.append(row)
    print(f"{docs:4d} documents: estimate_pattern call {row['device_call_ms']:.3f} ms (plan on the "
          f"device) / {row['host_call_ms']:.3f} ms (host); step {row['device_step_ms']:.3f} / "
          f"{row['host_step_ms']:.3f} ms", flush=True)
with open(sys.argv[1], "w") as f:
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
