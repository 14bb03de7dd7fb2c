"""The arms of the experiment: which attention each layer runs. Every arm is
registered with transformers under its own name ("train-<arm>") as a thin
wrapper around the real attention (SDPA, or mtrain.register_transformers'),
so that the probe (probe.py) can time it and read its pattern on the steps it
watches without changing what is computed. Under context parallel (cp.py)
every arm runs mtrain over the process group: dense as mtrain's dense causal
pattern on the ring (SDPA has no ring), the mtrain arms estimating (or, for
mtrain-block, selecting their blocks) on the ring, window with its given
pattern."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import mtrain

from .probe import CAPTURE, PROBE, recall, sync

ARMS = ("dense", "mtrain-full", "mtrain-static", "mtrain-topp", "mtrain-block", "window")
BLOCK_METHODS = ("antidiag", "meanpool")


@dataclass(frozen=True)
class Budget:
    """How the mtrain and window arms choose what they compute.

    mtrain-static keeps TopK(sinks + v_frac * N, window + s_frac * N): the
    sinks and the local window are forced by SPEC.md section 2, the rest is
    chosen by score, so the budget grows with the sequence length N.
    mtrain-topp keeps TopP(p_v, p_s) with caps N; with topp_forced (the default) the sinks and
    the local window are forced as in mtrain-static (the estimate's top_p_forced), then the
    best other candidates are added by mass (SPEC.md section 2). window computes the block
    diagonals 0 .. window_blocks - 1 (a sliding window of that many blocks of
    G tokens, no verticals); window_blocks 0 means: as many as give
    match_density (the density measured in another run, --match), else the
    static budget's nominal density (static_density). mtrain-block selects
    a block mask per head every step (mtrain.select_blocks, SPEC.md section 9):
    block_method "antidiag" (XAttention's strided antidiagonal scores, stride
    block_stride) keeps block_top_p of each query block's scored mass, or, with
    block_top_k > 0, that many key blocks; "meanpool" (MoBA's gating) keeps
    block_top_k; block_sinks and block_local key blocks are always in."""

    granularity: int = 64
    sinks: int = 30
    local_window: int = 100
    last_q: int = 64
    v_frac: float = 1 / 32
    s_frac: float = 1 / 64
    p_v: float = 0.9
    p_s: float = 0.9
    topp_forced: bool = True  # mtrain-topp: force the sinks and the local window (top_p_forced)
    window_blocks: int = 0
    match_density: float = 0.0
    block_method: str = "antidiag"
    block_top_p: float = 0.9
    block_top_k: int = 0
    block_stride: int = 8
    block_sinks: int = 1
    block_local: int = 1
    block_refresh: int = 0  # 0: select in every call; K >= 1: BlockPatternCache, every K steps
    block_measure_every: int = 1  # K > 1: measure the recall drop every M windows (0: never)
    block_measure_rows: int = 0  # 0: BlockPatternCache.measure; R > 0: on R sampled rows
    dense_above: float | str | None = None  # the estimating arms' dense fallback (None: never)
    dense_recheck: int = 1
    deterministic: bool = True  # mtrain's attention: the deterministic backward (False: fused)

    def block_options(self) -> dict[str, Any]:
        """mtrain.select_blocks' options of the mtrain-block arm."""
        if self.block_method not in BLOCK_METHODS:
            raise ValueError(f"--block-method {self.block_method!r}: one of {BLOCK_METHODS}")
        if self.block_method == "meanpool" and self.block_top_k <= 0:
            raise ValueError(
                "--block-method meanpool is top-k only (its scores are logits, not masses): "
                "give --block-top-k K > 0"
            )
        budget: dict[str, Any] = (
            {"top_k": self.block_top_k} if self.block_top_k > 0 else {"top_p": self.block_top_p}
        )
        out = {"method": self.block_method, **budget}
        out.update(sink_blocks=self.block_sinks, local_blocks=self.block_local)
        if self.block_method == "antidiag":
            out["stride"] = self.block_stride
        return out

    def topk(self, n: int) -> mtrain.TopK:
        return mtrain.TopK(
            self.sinks + round(self.v_frac * n), self.local_window + round(self.s_frac * n)
        )

    def static_density(self, n: int) -> float:
        """The static budget's density if its slashes fill the nearest block
        diagonals and each vertical covers the half of the queries after it
        on average (its nominal cost; the measured density is in the results)."""
        k = self.topk(n)
        g = self.granularity
        diag_blocks = min(math.ceil(k.s_size / g) + 1, math.ceil(n / g))
        pairs = window_pairs(n, g, diag_blocks) + k.v_size * n / 2
        return min(1.0, pairs / (n * (n + 1) / 2))

    def window_width(self, n: int) -> int:
        if self.window_blocks > 0:
            return self.window_blocks
        target = self.match_density or self.static_density(n)
        nb = math.ceil(n / self.granularity)
        best = min(
            range(1, nb + 1),
            key=lambda w: abs(window_pairs(n, self.granularity, w) / (n * (n + 1) / 2) - target),
        )
        return best


def window_pairs(n: int, g: int, width: int) -> int:
    """Causal (query, key) pairs of block diagonals 0 .. width-1 at length n."""
    i = torch.arange(n)
    lo = torch.clamp((i // g - (width - 1)) * g, min=0)
    return int((i - lo + 1).sum())


def window_pattern(n: int, heads: int, g: int, width: int) -> mtrain.Pattern:
    return mtrain.vertical_slash_pattern(n, [(list(range(width)), [])] * heads, g)


class Arm:
    """An arm bound to a model's head count; ``attn_name`` is what the model's
    config._attn_implementation must be. set_length re-targets the arm at a
    sequence length (the budgets scale with it; the window's pattern is
    rebuilt). ``cp``: context parallel (the model's forward passes
    mtrain_dispatch=info, which mtrain's attention function takes)."""

    def __init__(
        self, name: str, heads: int, budget: Budget, cp: bool = False, packed: bool = False
    ) -> None:
        if name not in ARMS:
            raise ValueError(f"unknown arm {name!r}: one of {', '.join(ARMS)}")
        self.name, self.heads, self.budget, self.cp = name, heads, budget, cp
        self.packed = packed  # packed varlen batches (--mix): dense runs mtrain's dense pattern
        self.attn_name = f"train-{name}"
        self.inner = f"mtrain-{name}"
        self.seq_len = 0
        self.pattern: mtrain.Pattern | None = None
        self.budgets: Any = None
        self.blocks: dict[str, Any] | None = None
        # mtrain-block: the mean over heads of the selection's own recall (the share of the
        # scored mass it kept) at the last plan_of; None for meanpool (logits, not masses)
        self.scored_recall: float | None = None
        # mtrain-block with --block-refresh K >= 1: the pattern cache (examples/train/arms.py
        # BlockRefresh), made at the first training call
        self.refresh: BlockRefresh | None = None

    def estimate_options(self) -> dict[str, Any]:
        """mtrain's estimate options of this arm (mtrain.estimate_pattern's keywords): the
        sinks and the local window, forced in top-p mode too for mtrain-topp with
        topp_forced."""
        b = self.budget
        return {
            "last_q": b.last_q,
            "num_sinks": b.sinks,
            "window": b.local_window,
            "top_p_forced": self.name == "mtrain-topp" and b.topp_forced,
        }

    def set_length(self, n: int) -> None:
        b, self.seq_len = self.budget, n
        common = {"granularity": b.granularity, "deterministic": b.deterministic}
        est = self.estimate_options()
        if self.name == "dense" and not (self.cp or self.packed):
            base: Any = sdpa_attention_forward
            mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
        elif self.name == "dense":
            # SDPA has no ring and no cu_seqlens: mtrain's dense causal pattern (over the group)
            mtrain.register_transformers(self.inner, **common)
            base = ALL_ATTENTION_FUNCTIONS[self.inner]
            mask = ALL_MASK_ATTENTION_FUNCTIONS[self.inner]
        else:
            if self.name == "mtrain-full":
                self.budgets = mtrain.TopK(n, n)
            elif self.name == "mtrain-static":
                self.budgets = b.topk(n)
            elif self.name == "mtrain-topp":
                self.budgets = mtrain.TopP(b.p_v, b.p_s, n, n)
            if self.name == "window":
                self.pattern = window_pattern(n, self.heads, b.granularity, b.window_width(n))
                mtrain.register_transformers(self.inner, pattern=self.pattern, **common)
            elif self.name == "mtrain-block" and b.block_refresh > 0:
                # the wrapper selects (through the cache when training) and hands the
                # patterns to mtrain's attention function through pattern=
                self.blocks = b.block_options()
                self.refresh = BlockRefresh(
                    self.blocks, b.block_refresh, b.block_measure_every, b.granularity,
                    b.block_measure_rows,
                )  # fmt: skip
                mtrain.register_transformers(self.inner, pattern=self.refresh.patterns, **common)
            elif self.name == "mtrain-block":
                self.blocks = b.block_options()
                mtrain.register_transformers(self.inner, blocks=self.blocks, **common)
            else:
                mtrain.register_transformers(
                    self.inner, budgets=self.budgets, **common, **est, **self._fallback()
                )
            base = ALL_ATTENTION_FUNCTIONS[self.inner]
            mask = ALL_MASK_ATTENTION_FUNCTIONS[self.inner]
        AttentionInterface.register(self.attn_name, _wrap(self, base))
        AttentionMaskInterface.register(self.attn_name, mask)

    def set_tuned_budgets(self, path: str | None) -> None:
        """mtrain-static only: estimate with a per-layer, per-head budget file (the tuner's, one
        per rank: --balance-tune) instead of the arm's TopK, or back to the TopK with None."""
        if self.name != "mtrain-static":
            raise ValueError(f"tuned budgets apply to the mtrain-static arm, not {self.name}")
        b = self.budget
        common = {"granularity": b.granularity, "deterministic": b.deterministic}
        est = self.estimate_options()
        budgets = path if path is not None else self.budgets
        mtrain.register_transformers(
            self.inner, budgets=budgets, **common, **est, **self._fallback()
        )
        AttentionInterface.register(
            self.attn_name, _wrap(self, ALL_ATTENTION_FUNCTIONS[self.inner])
        )

    def _fallback(self) -> dict[str, Any]:
        """The dense fallback's options of the estimating arms (none when off)."""
        b = self.budget
        if b.dense_above is None:
            return {}
        return {"dense_above": b.dense_above, "dense_recheck": b.dense_recheck}

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"arm": self.name, "granularity": self.budget.granularity}
        out["attention"] = (
            "sdpa"
            if self.name == "dense" and not (self.cp or self.packed)
            else "mtrain" + " ring" * self.cp + " packed" * self.packed
        )
        if self.budgets is not None:
            out["budgets"] = {type(self.budgets).__name__: list(self.budgets)}
            out["estimate"] = self.estimate_options()
        if self.blocks is not None:
            out["blocks"] = dict(self.blocks)
            out["block_refresh"] = self.budget.block_refresh
            if self.refresh is not None:
                out["block_measure_every"] = self.budget.block_measure_every
                out["block_measure_rows"] = self.budget.block_measure_rows
        if self.pattern is not None:
            out["window_blocks"] = self.budget.window_width(self.seq_len)
            out["window_tokens"] = self.budget.window_width(self.seq_len) * self.budget.granularity
            out["pattern_density"] = self.pattern.density()
            out["matched_density"] = self.budget.match_density or None
        if self.name == "mtrain-static":
            out["nominal_density"] = self.budget.static_density(self.seq_len)
        if self.budgets is not None and self.budget.dense_above is not None:
            out["dense_above"] = self.budget.dense_above
            out["dense_recheck"] = self.budget.dense_recheck
        if out["attention"] != "sdpa":
            out["deterministic"] = self.budget.deterministic
        return out

    def plan_of(
        self, q: torch.Tensor, k: torch.Tensor, info: Any = None
    ) -> list[mtrain.Pattern] | None:
        """The patterns this arm computes for q, k ([B, N, H, d], post-RoPE):
        the estimate (or the block selection) again (the same inputs and
        options give the same pattern), the window's, or None (dense). Under
        context parallel q and k are this rank's slots and ``info`` their
        DispatchInfo: the estimate or selection runs on the ring (collective)
        and gives the global patterns."""
        b = self.budget
        if self.pattern is not None:
            return [self.pattern] * q.shape[0]
        where = info.attention_kwargs() if info is not None else {"granularity": b.granularity}
        if self.refresh is not None:
            # the patterns this call computes with (cached or fresh), chosen by the wrapper
            self.scored_recall = None
            return self.refresh.last
        if self.blocks is not None:
            patterns, reports = mtrain.select_blocks(q, k, report=True, **self.blocks, **where)
            recalls = torch.cat([r.recall for r in reports])
            self.scored_recall = None if recalls.isnan().any() else float(recalls.mean())
            return patterns
        if self.budgets is None:
            return None
        plan = mtrain.estimate_pattern(q, k, self.budgets, **self.estimate_options(), **where)
        return plan.patterns


def _wrap(arm: Arm, base: Any) -> Any:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        # under autocast RoPE leaves q, k in float32 and v in bfloat16: one dtype for all
        if query.dtype != value.dtype or key.dtype != value.dtype:
            query, key = query.to(value.dtype), key.to(value.dtype)
        if CAPTURE.active:
            CAPTURE.take(module, query, key)
        if arm.refresh is not None:
            # --block-refresh: the patterns of this call, timed as part of the attention
            if PROBE.active:
                sync(query.device)
                t0 = time.perf_counter()
            arm.refresh.choose(module, query, key, kwargs.get("scaling"), kwargs)
            if PROBE.active:
                sync(query.device)
                PROBE.fwd_s += time.perf_counter() - t0 - arm.refresh.call_measure_s
        if not PROBE.active:
            return base(module, query, key, value, attention_mask, **kwargs)
        PROBE.pattern_stats(
            arm, module, query, key, kwargs.get("scaling"), kwargs.get("mtrain_dispatch")
        )
        query, key, value = PROBE.enter(query, key, value)
        out, extra = base(module, query, key, value, attention_mask, **kwargs)
        return PROBE.leave(out), extra

    return attention


class BlockRefresh:
    """The mtrain-block arm with --block-refresh K (issue 23): in training calls
    (the module in training mode, gradients on) each layer's and batch slot's
    pattern comes from mtrain.BlockPatternCache, selected anew on the steps
    that are multiples of K (and on the first step of a call that resumed a
    run) and reused in between; slot b holds batch index b of every step (one
    sequence per cache entry: the cache's unit), so it reuses a pattern
    selected on another sequence of the same task (with --task mix, sequence
    i's task is i mod 2 and the batch is even). Evaluation calls select
    afresh, as the arm does without the cache. On the last step of every
    measure_every-th window of K steps (K > 1) it measures, on batch slot 0 of
    every layer, the recall of the pattern used there (age K - 1) against a
    fresh selection on that step's q and k: BlockPatternCache.measure (fp64 on
    the CPU over every query row, O(N^2)), or with measure_rows R > 0 the
    probe's recall (probe.recall) of both patterns on R query rows spread over
    the sequence, on the q and k's device. Under context parallel the cache is the ring form
    (group=, the dispatch's layout and length) and every call is collective:
    every rank keeps the same schedule."""

    def __init__(
        self, blocks: dict[str, Any], refresh: int, measure_every: int, granularity: int,
        measure_rows: int = 0,
    ) -> None:  # fmt: skip
        if refresh < 1:
            raise ValueError(f"--block-refresh {refresh}: must be >= 1 (0: no cache)")
        if measure_every < 0:
            raise ValueError(f"--block-measure-every {measure_every}: must be >= 0 (0: never)")
        if measure_rows < 0:
            raise ValueError(f"--block-measure-rows {measure_rows}: must be >= 0")
        self.blocks, self.k, self.m, self.g = blocks, refresh, measure_every, granularity
        self.rows = measure_rows
        self.cache: mtrain.BlockPatternCache | None = None
        self.batch = 0
        self.step = 0  # the training step (begin_step)
        self.last: list[mtrain.Pattern] | None = None  # the patterns of the last call
        self.by_layer: dict[int, list[mtrain.Pattern]] = {}
        # this step's record (begin_step clears it; the training loop stores it in the step's
        # record, so that a resumed run keeps it): whether layer 0 selected, the measures
        self.step_refreshed = False
        self.step_measures: list[dict[str, Any]] = []
        self.step_measure_s = 0.0  # measure() seconds in this step (left out of its time)
        self.step_select_s = 0.0  # seconds in the cache's select() calls (selecting or not)
        self.call_measure_s = 0.0

    def begin_step(self, step: int) -> None:
        """Called by the training loop before each training step's forward."""
        self.step = step
        self.step_refreshed = False
        self.step_measures = []
        self.step_measure_s = 0.0
        self.step_select_s = 0.0

    def record(self) -> dict[str, Any]:
        """This step's part of the step record (after the step)."""
        return {
            "refresh": self.step_refreshed,
            "measure_s": self.step_measure_s,
            "select_s": self.step_select_s,
            "measures": self.step_measures,
        }

    def patterns(self, layer: Any) -> list[mtrain.Pattern]:
        """register_transformers(pattern=...)'s callable: the patterns this layer's
        current call chose (choose() runs first, in the arm's wrapper)."""
        return self.by_layer[int(layer)]

    def _cache(self, layers: int, batch: int, scale: Any, info: Any) -> mtrain.BlockPatternCache:
        if self.cache is None or batch != self.batch:
            ring: dict[str, Any] = {}
            if info is not None:
                ring = {"group": info.group, "layout": info.layout, "seq_len": info.seq_lens[0]}
            self.cache = mtrain.BlockPatternCache(
                self.k, layers * batch, **self.blocks, softmax_scale=scale,
                granularity=info.granularity if info is not None else self.g, **ring,
            )  # fmt: skip
            self.batch = batch
        return self.cache

    def choose(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scale: Any,
        kwargs: dict[str, Any],
    ) -> None:  # fmt: skip
        """The patterns of this call (query, key [B, H, N, d] as transformers hands them)."""
        layer = int(getattr(module, "layer_idx", 0))
        info = kwargs.get("mtrain_dispatch")
        if kwargs.get("cu_seq_lens_q") is not None:
            raise ValueError("--block-refresh: packed sequences (cu_seq_lens) are not supported")
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2).contiguous()
        self.call_measure_s = 0.0
        if not (module.training and torch.is_grad_enabled()):
            where = info.attention_kwargs() if info is not None else {"granularity": self.g}
            self.last = mtrain.select_blocks(q, k, softmax_scale=scale, **self.blocks, **where)
            self.by_layer[layer] = self.last
            return
        layers = int(module.config.num_hidden_layers)
        batch = int(q.shape[0])
        cache = self._cache(layers, batch, scale, info)
        out = []
        # host seconds, no synchronisation added (the antidiagonal selection copies its scores
        # to the host, which waits for the device; a reused pattern touches no data)
        t_select = time.perf_counter()
        for b in range(batch):
            slot = layer * batch + b
            if self.step % self.k == 0 and not cache.due(slot):
                cache.invalidate(slot)  # the schedule follows the step (a resumed call)
            out.append(cache.select(slot, q[b], k[b]))
            age = cache.age(slot)
            if age == 0 and layer == 0 and b == 0:
                self.step_refreshed = True
        self.step_select_s += time.perf_counter() - t_select
        window = self.step // self.k
        if self.k > 1 and self.m > 0 and (self.step + 1) % self.k == 0 and window % self.m == 0:
            sync(q.device)
            t0 = time.perf_counter()
            if self.rows > 0:
                check = self._sampled(cache, layer * batch, q, k, scale, info)
            else:
                check = cache.measure(layer * batch, q[0], k[0])
            sync(q.device)
            seconds = time.perf_counter() - t0
            self.call_measure_s = seconds
            self.step_measure_s += seconds
            self.step_measures.append({
                "step": self.step, "layer": layer, "batch_index": 0, "age": check.age,
                "rows": self.rows or None,
                "cached_recall": check.cached, "fresh_recall": check.fresh, "drop": check.drop,
                "cached_density": check.cached_density, "fresh_density": check.fresh_density,
                "seconds": seconds,
            })  # fmt: skip
        self.last = out
        self.by_layer[layer] = out

    @torch.no_grad()
    def _sampled(
        self, cache: mtrain.BlockPatternCache, slot: int, q: torch.Tensor, k: torch.Tensor,
        scale: Any, info: Any,
    ) -> mtrain.RecallCheck:  # fmt: skip
        """measure()'s figures from self.rows query rows (probe.recall, on q's device) of
        batch slot 0: the cached pattern's recall and a fresh selection's. Under context
        parallel q and k are gathered first (collective)."""
        if info is not None:
            q, k = mtrain.undispatch(q, info), mtrain.undispatch(k, info)
        q0, k0 = q[0], k[0]
        fresh = mtrain.select_blocks(
            q0[None], k0[None], softmax_scale=scale, granularity=self.g, **self.blocks
        )[0]
        cached = cache.pattern(slot)
        assert cached is not None
        sc = float(scale) if scale is not None else q0.shape[-1] ** -0.5
        got = recall(q0, k0, cached, self.rows, sc)
        want = recall(q0, k0, fresh, self.rows, sc)
        nan = torch.full((q0.shape[1],), float("nan"), dtype=torch.float64)
        return mtrain.RecallCheck(
            cached=got, fresh=want, cached_per_head=nan, fresh_per_head=nan,
            age=cache.age(slot), cached_density=cached.density(), fresh_density=fresh.density(),
        )  # fmt: skip

    def summary(self, steps: list[dict[str, Any]]) -> dict[str, Any]:
        """The run's figures from its step records: refreshes and the measured recall
        drops (mean and worst over every measure)."""
        recs = [s["block_cache"] for s in steps if "block_cache" in s]
        measures = [m for r in recs for m in r["measures"]]
        drops = [m["drop"] for m in measures]
        return {
            "refresh_every": self.k,
            "measure_every": self.m,
            "steps": len(recs),
            "refreshes": sum(r["refresh"] for r in recs),
            "refresh_steps": [s["step"] for s in steps if s.get("block_cache", {}).get("refresh")],
            "measures": measures,
            "drop_mean": statistics.mean(drops) if drops else None,
            "drop_max": max(drops) if drops else None,
            "measure_s": sum(r["measure_s"] for r in recs),
            # the cache's select() seconds per step (every layer and slot, host time), on the
            # steps that selected and on those that reused
            "select_s_refresh_mean": _mean([r.get("select_s", 0.0) for r in recs if r["refresh"]]),
            "select_s_reuse_mean": _mean(
                [r.get("select_s", 0.0) for r in recs if not r["refresh"]]
            ),
        }


def _mean(xs: list[float]) -> float | None:
    return statistics.mean(xs) if xs else None
