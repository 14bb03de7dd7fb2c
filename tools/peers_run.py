# ruff: noqa: N803, N806, E501  (N, G, H, R: the names of docs/SPEC.md; tables of arguments)
"""peers_run.py: the peers of issue 21 inside tools/bench_cuda_peers.py, each in its own
try/except and time limit, each either timed or reported in one line as "cannot run: <why>":

- minference (vertical-slash, forward): its Triton kernel on our exact tiles, and its public
  vertical_slash_sparse_attention on our verticals and covering slashes (peers_minference.py);
- cudnn-fe: cuDNN's SDPA through the frontend's graph API, dense causal forward and
  forward+backward, and the block mask of tools/bench_block_kernels.py (forward; peers_cudnn.py);
- flash-attn (dense causal) where it imports; flashinfer: why it is not run (peers_common.py);
- the block section (--block-keep K): bench_block_kernels.random_mask(N, K) timed with mtrain's
  Python op, FlexAttention and cuDNN's block mask, the pairs checked to be the same.

With --dry-run (any device, no timing) the index conversions, the pair counts and the imports
are checked and the table lists what would run and what cannot.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import peers_common as pc
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Ctx:
    """What the peers need from bench_cuda_peers.main(): its arguments, the device, the input
    sets, the Pattern class, median_ms, and add(...) / skip(...) for the table's rows."""

    def __init__(
        self, args: Any, device: Any, sets: Any, bench: Any, add: Callable, skip: Callable
    ) -> None:
        self.args, self.device, self.sets, self.bench = args, device, sets, bench
        self.add, self.skip = add, skip
        self.dry = args.dry_run
        self.ok = True

    def timed(self, fn: Callable) -> float:
        return self.bench.median_ms(fn, self.args.warmup, self.args.reps)

    def guarded(self, peer: str, pattern: str, body: Callable) -> None:
        """Runs body() under the per-peer limit; a failure is one "cannot run" row."""
        try:
            with pc.time_limit(self.args.peer_limit, f"{peer} {pattern}"):
                body()
        except Exception as e:  # every peer's failure is reported, never hidden
            self.skip(peer, pattern, pc.reason(e))


def repeated(sets: list[dict], group: int) -> list[dict]:
    """The sets with k and v repeated to Hq heads (for kernels without GQA), outside timing."""
    return [
        {**s, "k": s["k"].repeat_interleave(group, 1), "v": s["v"].repeat_interleave(group, 1)}
        for s in sets
    ]


def fwd_only(attn: Callable, sets: list[dict]) -> Callable:
    def fwd(i: int) -> None:
        s = sets[i % 2]
        with torch.no_grad():
            attn(s["q"], s["k"], s["v"])

    return fwd


# ---- vertical-slash ---------------------------------------------------------------------------


def minference_peers(c: Ctx, doc: dict, vs: Any) -> None:
    import peers_minference as pm

    pairs = vs.pairs()

    def exact() -> None:
        bc, bo, cc, ci = pm.exact_indexes(vs)
        got, causal = pm.index_pairs(bc, bo, cc, ci, vs.N)
        good = got == pairs and causal
        print(f"  minference vertical-slash: pairs ours {pairs}, its tiles {got} -> "
              f"{'ok' if good else 'MISMATCH'}", flush=True)  # fmt: skip
        if not good:
            c.ok = False
            raise pc.CannotRun(f"its tiles hold {got} pairs, ours {pairs}")
        if c.dry:
            pm.api_indexes(vs)
            c.skip("minference", "vertical-slash", "dry run: not timed (indexes checked)")
            return
        mod, note = pm.load(
            pm.find_sdist(c.args.wheels_dir), os.path.join(c.args.work_dir, "minference")
        )
        print(f"  minference: {note}", flush=True)
        attn, n, how = pm.exact_peer(mod, vs, c.device)
        sets = repeated(c.sets, c.args.heads // c.args.kv_heads)
        c.add("minference", "vertical-slash", n, c.timed(fwd_only(attn, sets)), None,
              f"({how}; forward only; k/v repeated)")  # fmt: skip

    c.guarded("minference", "vertical-slash", exact)
    if c.dry:
        return

    def api() -> None:
        mod, _ = pm.load(
            pm.find_sdist(c.args.wheels_dir), os.path.join(c.args.work_dir, "minference")
        )
        attn, computed = pm.api_peer(mod, vs, c.device)
        print(f"  minference-api vertical-slash: computes {computed} pairs, ours {pairs} "
              f"(+{100.0 * (computed - pairs) / pairs:.1f}%: 64-token slash tiles)", flush=True)  # fmt: skip
        sets = repeated(c.sets, c.args.heads // c.args.kv_heads)
        c.add("minference-api", "vertical-slash", pairs, c.timed(fwd_only(attn, sets)), None,
              f"(vertical_slash_sparse_attention; computes {computed} pairs; rate on ours)")  # fmt: skip

    c.guarded("minference-api", "vertical-slash", api)


# ---- dense ------------------------------------------------------------------------------------


def dense_peers(c: Ctx, peers: set, dense_pairs: int) -> None:
    if "cudnn-fe" in peers:

        def cudnn_dense() -> None:
            import peers_cudnn

            cudnn, note = peers_cudnn.load()
            print(f"  cudnn-fe: {note}", flush=True)
            if c.dry:
                c.skip("cudnn-fe", "dense", f"dry run: not timed ({note})")
                return
            fwd, fb = peers_cudnn.dense(cudnn, c.sets)
            c.add("cudnn-fe", "dense", dense_pairs, c.timed(fwd), c.timed(fb) if fb else None, "")

        c.guarded("cudnn-fe", "dense", cudnn_dense)
    if "flash-attn" in peers:

        def fa() -> None:
            attn, note = pc.flash_attn_peer()
            if c.dry:
                c.skip("flash-attn", "dense", f"dry run: not timed ({note})")
                return
            fwd_ms, fb_ms = c.bench.time_peer(attn, c.sets, c.args)
            c.add("flash-attn", "dense", dense_pairs, fwd_ms, fb_ms, f"({note})")

        c.guarded("flash-attn", "dense", fa)


# ---- the block mask of bench_block_kernels ------------------------------------------------------


def block_peers(c: Ctx, peers: set, N: int) -> None:
    keep = c.args.block_keep
    label = f"block keep {keep}"
    try:
        sys.path.insert(0, HERE)
        import bench_block_kernels as bbk

        if c.args.heads != bbk.HQ or c.args.kv_heads != bbk.HKV:
            raise pc.CannotRun(f"bench_block_kernels masks are for {bbk.HQ}:{bbk.HKV} heads")
        mask = bbk.random_mask(N, keep, c.args.seed)  # [H, nb, nb], G 128
    except Exception as e:
        c.skip("(block mask)", label, pc.reason(e))
        return
    G = bbk.G
    doc = {"granularity": G, "seq_len": N,
           "heads": [{"block_mask": torch.nonzero(m).tolist()} for m in mask]}  # fmt: skip
    pat = c.bench.Pattern(doc, c.device)
    pairs = pat.pairs()
    print(f"== block mask: bench_block_kernels.random_mask(N={N}, keep={keep}, seed={c.args.seed}), "
          f"{pairs} pairs ({100.0 * pairs / (c.args.heads * N * (N + 1) // 2):.2f}% of causal)", flush=True)  # fmt: skip

    def ours() -> None:
        import mtrain

        p = mtrain.block_mask_pattern(mask, N, G)
        n = sum(p.count_pairs(h) for h in range(p.num_heads))
        print(
            f"  mtrain {label}: pairs mtrain {n}, mask {pairs} -> {'ok' if n == pairs else 'MISMATCH'}",
            flush=True,
        )
        if n != pairs:
            c.ok = False
            raise pc.CannotRun(f"mtrain's pattern has {n} pairs, the mask {pairs}")
        if c.dry:
            c.skip("mtrain op", label, "dry run: not timed")
            return
        nsets = [
            {k: v[0].transpose(0, 1).contiguous() for k, v in s.items()} for s in c.sets
        ]  # [N, h, d]

        def attn(q: Any, k: Any, v: Any) -> Any:
            return mtrain.attention(q, k, v, pattern=p)

        fwd_ms, fb_ms = c.bench.time_peer(attn, nsets, c.args)
        c.add("mtrain op", label, pairs, fwd_ms, fb_ms, "(mtrain.attention, Python op)")

    c.guarded("mtrain op", label, ours)
    if "flex" in peers:

        def flex() -> None:
            if c.dry:
                c.skip("flex", label, "dry run: not timed")
                return
            bm = c.bench.to_block_mask(pat, pat.mask_mod())
            fwd_ms, fb_ms = c.bench.time_peer(c.bench.flex(bm), c.sets, c.args)
            c.add("flex", label, pairs, fwd_ms, fb_ms, "")

        c.guarded("flex", label, flex)
    if "cudnn-fe" in peers:

        def cudnn_block() -> None:
            import peers_cudnn

            packed = peers_cudnn.pack_block_mask(mask)
            if G != peers_cudnn.TILE:
                raise pc.CannotRun(
                    f"cuDNN's block mask has {peers_cudnn.TILE}-token tiles, the mask {G}"
                )
            cudnn, note = peers_cudnn.load()
            if c.dry:
                c.skip(
                    "cudnn-fe",
                    label,
                    f"dry run: not timed ({note}; mask {tuple(packed.shape)} uint8)",
                )
                return
            lsb, how = peers_cudnn.check_block_mask(cudnn, mask[:, :8, :8], c.args.heads, c.args.kv_heads,
                                                    c.args.head_dim)  # fmt: skip
            print(f"  cudnn-fe {label}: {how}", flush=True)
            fwd = peers_cudnn.block_mask_fwd(cudnn, c.sets, mask, lsb)
            c.add(
                "cudnn-fe",
                label,
                pairs,
                c.timed(fwd),
                None,
                "(forward only: block-masked backward needs cuDNN 9.27)",
            )

        c.guarded("cudnn-fe", label, cudnn_block)
    if "flashinfer" in peers:
        c.skip("flashinfer", label, pc.flashinfer_reason())


def run(c: Ctx, peers: set, doc: dict | None, vs: Any, N: int, dense_pairs: int) -> bool:
    """All the issue-21 peers; returns False when a pair count differed."""
    dense_peers(c, peers, dense_pairs)
    if doc is not None and "minference" in peers:
        minference_peers(c, doc, vs)
    if doc is not None and "flashinfer" in peers:
        c.skip("flashinfer", "vertical-slash", "no vertical-slash form (block-sparse wrapper only); "
               + pc.flashinfer_reason())  # fmt: skip
    if c.args.block_keep > 0:
        block_peers(c, peers, N)
    return c.ok
