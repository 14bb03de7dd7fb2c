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


ROW_ELEMENTS = 1 << 25  # query rows x keys of one chunk of float64 scores (256 MiB)


def _head_masks(pattern: Any, h: int) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """Head h of a pattern as the tables its chunk masks index: ("block", the block mask,
    None) or ("vs", the block diagonals kept (index: query block - key block), the vertical
    key positions kept)."""
    if pattern.is_block_mask(h):
        return "block", pattern.block_mask(h), None
    diagonals, verticals = pattern.head(h)
    on = torch.zeros(pattern.num_blocks + 1, dtype=torch.bool)
    on[torch.tensor(diagonals, dtype=torch.long)] = True
    vert = None
    if verticals:
        vert = torch.zeros(pattern.seq_len, dtype=torch.bool)
        vert[torch.tensor(verticals, dtype=torch.long)] = True
    return "vs", on, vert


def recalls(
    q: torch.Tensor, k: torch.Tensor, patterns: list[Any], scale: float, rows: int = 0
) -> list[float]:
    """For each pattern, the share of the dense causal softmax mass inside it, over every query
    row and head, in float64 (q [N, Hq, d], k [N, Hkv, d]). The dense probabilities of a head
    are computed once for all the patterns, `rows` query rows at a time (0: as many as keep a
    chunk within ROW_ELEMENTS scores), so that long sequences fit in memory."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    if not patterns:
        return []
    g = patterns[0].granularity
    if any(p.granularity != g or p.seq_len != n for p in patterns):
        raise ValueError("recalls: every pattern must have the granularity and length of the first")
    step = rows if rows > 0 else max(1, ROW_ELEMENTS // max(1, n))
    i = torch.arange(n)
    kb = (i // g)[None, :]
    total = [0.0] * len(patterns)
    for h in range(hq):
        masks = [_head_masks(p, h) for p in patterns]
        kh = k[:, h // group].double()
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            rows_i = i[r0:r1, None]
            qb = rows_i // g
            causal = i[None, :] <= rows_i
            s = (q[r0:r1, h].double() @ kh.T) * scale
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            below = qb >= kb
            for j, (kind, table, vert) in enumerate(masks):
                if kind == "block":
                    allowed = table[qb, kb] & below
                else:
                    allowed = table[(qb - kb).clamp(min=0, max=table.numel() - 1)] & below
                    if vert is not None:
                        allowed = allowed | (vert[None, :] & (kb < qb))
                total[j] += float(torch.where(allowed & causal, p, 0.0).sum())
    return [t / (n * hq) for t in total]


def recall(q: torch.Tensor, k: torch.Tensor, pattern: Any, scale: float) -> float:
    """recalls() of one pattern."""
    return recalls(q, k, [pattern], scale)[0]


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int = 0) -> torch.Tensor:
    """[N, Hq] float64 log-sum-exp of the dense causal scores (the precise search's input),
    `rows` query rows at a time (0: as recalls chooses)."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    step = rows if rows > 0 else max(1, ROW_ELEMENTS // max(1, n))
    i = torch.arange(n)
    out = torch.empty(n, hq, dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // group].double()
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            causal = i[None, :] <= i[r0:r1, None]
            s = (q[r0:r1, h].double() @ kh.T) * scale
            out[r0:r1, h] = torch.logsumexp(s.masked_fill(~causal, float("-inf")), dim=-1)
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


def select(
    q: torch.Tensor, k: torch.Tensor, opts: dict[str, Any], g: int, scale: float, lse: Any
) -> Any:
    """The pattern of one point of the table on one (sequence, layer)."""
    if "v" in opts:
        plan = mtrain.estimate_pattern(
            q, k, mtrain.TopK(opts["v"], opts["s"]), granularity=g, softmax_scale=scale
        )
        return plan.patterns[0]
    extra = {"lse": lse.float()} if opts["method"] == "precise" else {}
    return mtrain.select_blocks(q, k, granularity=g, softmax_scale=scale, **opts, **extra)[0]


def point(
    q: torch.Tensor, k: torch.Tensor, opts: dict[str, Any], g: int, scale: float, lse: Any
) -> tuple[float, float]:
    """The density and recall of one selection on one (sequence, layer)."""
    pat = select(q, k, opts, g, scale, lse)
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
            pats = [select(q, k, opts, a.granularity, scale, lse) for _, _, opts in points]
            # one pass of the dense probabilities for all the points (a pass per point took
            # 95% of a run's time)
            for i, (pat, rec) in enumerate(zip(pats, recalls(q, k, pats, scale), strict=True)):
                acc[i].append((pat.density(), rec))
            print(
                f"sequence {seq} layer {layer}: {len(points)} points, "
                f"{time.perf_counter() - t0:.0f} s so far",
                file=sys.stderr,
                flush=True,
            )
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
