"""bench_torch_op.py: mtrain through PyTorch on one GPU, against mtrain-bench-cuda's own timing.

Times ``mtrain.attention`` (forward, and forward+backward through autograd) on the
shapes of mtrain-bench-cuda (N tokens, 16:2 heads, d 128, bf16, causal, G 128): the dense
pattern and the vertical-slash pattern that mtrain-bench-cuda wrote with --pattern-out,
median of --reps runs after --warmup, CUDA events on the current stream. With --bench-json
(mtrain-bench-cuda --json of the same machine and call), prints the op's overhead over the
library called from C. Then the accuracy rule of the PyTorch integration: at N = 2048,
dense causal, bf16, mtrain's largest error against the float64 reference, beside torch's
own bf16 SDPA error on the same inputs. Last, whether a forward+backward can be captured
in a CUDA graph (it prints the outcome and the error message). Prints a table and, with
--json, writes the figures.

usage: python tools/bench_torch_op.py --pattern PATTERN.json [--bench-json BENCH.json]
       [--seq-len 32768] [--reps 10] [--warmup 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.nn.functional as F

import mtrain


def time_ms(fn: Any, reps: int, warmup: int) -> float:
    """Median milliseconds of fn(i) over reps runs after warmup runs (CUDA events)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(n, 16, 128), (n, 2, 128), (n, 2, 128), (n, 16, 128)]
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]


def time_pattern(pattern: Any, n: int, reps: int, warmup: int, sets: int) -> dict[str, float]:
    """Forward and forward+backward times; run i uses input set i % sets (two
    sets: as mtrain-bench-cuda, so that K and V are not in L2 from the run
    before; one set: every run on the same tensors)."""
    data = [inputs(n, 1 + s) for s in range(sets)]
    for q, k, v, _ in data:
        for t in (q, k, v):
            t.requires_grad_(True)

    def fwd(i: int) -> None:
        q, k, v, _ = data[i % sets]
        with torch.no_grad():
            mtrain.attention(q, k, v, pattern=pattern)

    def fwd_bwd(i: int) -> None:
        q, k, v, do = data[i % sets]
        out = mtrain.attention(q, k, v, pattern=pattern)
        torch.autograd.backward(out, do)

    return {"fwd_ms": time_ms(fwd, reps, warmup), "fwdbwd_ms": time_ms(fwd_bwd, reps, warmup)}


def accuracy(n: int = 2048) -> dict[str, float]:
    """Largest |error| of mtrain bf16 and torch SDPA bf16 against float64, dense causal."""
    q, k, v, _ = inputs(n, 7)
    ref = F.scaled_dot_product_attention(
        *(
            t.double().transpose(0, 1)
            for t in (q, k.repeat_interleave(8, 1), v.repeat_interleave(8, 1))
        ),
        is_causal=True,
    ).transpose(0, 1)
    sdpa = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k.repeat_interleave(8, 1), v.repeat_interleave(8, 1))),
        is_causal=True,
    ).transpose(0, 1)
    got = mtrain.attention(q, k, v, pattern=mtrain.dense_pattern(n, 16, 128))
    return {
        "mtrain_max_err": float((got.double() - ref).abs().max()),
        "sdpa_max_err": float((sdpa.double() - ref).abs().max()),
    }


def graph_capture(pattern: Any, n: int) -> str:
    q, k, v, do = inputs(n, 3)
    for t in (q, k, v):
        t.requires_grad_(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            out = mtrain.attention(q, k, v, pattern=pattern)  # warm-up outside the graph
            torch.autograd.backward(out, do)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mtrain.attention(q, k, v, pattern=pattern)
            torch.autograd.backward(out, do)
        graph.replay()
        torch.cuda.synchronize()
        return "captured and replayed"
    except Exception as e:  # the outcome is the report
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pattern",
        required=True,
        help="vertical-slash pattern JSON (mtrain-bench-cuda --pattern-out)",
    )
    ap.add_argument("--bench-json", help="mtrain-bench-cuda --json of the same call")
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    n = a.seq_len
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "seq_len": n,
    }
    patterns = {
        "dense": mtrain.dense_pattern(n, 16, 128),
        "vertical-slash": mtrain.load_pattern(a.pattern),
    }
    for name, p in patterns.items():
        results[name] = time_pattern(p, n, a.reps, a.warmup, 2)
        results[name + " (one input set)"] = time_pattern(p, n, a.reps, a.warmup, 1)
    results["accuracy_n2048"] = accuracy()
    results["graph_capture"] = graph_capture(patterns["vertical-slash"], n)
    bench: dict[str, Any] = {}
    if a.bench_json:
        with open(a.bench_json) as f:
            bench = json.load(f)
    print(f"mtrain through torch, {results['device']}, N={n}, 16:2 heads, d 128, bf16, causal")
    print(
        f"median of {a.reps} after {a.warmup} warm-up; C: mtrain-bench-cuda, variant 3; two "
        "input sets alternating as in mtrain-bench-cuda, and one set reused (K, V stay in L2)"
    )
    head = ["pattern", "fwd ms", "fwd+bwd ms", "C fwd ms", "C fwd+bwd", "over fwd", "fwd+bwd"]
    print(f"{head[0]:30s} " + " ".join(f"{h:>10s}" for h in head[1:]))
    for name in [x for p in patterns for x in (p, p + " (one input set)")]:
        r = results[name]
        c = next(
            (
                x
                for x in bench.get("results", [])
                if x.get("pattern") == name.split(" (")[0] and x.get("variant") == 3
            ),
            None,
        )
        line = f"{name:30s} {r['fwd_ms']:10.3f} {r['fwdbwd_ms']:10.3f}"
        if c:
            cf, cb = c["forward_ms"], c["forward_backward_ms"]
            r["c_fwd_ms"], r["c_fwdbwd_ms"] = cf, cb
            over = (100 * (r["fwd_ms"] / cf - 1), 100 * (r["fwdbwd_ms"] / cb - 1))
            line += f" {cf:10.3f} {cb:10.3f} {over[0]:+9.1f}% {over[1]:+9.1f}%"
        print(line)
    acc = results["accuracy_n2048"]
    print(
        f"accuracy at N=2048 (bf16, dense causal, largest |error| against float64): "
        f"mtrain {acc['mtrain_max_err']:.3g}, torch SDPA {acc['sdpa_max_err']:.3g}, "
        f"ratio {acc['mtrain_max_err'] / acc['sdpa_max_err']:.2f}"
    )
    print(f"CUDA graph capture of forward+backward: {results['graph_capture']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
