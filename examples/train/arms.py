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
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import mtrain

from .probe import CAPTURE, PROBE

ARMS = ("dense", "mtrain-full", "mtrain-static", "mtrain-topp", "mtrain-block", "window")
BLOCK_METHODS = ("antidiag", "meanpool")


@dataclass(frozen=True)
class Budget:
    """How the mtrain and window arms choose what they compute.

    mtrain-static keeps TopK(sinks + v_frac * N, window + s_frac * N): the
    sinks and the local window are forced by SPEC.md section 2, the rest is
    chosen by score, so the budget grows with the sequence length N.
    mtrain-topp keeps TopP(p_v, p_s) with caps N. window computes the block
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
    window_blocks: int = 0
    match_density: float = 0.0
    block_method: str = "antidiag"
    block_top_p: float = 0.9
    block_top_k: int = 0
    block_stride: int = 8
    block_sinks: int = 1
    block_local: int = 1

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

    def set_length(self, n: int) -> None:
        b, self.seq_len = self.budget, n
        common = {"granularity": b.granularity}
        est = {"last_q": b.last_q, "num_sinks": b.sinks, "window": b.local_window}
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
            elif self.name == "mtrain-block":
                self.blocks = b.block_options()
                mtrain.register_transformers(self.inner, blocks=self.blocks, **common)
            else:
                mtrain.register_transformers(self.inner, budgets=self.budgets, **common, **est)
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
        common = {"granularity": b.granularity}
        est = {"last_q": b.last_q, "num_sinks": b.sinks, "window": b.local_window}
        budgets = path if path is not None else self.budgets
        mtrain.register_transformers(self.inner, budgets=budgets, **common, **est)
        AttentionInterface.register(
            self.attn_name, _wrap(self, ALL_ATTENTION_FUNCTIONS[self.inner])
        )

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"arm": self.name, "granularity": self.budget.granularity}
        out["attention"] = (
            "sdpa"
            if self.name == "dense" and not (self.cp or self.packed)
            else "mtrain" + " ring" * self.cp + " packed" * self.packed
        )
        if self.budgets is not None:
            out["budgets"] = {type(self.budgets).__name__: list(self.budgets)}
            out["estimate"] = {
                "last_q": self.budget.last_q,
                "num_sinks": self.budget.sinks,
                "window": self.budget.local_window,
            }
        if self.blocks is not None:
            out["blocks"] = dict(self.blocks)
        if self.pattern is not None:
            out["window_blocks"] = self.budget.window_width(self.seq_len)
            out["window_tokens"] = self.budget.window_width(self.seq_len) * self.budget.granularity
            out["pattern_density"] = self.pattern.density()
            out["matched_density"] = self.budget.match_density or None
        if self.name == "mtrain-static":
            out["nominal_density"] = self.budget.static_density(self.seq_len)
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
        if self.blocks is not None:
            patterns, reports = mtrain.select_blocks(q, k, report=True, **self.blocks, **where)
            recalls = torch.cat([r.recall for r in reports])
            self.scored_recall = None if recalls.isnan().any() else float(recalls.mean())
            return patterns
        if self.budgets is None:
            return None
        plan = mtrain.estimate_pattern(
            q, k, self.budgets, last_q=b.last_q, num_sinks=b.sinks, window=b.local_window,
            **where,
        )  # fmt: skip
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
        if not PROBE.active:
            return base(module, query, key, value, attention_mask, **kwargs)
        PROBE.pattern_stats(
            arm, module, query, key, kwargs.get("scaling"), kwargs.get("mtrain_dispatch")
        )
        query, key, value = PROBE.enter(query, key, value)
        out, extra = base(module, query, key, value, attention_mask, **kwargs)
        return PROBE.leave(out), extra

    return attention
