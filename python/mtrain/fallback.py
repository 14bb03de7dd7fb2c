"""The dense fallback: when an estimated pattern is too dense for the sparse kernels to pay,
mtrain.attention runs torch's own dense attention (scaled_dot_product_attention, causal,
whichever backend torch picks: cuDNN or FlashAttention on the GPU) instead, and says so.

The decision is taken after the estimate, from the plan's density (computed pairs over causal
pairs): a layer whose density is above ``dense_above`` runs dense. "auto" takes the threshold
measured for the device (docs/PERFORMANCE.md: on an H100 at 131072 tokens the sparse forward +
backward of the Qwen2.5-3B layers is slower than cuDNN's dense one above a density of 0.55),
and never falls back on the CPU. With ``dense_recheck=R`` a layer found too dense runs dense
for its next R - 1 calls without estimating (the estimate is what a dense layer still pays),
then estimates again. Only single-rank calls without ``return_lse`` fall back (the
ring has no dense peer here; SDPA returns no log-sum-exp), and not while torch.compile traces
(the decision reads the plan on the host).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.nn.functional as F

from . import _lib as L

__all__ = ["AUTO_DENSE_ABOVE_CUDA", "dense_fallback_counts", "resolve_dense_above"]

_log = logging.getLogger("mtrain")

# Density above which the dense peer is faster on the GPU (measured on an H100, 2026-11-25,
# tools/bench_model.py; docs/PERFORMANCE.md "The whole model's attention step").
AUTO_DENSE_ABOVE_CUDA = 0.55

_counts = {"sparse": 0, "dense": 0, "estimates_skipped": 0}
# dense_recheck: the calls of a (layer, budgets, shape) that still run dense without estimating
_sticky: dict[Any, int] = {}
_sticky_sparse: dict[Any, int] = {}  # sparse decisions held for plans built on the GPU


def dense_fallback_counts(reset: bool = False) -> dict[str, int]:
    """How many mtrain.attention calls with a fallback threshold ran sparse, how many ran the
    dense peer, and how many of those skipped the estimate (dense_recheck), since the start or
    the last reset. reset=True also forgets the layers' dense decisions."""
    out = dict(_counts)
    if reset:
        for name in _counts:
            _counts[name] = 0
        _sticky.clear()
        _sticky_sparse.clear()
    return out


def check_recheck(dense_recheck: Any) -> int:
    if isinstance(dense_recheck, bool) or not isinstance(dense_recheck, int) or dense_recheck < 1:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"dense_recheck={dense_recheck!r}: give the number of calls a dense decision lasts "
            "(an int >= 1; 1: estimate at every call)",
        )
    return dense_recheck


def still_dense(key: Any) -> bool:
    """True (and counted) when an earlier dense decision for `key` still holds: the call runs
    dense without estimating."""
    left = _sticky.get(key, 0)
    if left <= 0:
        return False
    _sticky[key] = left - 1
    _counts["dense"] += 1
    _counts["estimates_skipped"] += 1
    return True


def still_sparse(key: Any) -> bool:
    """True (and counted) when an earlier sparse decision for `key` still holds: the call
    runs the sparse kernels without reading its plan's density back from the GPU."""
    left = _sticky_sparse.get(key, 0)
    if left <= 0:
        return False
    _sticky_sparse[key] = left - 1
    _counts["sparse"] += 1
    return True


def remember(key: Any, dense: bool, recheck: int, hold_sparse: bool = False) -> None:
    """A decision for `key`: dense ones hold for the next recheck - 1 calls; with hold_sparse
    (a plan built on the GPU, whose density is read back with a wait) sparse ones too."""
    _sticky.pop(key, None)
    _sticky_sparse.pop(key, None)
    if recheck > 1 and dense:
        _sticky[key] = recheck - 1
    elif recheck > 1 and hold_sparse:
        _sticky_sparse[key] = recheck - 1


def resolve_dense_above(dense_above: Any, device: torch.device) -> float | None:
    """The threshold for tensors on ``device``: None (never fall back), a density in [0, 1]
    or "auto"."""
    if dense_above is None:
        return None
    if isinstance(dense_above, str):
        if dense_above != "auto":
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"dense_above={dense_above!r}: give a density in [0, 1], 'auto' or None",
            )
        return AUTO_DENSE_ABOVE_CUDA if device.type == "cuda" else None
    if isinstance(dense_above, bool) or not isinstance(dense_above, (int, float)):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"dense_above must be a density in [0, 1], 'auto' or None; got "
            f"{type(dense_above).__name__}",
        )
    x = float(dense_above)
    if not 0.0 <= x <= 1.0:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"dense_above={x}: a density lies in [0, 1]")
    return x


def causal_pairs(lengths: list[int], heads: int) -> int:
    """(query, key) pairs of causal attention over sequences of these lengths."""
    return heads * sum(n * (n + 1) // 2 for n in lengths)


def choose_dense(density: float, threshold: float, layer: int | None) -> bool:
    """True (and logged) when the pattern's density is above the threshold."""
    dense = density > threshold
    _counts["dense" if dense else "sparse"] += 1
    if dense:
        _log.info(
            "mtrain: layer %s: pattern density %.3f > dense_above %.2f: the dense attention of "
            "torch runs instead of the sparse kernels",
            "?" if layer is None else layer,
            density,
            threshold,
        )
    return dense


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of packed [T, H, d] q, k, v (sequences of these lengths, in order)
    by torch's scaled_dot_product_attention; the result is [T, Hq, d]."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    with _prefer_cudnn(q.device):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1).unsqueeze(0),
                k[sl].transpose(0, 1).unsqueeze(0),
                v[sl].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
            if o.requires_grad:
                o.register_hook(_strides_like(o))
            outs.append(o.squeeze(0).transpose(0, 1))
            start += n
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs, 0)


def _strides_like(out: torch.Tensor) -> Any:
    """A gradient hook giving SDPA's backward its output's gradient with the output's own
    strides: cuDNN's backward reads dO in O's layout, and a dO of other strides gave wrong
    gradients on an H100 (torch 2.11; measured 2026-11-25, tests/python/test_cuda.py)."""
    shape, strides = out.shape, out.stride()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == strides:
            return grad
        return torch.empty_strided(shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)

    return hook


def _prefer_cudnn(device: torch.device) -> Any:
    """On the GPU, torch's SDPA backends in the order cuDNN, FlashAttention, memory-efficient,
    math (cuDNN's was the fastest dense attention measured here, docs/PERFORMANCE.md); torch
    skips those that cannot run the call. On the CPU: torch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # a torch without set_priority: its own order among these
        return sdpa_kernel(order)
