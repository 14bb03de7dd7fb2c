"""bench_block_kernels.py: the attention kernels on block masks, per computed pair, against dense.

Issue 23 asks that block-sparse patterns run at 80% of the dense kernel's TFLOP/s per computed
block. On one GPU, shapes of the Qwen2.5-3B attention (16:2 heads, d 128; --head-dim 64 too),
bf16, causal, G 128, random N(0, 1) inputs (two sets used in turn), this times
``mtrain.attention`` (forward, and forward+backward through autograd; median of --reps after
--warmup, CUDA events) on:

- dense causal (ours), and torch SDPA (cuDNN, else flash) as the dense peer;
- random causal block masks keeping K key blocks in every query block (the diagonal and block 0
  forced, the rest drawn uniformly per head and query block, seed printed), and the same
  without block 0 forced ("no sink"): the per-row work is even, and without the sink no key
  block is listed by every query block, so the key-major backward's work is even too;
- the mask of a real selection on the timed inputs: mean-pooled gating (top-k 16) and the
  antidiagonal top-p 0.9 selection (``mtrain.select_blocks`` on the GPU).

Computed pairs are the patterns' allowed pairs (whole blocks, the diagonal block's causal
triangle: what the kernels compute), the rate is 4 d pairs / forward time and 3.5 times that
for forward+backward (SPEC.md section 6, as mtrain-bench-cuda counts), and the efficiency is a
mask's rate over dense ours' rate in the same run.

usage: python tools/bench_block_kernels.py [--seq-len 32768,131072] [--head-dim 128]
       [--keep 4,16,64] [--reps 10] [--warmup 3] [--queued] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.nn.functional as F

import mtrain

HQ, HKV, G = 16, 2, 128


CONFIG = {"queued": False}


def time_ms(fn: Any, reps: int, warmup: int) -> float:
    """Median milliseconds of fn(i) over reps runs after warmup runs (CUDA events). With
    CONFIG["queued"] (--queued), each run is queued behind a 100 ms sleep kernel so that the
    events time the device's work alone, not the host's work of the call (plan look-up,
    launches)."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if CONFIG["queued"]:
            torch.cuda._sleep(200_000_000)  # about 0.1 s at 1.98 GHz
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(n: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(n, HQ, d), (n, HKV, d), (n, HKV, d), (n, HQ, d)]
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]


def pairs_of(p: Any) -> int:
    """Allowed (= computed: whole blocks) pairs of a block-mask pattern, over its heads."""
    return sum(p.count_pairs(h) for h in range(p.num_heads))


def random_mask(n: int, keep: int, seed: int, sink: bool = True) -> torch.Tensor:
    """Every query block keeps min(keep, qb + 1) key blocks: the diagonal, block 0 (sink) and
    the rest drawn uniformly among the others. sink=False: block 0 is not forced, so no key
    block is listed by every query block (the key-major backward's items are then even)."""
    nb = -(-n // G)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(HQ, nb, nb, dtype=torch.bool)
    idx = torch.arange(nb)
    mask[:, idx, idx] = True
    first = 1
    if sink:
        mask[:, :, 0] = True
        first = 2
    for qb in range(first, nb):
        extra = min(keep, qb + 1) - first
        if extra <= 0:
            continue
        lo = first - 1  # candidates lo .. qb - 1
        r = torch.rand(HQ, qb - lo, generator=g).argsort(dim=1)[:, :extra] + lo
        mask[torch.arange(HQ)[:, None], qb, r] = True
    return mask.tril()


def peer_ms(n: int, d: int, reps: int, warmup: int, sets: list[list[torch.Tensor]]) -> dict:
    """torch SDPA dense causal (GQA expanded outside the timing), cuDNN first, then flash."""
    exp = [
        [t.transpose(0, 1).repeat_interleave(HQ // t.shape[1], 0).unsqueeze(0).detach()
         for t in s]
        for s in sets
    ]  # fmt: skip
    for s in exp:
        for t in s[:3]:
            t.requires_grad_(True)
    out: dict[str, Any] = {}
    for name, backend in (
        ("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    ):
        try:
            with torch.nn.attention.sdpa_kernel(backend):

                def fwd(i: int) -> None:
                    q, k, v, _ = exp[i % len(exp)]
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def fb(i: int) -> None:
                    q, k, v, do = exp[i % len(exp)]
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    torch.autograd.backward(o, do)

                out[name] = {"fwd_ms": time_ms(fwd, reps, warmup), "fwdbwd_ms": time_ms(fb, reps,
                             warmup)}  # fmt: skip
        except Exception as e:  # the peer's absence is reported, not hidden
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def run_length(n: int, d: int, keeps: list[int], reps: int, warmup: int, seed: int) -> dict:
    sets = [inputs(n, d, 1 + s) for s in range(2)]
    for s in sets:
        for t in s[:3]:
            t.requires_grad_(True)

    def timed(pattern: Any) -> dict[str, float]:
        def fwd(i: int) -> None:
            q, k, v, _ = sets[i % 2]
            with torch.no_grad():
                mtrain.attention(q, k, v, pattern=pattern)

        def fb(i: int) -> None:
            q, k, v, do = sets[i % 2]
            out = mtrain.attention(q, k, v, pattern=pattern)
            torch.autograd.backward(out, do)

        return {"fwd_ms": time_ms(fwd, reps, warmup), "fwdbwd_ms": time_ms(fb, reps, warmup)}

    dense_pairs = HQ * n * (n + 1) // 2
    rows: list[dict[str, Any]] = []
    dense = timed(mtrain.dense_pattern(n, HQ, G))
    rows.append({"pattern": "dense", "pairs": dense_pairs, **dense})
    for keep in keeps:
        for sink in (True, False):
            mask = random_mask(n, keep, seed + keep, sink)
            p = mtrain.block_mask_pattern(mask, n, G)
            label = f"random keep {keep}" + ("" if sink else " no sink")
            rows.append({"pattern": label, "pairs": pairs_of(p), **timed(p)})
    q, k = sets[0][0].detach(), sets[0][1].detach()
    for label, kw in (
        ("meanpool top-k 16", {"method": "meanpool", "top_k": 16}),
        ("antidiag top-p 0.9", {"method": "antidiag", "top_p": 0.9}),
    ):
        try:
            (p,) = mtrain.select_blocks(q, k, granularity=G, **kw)
            rows.append({"pattern": label, "pairs": pairs_of(p), **timed(p)})
        except Exception as e:
            rows.append({"pattern": label, "error": f"{type(e).__name__}: {e}"[:300]})
    flop = 4 * d
    for r in rows:
        if "fwd_ms" in r:
            r["density"] = r["pairs"] / dense_pairs
            r["fwd_tflops"] = flop * r["pairs"] / r["fwd_ms"] / 1e9
            r["fwdbwd_tflops"] = 3.5 * flop * r["pairs"] / r["fwdbwd_ms"] / 1e9
            r["fwd_eff"] = r["fwd_tflops"] / rows[0]["fwd_tflops"]
            r["fwdbwd_eff"] = r["fwdbwd_tflops"] / rows[0]["fwdbwd_tflops"]
    peers = peer_ms(n, d, reps, warmup, sets)
    for v in peers.values():
        if "fwd_ms" in v:
            v["fwd_tflops"] = flop * dense_pairs / v["fwd_ms"] / 1e9
            v["fwdbwd_tflops"] = 3.5 * flop * dense_pairs / v["fwdbwd_ms"] / 1e9
    return {"seq_len": n, "head_dim": d, "rows": rows, "peers": peers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", default="32768,131072")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--keep", default="4,16,64")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument(
        "--queued", action="store_true", help="time each run behind a sleep kernel (device only)"
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    CONFIG["queued"] = a.queued
    if not torch.cuda.is_available():
        raise SystemExit("bench_block_kernels: needs a CUDA device")
    keeps = [int(x) for x in a.keep.split(",") if x]
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "seed": a.seed,
        "queued": a.queued,
        "runs": [],
    }
    print(
        f"device {res['device']}; torch {res['torch']}; mask seed {a.seed} (+ keep); "
        f"{'device time (queued behind a sleep)' if a.queued else 'time of the call'}"
    )
    for n in (int(x) for x in a.seq_len.split(",") if x):
        r = run_length(n, a.head_dim, keeps, a.reps, a.warmup, a.seed)
        res["runs"].append(r)
        print(f"\nN {n}, {HQ}:{HKV} heads, d {a.head_dim}, bf16, causal, G {G}")
        print("| pattern | density | fwd ms | fwd TFLOP/s | vs dense | fwd+bwd ms | "
              "fwd+bwd TFLOP/s | vs dense |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for row in r["rows"]:
            if "error" in row:
                print(f"| {row['pattern']} | {row['error']} |")
                continue
            print(
                f"| {row['pattern']} | {row['density']:.4f} | {row['fwd_ms']:.3f} | "
                f"{row['fwd_tflops']:.0f} | {row['fwd_eff']:.0%} | {row['fwdbwd_ms']:.3f} | "
                f"{row['fwdbwd_tflops']:.0f} | {row['fwdbwd_eff']:.0%} |"
            )
        for name, v in r["peers"].items():
            if "error" in v:
                print(f"| SDPA {name} | {v['error']} |")
            else:
                print(
                    f"| SDPA {name} (dense) | 1 | {v['fwd_ms']:.3f} | {v['fwd_tflops']:.0f} | | "
                    f"{v['fwdbwd_ms']:.3f} | {v['fwdbwd_tflops']:.0f} | |"
                )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
