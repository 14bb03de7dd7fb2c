"""Recall against density on the attention of a trained model (docs/PATTERNS.md, "Recall against
density on a trained model"): the program's model with weights from --init-from runs its
evaluation sequences (dense attention, no gradient), every layer's post-RoPE q and k are captured,
and on each (sequence, layer) every block selection (precise with the dense LSE, antidiagonal,
mean-pooled; top-p and top-k) and the vertical-slash estimate (top-k budgets) selects a pattern;
its density (computed pairs over causal pairs) and its recall (the share of the dense causal
softmax mass inside it, every query row, float64) are averaged over sequences and layers.

    python -m examples.train.curves --init-from model.pt --size tiny --task passkey \\
        --seq-len 1024 --granularity 64 --sequences 8 --out curves.json

The same budgets as docs/PATTERNS.md's table on structured inputs (`mtrain-block-curves
recall`), at the model's length."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import mtrain

from . import model as M
from .arms import Arm, Budget
from .probe import CAPTURE
from .tasks import Vocab, batch, make_task

TOP_P = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
TOP_K = (1, 2, 4, 8)
VS = ((32, 32), (64, 64), (64, 128), (128, 128), (128, 192), (256, 256))  # (v, s) at N = 2048


def recall(q: torch.Tensor, k: torch.Tensor, pattern: Any, scale: float) -> float:
    """The share of the dense causal softmax mass inside `pattern`, over every query row and
    head, in float64 (q [N, Hq, d], k [N, Hkv, d])."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    g = pattern.granularity
    i = torch.arange(n)
    qb, kb = (i // g)[:, None], (i // g)[None, :]
    causal = i[None, :] <= i[:, None]
    total = 0.0
    for h in range(hq):
        if pattern.is_block_mask(h):
            allowed = pattern.block_mask(h)[qb, kb] & (qb >= kb)
        else:
            diagonals, verticals = pattern.head(h)
            on = torch.zeros(pattern.num_blocks + 1, dtype=torch.bool)
            on[torch.tensor(diagonals, dtype=torch.long)] = True
            allowed = on[(qb - kb).clamp(min=0, max=pattern.num_blocks)] & (qb >= kb)
            if verticals:
                vert = torch.zeros(n, dtype=torch.bool)
                vert[torch.tensor(verticals, dtype=torch.long)] = True
                allowed = allowed | (vert[None, :] & (kb < qb))
        s = (q[:, h].double() @ k[:, h // group].double().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        total += float((p * (allowed & causal)).sum(-1).mean())
    return total / hq


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[N, Hq] float64 log-sum-exp of the dense causal scores (the precise search's input)."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.empty(n, hq, dtype=torch.float64)
    for h in range(hq):
        s = (q[:, h].double() @ k[:, h // group].double().T) * scale
        out[:, h] = torch.logsumexp(s.masked_fill(~causal, float("-inf")), dim=-1)
    return out


def budgets(n: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, budget label, options) for every point of the table; vertical-slash sizes are
    docs/PATTERNS.md's at 2048 tokens, scaled to n."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for m in ("precise", "antidiag"):
        out += [(m, f"top-p {p:.2f}", {"method": m, "top_p": p}) for p in TOP_P]
    for m in ("precise", "antidiag", "meanpool"):
        out += [(m, f"top-k {t}", {"method": m, "top_k": t}) for t in TOP_K]
    for v, s in VS:
        vv, ss = max(1, v * n // 2048), max(1, s * n // 2048)
        out.append(("vertical-slash", f"v {vv}, s {ss}", {"v": vv, "s": ss}))
    return out


def point(
    q: torch.Tensor, k: torch.Tensor, opts: dict[str, Any], g: int, scale: float, lse: Any
) -> tuple[float, float]:
    """The density and recall of one selection on one (sequence, layer)."""
    if "v" in opts:
        plan = mtrain.estimate_pattern(
            q, k, mtrain.TopK(opts["v"], opts["s"]), granularity=g, softmax_scale=scale
        )
        pat = plan.patterns[0]
    else:
        extra = {"lse": lse.float()} if opts["method"] == "precise" else {}
        pat = mtrain.select_blocks(q, k, granularity=g, softmax_scale=scale, **opts, **extra)[0]
    return pat.density(), recall(q, k, pat, scale)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init-from", required=True, help="the weights (--save of examples.train)")
    ap.add_argument("--size", default="tiny", choices=sorted(M.SIZES))
    ap.add_argument("--task", default="passkey", choices=("passkey", "mqar"))
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--granularity", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=8, help="evaluation sequences (seed 1)")
    ap.add_argument("--num-keys", type=int, default=256)
    ap.add_argument("--num-values", type=int, default=256)
    ap.add_argument("--num-filler", type=int, default=256)
    ap.add_argument("--mqar-pairs", type=int, default=4)
    ap.add_argument("--mqar-queries", type=int, default=24)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.seq_len % a.granularity:
        ap.error(f"--seq-len {a.seq_len} must be a multiple of --granularity {a.granularity}")
    size = M.SIZES[a.size]
    vocab = Vocab(a.num_keys, a.num_values, a.num_filler)
    task = make_task(
        a.task, a.seq_len, vocab, num_pairs=a.mqar_pairs, num_queries=a.mqar_queries,
        digits=5, num_buckets=8,
    )  # fmt: skip
    arm = Arm("dense", size.heads, Budget(granularity=a.granularity))
    arm.set_length(a.seq_len)
    model = M.build(size, vocab.size, a.seq_len, a.rope_theta, arm.attn_name, 0)
    model.load_state_dict(torch.load(a.init_from, map_location="cpu", weights_only=True))
    M.set_rope_theta(model, a.rope_theta, a.seq_len)
    model.eval()
    ids, _, _, _ = batch([task], 1, 0, a.sequences, evaluation=True)
    scale = size.head_dim**-0.5
    points = budgets(a.seq_len)
    acc: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(points))}
    t0 = time.perf_counter()
    for seq in range(a.sequences):
        with CAPTURE.taking() as taken, torch.no_grad():
            model(input_ids=ids[seq : seq + 1])
        for layer in sorted(taken):
            q, k = taken[layer]
            lse = dense_lse(q, k, scale)
            for i, (_, _, opts) in enumerate(points):
                acc[i].append(point(q, k, opts, a.granularity, scale, lse))
    rows = []
    for i, (method, label, _) in enumerate(points):
        dens = statistics.mean(x for x, _ in acc[i])
        rec = statistics.mean(y for _, y in acc[i])
        rows.append({"method": method, "budget": label, "density": dens, "recall": rec})
    out = {
        "init_from": a.init_from,
        "args": vars(a),
        "layers": size.layers,
        "heads": [size.heads, size.kv_heads],
        "head_dim": size.head_dim,
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    print("| method | budget | density | recall |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['budget']} | {r['density']:.3f} | {r['recall']:.4f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
