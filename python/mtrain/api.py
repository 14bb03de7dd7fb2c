"""The public calls: mtrain.attention, mtrain.estimate_pattern and
mtrain.select_blocks.

They take q, k (and v) token-major, either packed ``[T, H, d]`` (with FlashAttention
``cu_seqlens`` for several sequences) or batched ``[B, N, H, d]`` (B sequences
of N tokens). With ``group=`` (a torch.distributed process group) the tensors
are this rank's slots of the layout (mtrain.dispatch makes them) and the calls
are collective over the group.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import _comm
from . import _core as C
from . import _lib as L
from . import fallback as _fallback
from .ops import check_cu as _check_cu
from .ops import check_qkv as _check_qkv  # (importing ops registers them)

__all__ = [
    "BlockReport",
    "SparsePlan",
    "attention",
    "estimate_pattern",
    "last_estimate_times",
    "select_blocks",
]


class SparsePlan(NamedTuple):
    """The plan of one step (mtrain_plan_t): what mtrain.estimate_pattern
    returns and what the forward and the backward of that step share. Pass it
    as ``pattern=`` to mtrain.attention. Keep it until the backward ran."""

    handle: torch.Tensor
    options: str

    def _plan(self) -> C.Plan:
        return C.resolve_plan(self.handle)

    @property
    def patterns(self) -> list[C.Pattern]:
        """The pattern of each sequence of the batch."""
        return list(self._plan().patterns)

    @property
    def computed_pairs(self) -> int:
        """(query, key) pairs this rank computes, over heads and ring steps."""
        return self._plan().computed_pairs

    @property
    def local_tokens(self) -> int:
        return self._plan().local_tokens


def _is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _group_name(group: Any) -> str:
    if group is None:
        return ""
    return _comm.register_group(group)


def _world(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _flatten(
    q: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    seq_len: int | None,
    world: int,
    name: str = "q",
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...] | None]:
    """[B, N, H, d] -> [B*N, H, d] and its offsets (global ones under a group)."""
    if not isinstance(q, torch.Tensor):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name} is not a tensor ({type(q).__name__})")
    if q.ndim == 3:
        return q, cu_seqlens, None
    if q.ndim != 4:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"{name} has shape {tuple(q.shape)}: expected [tokens, heads, head_dim] or "
            "[batch, tokens, heads, head_dim]",
        )
    if cu_seqlens is not None:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            "cu_seqlens is for packed [tokens, heads, head_dim] tensors, not batched ones",
        )
    b, n = int(q.shape[0]), int(q.shape[1])
    if not q.is_contiguous():
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"{name} is not contiguous (shape {tuple(q.shape)}, strides {q.stride()}): call "
            ".contiguous() (for [B, H, N, d] inputs: .transpose(1, 2).contiguous())",
        )
    glob = seq_len if seq_len is not None else n * world
    cu = torch.arange(b + 1, dtype=torch.int64) * glob if (b > 1 or world > 1) else None
    return q.reshape(b * n, *q.shape[2:]), cu, tuple(q.shape[:2])


@torch.compiler.assume_constant_result
def _budgets_json(budgets: Any, layer: int | None) -> str:
    """The budgets' JSON (a constant under torch.compile)."""
    try:
        return json.dumps(C.budgets_spec(budgets, layer), sort_keys=True)
    except (IndexError, AttributeError) as e:
        # torch.compile hands a TopK/TopP built inside the compiled code over empty
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            "under torch.compile, build mtrain.TopK / TopP outside the compiled function (for "
            "example in the module's __init__) and pass them in",
        ) from e


def check_top_p_forced(value: Any) -> int:
    """The estimate's top_p_forced option as the library takes it (0 or 1); anything but a
    bool (or the ints 0 and 1) is refused with ERR_INVALID_ARGUMENT naming it."""
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return int(value)
    raise L.fail(
        L.ERR_INVALID_ARGUMENT, f"top_p_forced {value!r} must be True or False (or 1 or 0)"
    )


@torch.compiler.assume_constant_result
def _options(
    d: int,
    *,
    group: Any,
    layout: str,
    ranks_per_node: int,
    granularity: int,
    softmax_scale: float | None,
    backend: str | None,
    deterministic: bool,
    pattern: str,
    budgets: str = "",
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
    top_p_forced: bool = False,
) -> str:
    forced = check_top_p_forced(top_p_forced)
    scale = 0.0
    if softmax_scale is not None:
        scale = float(softmax_scale)
        if not scale > 0 or not math.isfinite(scale):
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"softmax_scale {softmax_scale} must be > 0")
        if d > 0 and abs(scale * math.sqrt(d) - 1.0) < 1e-12:
            scale = 0.0  # the default, one context for both spellings
    if layout not in L.LAYOUT_KINDS:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT, f"layout {layout!r} is not one of {', '.join(L.LAYOUT_KINDS)}"
        )
    return C.Options(
        backend=backend or "",
        granularity=int(granularity),
        scale=scale,
        deterministic=1 if deterministic else 0,
        group=_group_name(group),
        layout=layout,
        ranks_per_node=int(ranks_per_node),
        pattern=pattern,
        budgets=budgets,
        last_q=int(last_q),
        num_sinks=int(num_sinks),
        window=int(window),
        top_p_forced=forced,
    ).encode()


def estimate_pattern(
    q: torch.Tensor,
    k: torch.Tensor,
    budgets: Any,
    layer: int | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    group: Any = None,
    layout: str = "striped",
    ranks_per_node: int = 0,
    seq_len: int | None = None,
    granularity: int = 128,
    softmax_scale: float | None = None,
    backend: str | None = None,
    deterministic: bool = True,
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
    top_p_forced: bool = False,
) -> SparsePlan:
    """Estimates every sequence's vertical-slash pattern from post-RoPE q and k
    (docs/SPEC.md section 2) and builds the step's plan.

    Args:
        q, k: [T, Hq, d] and [T, Hkv, d] (or [B, N, H, d]); no gradient flows.
        budgets: a budget file (data/budgets/*.json, with ``layer=``), mtrain.TopK,
            mtrain.TopP, or a list of those with one per query head.
        layer: the budget file's layer.
        cu_seqlens: FlashAttention offsets of packed sequences (global ones under a
            group); a CPU tensor avoids a device-to-host copy.
        group: a torch.distributed process group: context parallel (collective).
        layout, ranks_per_node: the layout of the local tensors and the ring.
        seq_len: batched inputs under a group: the global length of each sequence
            (default: local length x world size).
        granularity: the block size G.
        last_q, num_sinks, window: the estimation's options (SPEC.md section 2): the last
            queries that vote, and the first keys (verticals) and token diagonals that top-k
            budgets always keep.
        top_p_forced: True: top-p budgets (mtrain.TopP) keep the num_sinks first keys and the
            window's token diagonals too, before any other candidate, whatever their mass (at
            most the caps in all); False (default): top-p forces nothing (SPEC.md section 2).

    Returns:
        The SparsePlan to pass as ``pattern=`` to mtrain.attention.
    """
    spec = _budgets_json(budgets, layer)
    world = _world(group)
    q3, cu, _ = _flatten(q, cu_seqlens, seq_len, world, "q")
    k3, _, _ = _flatten(k, None if q.ndim == 4 else cu_seqlens, seq_len, world, "k")
    _check_qkv(q3, k3, None)
    options = _options(
        int(q3.shape[-1]), group=group, layout=layout, ranks_per_node=ranks_per_node,
        granularity=granularity, softmax_scale=softmax_scale, backend=backend,
        deterministic=deterministic, pattern="estimate", budgets=spec, last_q=last_q,
        num_sinks=num_sinks, window=window, top_p_forced=top_p_forced,
    )  # fmt: skip
    handle = torch.ops.mtrain.estimate_plan(q3.detach(), k3.detach(), cu, options)
    return SparsePlan(handle, options)


class BlockReport(NamedTuple):
    """The per-head results of mtrain.select_blocks for one sequence
    (mtrain_block_report_t; tensors [Hq] on the CPU, the same on every rank)."""

    recall: torch.Tensor
    """float64: the share of the head's scored mass the selection keeps (SPEC.md
    section 9.4; precise with the LSE of dense attention: the pattern's recall of
    the attention mass). NaN for meanpool (its scores are logits)."""
    top_k: torch.Tensor
    """int32: the top-k budget the head got (top_k, or head-adaptive); -1 in top-p mode."""
    blocks: torch.Tensor
    """int64: the head's selected (query block, key block) pairs, forced ones included."""


def last_estimate_times() -> dict[str, float]:
    """Seconds of the parts of this thread's last pattern estimate (the C library's
    mtrain_estimate_last_times), for diagnostics: ``scores`` (``stages``: the backend's
    scoring; ``reduce``: combining over the ranks; ``copies``: the scores' copies to the host,
    0 when the backend selects) and ``select`` (the selection, with the pattern's copy back).
    The plan built after the estimate is not included. Eager calls estimate on the caller's
    thread; all zero before any estimate on this thread."""
    t = L.lib().estimate_last_times()
    return {name: float(getattr(t, name)) for name in ("scores", "select", "stages", "copies",
                                                        "reduce")}  # fmt: skip


def _int_option(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name}={value!r} must be an int")
    if not -(2**31) <= value < 2**31:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name}={value} is out of the int32 range")
    return int(value)


def _block_options(
    method: str,
    top_k: int | None,
    top_p: float | None,
    sink_blocks: int,
    local_blocks: int,
    stride: int,
    head_adaptive: bool,
    causal: bool = True,
) -> L.BlockOptions:
    """mtrain_block_options_t from select_blocks' arguments (the ranges are the
    library's checks: top_k >= 0, top_p in (0, 1], meanpool top-k only, ...)."""
    if not isinstance(method, str):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"method={method!r} must be 'antidiag', 'meanpool' or 'precise'",
        )
    m = ctypes.c_int()
    L.check(L.lib().block_method_parse(method.encode(), ctypes.byref(m)), "select_blocks")
    if (top_k is None) == (top_p is None):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            "select_blocks: give exactly one of top_k= (key blocks kept per query block "
            f"besides the forced ones) and top_p= (the share of each query block's scored "
            f"mass to reach); got top_k={top_k!r}, top_p={top_p!r}",
        )
    o = L.BlockOptions()
    o.method = m.value
    if top_k is not None:
        o.kind, o.top_k, o.top_p = L.BUDGET_TOP_K, _int_option("top_k", top_k), 0.0
    else:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"top_p={top_p!r} must be a float in (0, 1]")
        o.kind, o.top_k, o.top_p = L.BUDGET_TOP_P, 0, float(top_p)
    o.sink_blocks = _int_option("sink_blocks", sink_blocks)
    o.local_blocks = _int_option("local_blocks", local_blocks)
    o.stride = _int_option("stride", stride)
    if not isinstance(head_adaptive, bool):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"head_adaptive={head_adaptive!r} must be a bool")
    o.head_adaptive = 1 if head_adaptive else 0
    if not isinstance(causal, bool):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"causal={causal!r} must be a bool")
    o.noncausal = 0 if causal else 1
    return o


def _flatten_lse(
    lse: torch.Tensor, q: torch.Tensor, q3: torch.Tensor, batched: tuple[int, ...] | None
) -> torch.Tensor:
    """lse [T, Hq] (or [B, N, Hq] for batched q) -> [T, Hq], checked against q."""
    if not isinstance(lse, torch.Tensor):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"lse is not a tensor ({type(lse).__name__})")
    want = tuple(q.shape[:-1])
    if tuple(lse.shape) != want:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"lse has shape {tuple(lse.shape)}: expected {list(want)} (q's shape without "
            "head_dim; what attention(..., return_lse=True) returns)",
        )
    if lse.dtype not in (torch.float32, torch.float64):
        raise L.fail(L.ERR_UNSUPPORTED_DTYPE, f"lse is {lse.dtype}: float32 or float64")
    if lse.device != q.device:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"lse is on {lse.device} but q is on {q.device}")
    if not lse.is_contiguous():
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"lse is not contiguous (shape {tuple(lse.shape)}, strides {lse.stride()}): call "
            ".contiguous()",
        )
    return lse.detach().reshape(q3.shape[0], q3.shape[1]) if batched else lse.detach()


@torch.compiler.disable
def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    method: str = "antidiag",
    top_k: int | None = None,
    top_p: float | None = None,
    lse: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    group: Any = None,
    layout: str = "striped",
    ranks_per_node: int = 0,
    seq_len: int | None = None,
    granularity: int = 128,
    softmax_scale: float | None = None,
    backend: str | None = None,
    deterministic: bool = True,
    sink_blocks: int = 1,
    local_blocks: int = 1,
    stride: int = 8,
    head_adaptive: bool = False,
    causal: bool = True,
    report: bool = False,
) -> Any:
    """Selects a block-sparse pattern of every sequence from post-RoPE q and k
    (docs/SPEC.md section 9): every head a block mask of (query block, key
    block) pairs, scored by one of three methods and kept by top-k or top-p.

    Args:
        q, k: [T, Hq, d] and [T, Hkv, d] (or [B, N, H, d]); detached (no gradient
            flows through the selection). float32, bfloat16, float16 (float64 on the
            CPU: the cpu-ref backend); CPU tensors score on the CPU, CUDA tensors on
            the GPU (the selection itself is host code: one synchronisation per call).
        method: "antidiag" (XAttention-style strided antidiagonal sums, softmaxed per
            strided row), "meanpool" (MoBA-style mean query . mean key; top-k only) or
            "precise" (AdaSpa-style exact block masses from ``lse=``).
        top_k: key blocks kept per query block besides the forced ones.
        top_p: the share of each query block's scored mass to reach, forced blocks
            counted, in (0, 1]. Exactly one of top_k and top_p.
        lse: method "precise" only: the forward's log-sum-exp, [T, Hq] (or [B, N, Hq];
            under a group this rank's slots), float32 or float64, as
            ``attention(..., return_lse=True)`` returns it; the LSE of dense
            attention makes the masses exact shares.
        cu_seqlens: FlashAttention offsets of packed sequences (global under a group).
        group: a torch.distributed process group: context parallel (collective; every
            rank gets the same patterns, bitwise those of one process).
        layout, ranks_per_node, seq_len: the layout of the local tensors (as
            estimate_pattern; ``**info.attention_kwargs()`` of mtrain.dispatch).
        granularity: the block size G (the patterns').
        softmax_scale: the scale of the logits (default 1/sqrt(d)).
        backend: "cpu", "cpu-ref", "cuda" (default: by device and dtype).
        sink_blocks: key blocks [0, sink_blocks) forced in every query block.
        local_blocks: key blocks (qb - local_blocks, qb] forced in (1: the diagonal
            block, always in).
        stride: antidiag: the stride S, a divisor of the granularity.
        head_adaptive: top-k with antidiag or precise: share the budget Hq * top_k
            between the heads so that the sum of their recalls is largest.
        causal: True (the default): key blocks kb <= qb only, scores over the causal
            pairs, a causal pattern. False: bidirectional (SPEC.md 9.7): every key
            block is scored over all its keys and is a candidate, local_blocks forces
            |kb - qb| < local_blocks, and the patterns are non-causal (selected and
            run on every backend, "cuda" included). For precise, give the LSE of
            non-causal attention.
        report: also return the per-head report of every sequence.

    Returns:
        A list with one mtrain.Pattern per sequence (pass it as ``pattern=`` to
        mtrain.attention, with the same granularity); with report=True the pair
        (patterns, reports), reports a list of BlockReport.
    """
    world = _world(group)
    q3, cu, batched = _flatten(q, cu_seqlens, seq_len, world, "q")
    k3, _, _ = _flatten(k, None if q.ndim == 4 else cu_seqlens, seq_len, world, "k")
    if k.ndim != q.ndim:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH, f"q and k have {q.ndim} and {k.ndim} dimensions: they must agree"
        )
    _check_qkv(q3, k3, None)
    _check_cu(cu)
    options = _block_options(
        method, top_k, top_p, sink_blocks, local_blocks, stride, head_adaptive, causal
    )
    lse2 = None
    if options.method == L.BLOCK_PRECISE:
        if lse is None:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                "method='precise' needs lse= (the forward's log-sum-exp [T, Hq], e.g. "
                "attention(q, k, v, return_lse=True)[1])",
            )
        lse2 = _flatten_lse(lse, q, q3, batched)
    elif lse is not None:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT, f"lse= is read by method='precise' only, not {method!r}"
        )
    opts = C.decode_options(
        _options(
            int(q3.shape[-1]), group=group, layout=layout, ranks_per_node=ranks_per_node,
            granularity=granularity, softmax_scale=softmax_scale, backend=backend,
            deterministic=deterministic, pattern="blocks",
        )
    )  # fmt: skip
    ctx = C.context(opts, q3.device, q3.dtype)
    seq_lens = C.seq_lens_of(cu, int(q3.shape[0]), ctx.world)
    layouts = (
        [C.layout(opts.layout, n, opts.granularity, ctx.world) for n in seq_lens]
        if ctx.world > 1
        else None
    )
    with torch.no_grad():
        patterns, reports = C.select_blocks(
            ctx, q3.detach(), k3.detach(), lse2, seq_lens, layouts, options, report
        )
    if not report:
        return patterns
    assert reports is not None
    return patterns, [BlockReport(*r) for r in reports]


def _seq_lengths(tokens: int, cu: torch.Tensor | None) -> list[int]:
    """The lengths of the packed sequences of a single-rank call."""
    if cu is None:
        return [tokens]
    offsets = [int(x) for x in cu.detach().cpu().tolist()]
    return [b - a for a, b in itertools.pairwise(offsets)]


@functools.lru_cache(maxsize=64)
def _pattern_file(path: str, mtime: float) -> C.Pattern:
    del mtime  # part of the key: a rewritten file is read again
    return C.load_pattern(path)


def _as_patterns(pattern: Any, seq_len: int, granularity: int) -> list[C.Pattern]:
    if isinstance(pattern, C.Pattern):
        return [pattern]
    if isinstance(pattern, (str, os.PathLike)):
        p = Path(pattern).resolve()
        return [_pattern_file(str(p), p.stat().st_mtime if p.exists() else 0.0)]
    if isinstance(pattern, torch.Tensor):
        return [C.block_mask_pattern(pattern, seq_len, granularity)]
    if (
        isinstance(pattern, (list, tuple))
        and pattern
        and all(isinstance(p, C.Pattern) for p in pattern)
    ):
        return list(pattern)
    raise L.fail(
        L.ERR_INVALID_ARGUMENT,
        "pattern= must be None (dense, or estimated with budgets=), an mtrain.Pattern, a list "
        "of them (one per sequence), a pattern JSON path, a bool block mask [H, nb, nb] or the "
        f"SparsePlan of mtrain.estimate_pattern; got {type(pattern).__name__}",
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Any = None,
    group: Any = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    budgets: Any = None,
    layer: int | None = None,
    layout: str = "striped",
    ranks_per_node: int = 0,
    seq_len: int | None = None,
    granularity: int | None = None,
    softmax_scale: float | None = None,
    backend: str | None = None,
    deterministic: bool = True,
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
    top_p_forced: bool = False,
    return_lse: bool = False,
    dense_above: float | str | None = None,
    dense_recheck: int = 1,
) -> Any:
    """Causal sparse attention (docs/SPEC.md section 1), differentiable in q, k, v.

    Args:
        q: [T, Hq, d] packed or [B, N, Hq, d] batched; bfloat16, float16, float32
            (float64 on the CPU: the cpu-ref oracle). Contiguous.
        k, v: [T, Hkv, d] or [B, N, Hkv, d], Hq a multiple of Hkv (GQA).
        pattern: what is computed: None (dense causal; or estimated now when
            ``budgets=`` is given), the SparsePlan of mtrain.estimate_pattern, an
            mtrain.Pattern (or one per sequence), a pattern JSON path, or a bool
            block mask [Hq, nb, nb].
        group: a torch.distributed process group (gloo, CPU tensors) for context
            parallel: q, k, v are this rank's slots (mtrain.dispatch); collective.
        cu_seqlens: FlashAttention offsets of packed sequences (global under a group).
        budgets, layer: estimate the pattern online (see estimate_pattern).
        last_q, num_sinks, window, top_p_forced: the estimate's options (see
            estimate_pattern; with budgets= only).
        layout, ranks_per_node, seq_len: the context-parallel layout and ring.
        granularity: block size G (default: the pattern's, else 128).
        softmax_scale: default 1/sqrt(d).
        backend: "cpu", "cpu-ref", "cuda" (default: by device and dtype).
        deterministic: bitwise reproducible backward (docs/USAGE.md).
        return_lse: also return the log-sum-exp [T, Hq] (or [B, N, Hq]).
        dense_above: the dense fallback (mtrain.fallback): when the estimated pattern
            (``budgets=``, or a SparsePlan) computes more than this share of the causal
            pairs, torch's scaled_dot_product_attention runs instead and the call logs it
            (logger "mtrain"). "auto": the threshold measured for the device (CUDA; never
            on the CPU). None (default): always the sparse kernels. One rank, without
            return_lse, outside torch.compile only.
        dense_recheck: with ``budgets=`` and ``layer=``, a layer found too dense runs dense
            for its next dense_recheck - 1 calls without estimating (1: estimate every call);
            on a GPU, where the plan is built on the device and its density is read back
            with a wait, a layer found sparse keeps the sparse kernels for its next
            dense_recheck - 1 calls without that read.

    Returns:
        o shaped like q (and lse when return_lse).
    """
    world = _world(group)
    q3, cu, batched = _flatten(q, cu_seqlens, seq_len, world, "q")
    k3, _, _ = _flatten(k, None if q.ndim == 4 else cu_seqlens, seq_len, world, "k")
    v3, _, _ = _flatten(v, None if q.ndim == 4 else cu_seqlens, seq_len, world, "v")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"q, k, v have {q.ndim}, {k.ndim}, {v.ndim} dimensions: they must agree",
        )
    _check_qkv(q3, k3, v3)
    threshold = None
    if (
        dense_above is not None
        and (isinstance(pattern, SparsePlan) or budgets is not None)
        and world == 1
        and not return_lse
        and not _is_compiling()
    ):
        threshold = _fallback.resolve_dense_above(dense_above, q3.device)
    recheck = _fallback.check_recheck(dense_recheck)
    sticky_key = None
    if threshold is not None and budgets is not None and layer is not None and recheck > 1:
        sticky_key = (layer, _budgets_json(budgets, layer), tuple(q3.shape), tuple(k3.shape),
                      q3.device, None if cu is None else tuple(_seq_lengths(0, cu)))  # fmt: skip
        if _fallback.still_dense(sticky_key):
            o = _fallback.dense_attention(
                q3, k3, v3, _seq_lengths(int(q3.shape[0]), cu), softmax_scale
            )
            return o.view(q.shape) if batched is not None else o
    if isinstance(pattern, SparsePlan):
        if budgets is not None:
            raise L.fail(L.ERR_INVALID_ARGUMENT, "pattern= is a SparsePlan: budgets= must be None")
        handle = pattern.handle
    else:
        common = {
            "group": group,
            "layout": layout,
            "ranks_per_node": ranks_per_node,
            "softmax_scale": softmax_scale,
            "backend": backend,
            "deterministic": deterministic,
        }
        if pattern is None and budgets is not None:
            plan = estimate_pattern(
                q3, k3, budgets, layer, cu_seqlens=cu, granularity=granularity or 128,
                last_q=last_q, num_sinks=num_sinks, window=window, top_p_forced=top_p_forced,
                **common,
            )  # fmt: skip
            handle = plan.handle
        elif pattern is None:
            opts = _options(
                int(q3.shape[-1]), granularity=granularity or 128, pattern="dense", **common
            )
            handle = torch.ops.mtrain.pattern_plan(q3, [], cu, opts)
        else:
            if budgets is not None:
                raise L.fail(L.ERR_INVALID_ARGUMENT, "give pattern= or budgets=, not both")
            n = int(batched[1]) * world if batched else int(q3.shape[0]) * world
            if seq_len is not None:
                n = seq_len
            elif cu is not None and batched is None:
                # packed: the global offsets give the length (under a group the local
                # slots times the world include the layout's padding)
                n = int(cu[-1])
            pats = _as_patterns(pattern, n, granularity or 128)
            g = pats[0].granularity
            if granularity is not None and granularity != g:
                raise L.fail(
                    L.ERR_INVALID_ARGUMENT,
                    f"granularity={granularity} but the pattern's granularity is {g}",
                )
            opts = _options(int(q3.shape[-1]), granularity=g, pattern="given", **common)
            handle = torch.ops.mtrain.pattern_plan(q3, [p.handle for p in pats], cu, opts)
    plan_obj = C.resolve_plan(handle) if threshold is not None else None
    held_sparse = (
        plan_obj is not None
        and sticky_key is not None
        and plan_obj.on_device
        and _fallback.still_sparse(sticky_key)
    )
    if plan_obj is not None and plan_obj.causal and not held_sparse:
        # (the fallback's SDPA is causal: a non-causal plan never falls back; a plan built on
        # the GPU that was found sparse keeps the sparse kernels for dense_recheck - 1 calls
        # without reading its density back, which would wait for the GPU)
        lengths = _seq_lengths(int(q3.shape[0]), cu)
        density = plan_obj.computed_pairs / _fallback.causal_pairs(lengths, int(q3.shape[1]))
        dense = _fallback.choose_dense(density, threshold, layer)
        if sticky_key is not None:
            _fallback.remember(sticky_key, dense, recheck, hold_sparse=plan_obj.on_device)
        if dense:
            o = _fallback.dense_attention(q3, k3, v3, lengths, softmax_scale)
            return o.view(q.shape) if batched is not None else o
    o, lse = torch.ops.mtrain.attn_fwd(q3, k3, v3, handle)
    if batched is not None:
        o = o.view(q.shape)
        lse = lse.view(*batched, lse.shape[-1])
    return (o, lse) if return_lse else o
