"""mtrain's torch.library ops (namespace ``mtrain``).

- ``mtrain::estimate_plan(q, k, cu_seqlens, options) -> plan``: estimates the
  vertical-slash pattern of every sequence from q and k (post-RoPE) and builds
  the plan of the step (collective over the group when there is one).
- ``mtrain::pattern_plan(q, patterns, cu_seqlens, options) -> plan``: the plan
  of given patterns (one per sequence, or one for all) or of the dense
  pattern (cached: the same patterns give the same plan).
- ``mtrain::attn_fwd(q, k, v, plan) -> (o, lse)`` and
  ``mtrain::attn_bwd(dout, q, k, v, o, lse, plan) -> (dq, dk, dv)``: sparse
  attention over the plan; attn_fwd is differentiable (its backward calls
  attn_bwd).

A plan is an int64 handle tensor [3] on the CPU (mtrain._core); ``options``
is a JSON string (mtrain._core.Options). Tensors are token-major and packed:
q [T, Hq, d], k and v [T, Hkv, d], lse [T, Hq] float32 (float64 for float64
inputs). Every op has a fake (meta) implementation, so torch.compile traces
them without graph breaks.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import _core as C
from . import _lib as L

_CPU_CUDA = ("cpu", "cuda")


# ---------------------------------------------------------------------------
# checks at the boundary
# ---------------------------------------------------------------------------


def _check_tensor(t: torch.Tensor, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name} is not a tensor ({type(t).__name__})")
    if t.ndim != ndim:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"{name} has shape {tuple(t.shape)}: expected {ndim} dimensions "
            + ("[tokens, heads, head_dim]" if ndim == 3 else "[tokens, heads]"),
        )
    if t.device.type not in _CPU_CUDA:
        raise L.fail(L.ERR_NOT_SUPPORTED, f"{name} is on device {t.device}: cpu or cuda only")
    if not t.is_contiguous():
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): mtrain "
            "takes dense row-major tensors; call .contiguous()",
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """The checks of q [T, Hq, d], k and v [T, Hkv, d]."""
    _check_tensor(q, "q", 3)
    _check_tensor(k, "k", 3)
    tensors = [("q", q), ("k", k)]
    if v is not None:
        _check_tensor(v, "v", 3)
        tensors.append(("v", v))
    for name, t in tensors:
        C.mtrain_dtype(t.dtype)
        if t.dtype != q.dtype:
            raise L.fail(L.ERR_UNSUPPORTED_DTYPE, f"{name} is {t.dtype} but q is {q.dtype}")
        if t.device != q.device:
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name} is on {t.device} but q is on {q.device}")
    if q.dtype == torch.float64 and q.device.type != "cpu":
        raise L.fail(L.ERR_UNSUPPORTED_DTYPE, "float64 runs on the CPU only (the cpu-ref oracle)")
    if k.shape[0] != q.shape[0] or (v is not None and v.shape[0] != q.shape[0]):
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"q, k, v have {q.shape[0]}, {k.shape[0]}, "
            f"{v.shape[0] if v is not None else '-'} tokens: they must agree",
        )
    if v is not None and v.shape[1:] != k.shape[1:]:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH, f"k is {tuple(k.shape)} but v is {tuple(v.shape)}: must agree"
        )
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    if hkv == 0 or hq % hkv != 0:
        raise L.fail(
            L.ERR_HEAD_MISMATCH,
            f"q has {hq} heads and k/v {hkv}: the query heads must be a multiple of the kv heads",
        )
    if k.shape[2] != q.shape[2]:
        raise L.fail(L.ERR_SHAPE_MISMATCH, f"q has head_dim {q.shape[2]} but k has {k.shape[2]}")
    if q.shape[0] == 0:
        raise L.fail(L.ERR_INVALID_ARGUMENT, "q has no tokens")


def check_cu(cu_seqlens: torch.Tensor | None) -> None:
    if cu_seqlens is None:
        return
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"cu_seqlens must be a 1-d int32 or int64 tensor, got {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)}",
        )


def _plan_ctx(plan: C.Plan, q: torch.Tensor) -> C.Context:
    ctx = plan.ctx
    if ctx.device.type != q.device.type or (
        q.device.type == "cuda" and ctx.device.index != q.device.index
    ):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"the plan was built for {ctx.device} but the tensors are on {q.device}",
        )
    if plan.local_tokens != q.shape[0]:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"q has {q.shape[0]} tokens but the plan has {plan.local_tokens} (the plan belongs to "
            "another batch)",
        )
    if plan.num_heads != q.shape[1]:
        raise L.fail(
            L.ERR_HEAD_MISMATCH, f"q has {q.shape[1]} heads but the plan has {plan.num_heads}"
        )
    return ctx


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------


@torch.library.custom_op("mtrain::estimate_plan", mutates_args=(), device_types=_CPU_CUDA)
def estimate_plan(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, options: str
) -> torch.Tensor:
    """Online vertical-slash estimation (docs/SPEC.md section 2) and the plan."""
    opts = C.decode_options(options)
    check_qkv(q, k, None)
    check_cu(cu_seqlens)
    ctx = C.context(opts, q.device, q.dtype)
    seq_lens = C.seq_lens_of(cu_seqlens, int(q.shape[0]), ctx.world)
    plan = C.build_plan(ctx, opts, int(q.shape[0]), int(q.shape[1]), seq_lens, None, q, k)
    return C.register_plan(plan)


@estimate_plan.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, options: str
) -> torch.Tensor:
    return torch.empty(3, dtype=torch.int64, device="cpu")


@torch.library.custom_op("mtrain::pattern_plan", mutates_args=(), device_types=_CPU_CUDA)
def pattern_plan(
    q: torch.Tensor, patterns: list[torch.Tensor], cu_seqlens: torch.Tensor | None, options: str
) -> torch.Tensor:
    """The plan of given patterns (handles; [] with options pattern "dense": dense)."""
    opts = C.decode_options(options)
    _check_tensor(q, "q", 3)
    C.mtrain_dtype(q.dtype)
    check_cu(cu_seqlens)
    ctx = C.context(opts, q.device, q.dtype)
    seq_lens = C.seq_lens_of(cu_seqlens, int(q.shape[0]), ctx.world)
    pats = [C.resolve_pattern(h) for h in patterns] if opts.pattern == "given" else None
    if pats is not None and not pats:
        raise L.fail(L.ERR_INVALID_ARGUMENT, "no pattern given")
    plan = C.cached_plan(ctx, opts, int(q.shape[0]), int(q.shape[1]), seq_lens, pats)
    return C.register_plan(plan)


@pattern_plan.register_fake
def _(
    q: torch.Tensor, patterns: list[torch.Tensor], cu_seqlens: torch.Tensor | None, options: str
) -> torch.Tensor:
    return torch.empty(3, dtype=torch.int64, device="cpu")


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


def _refuse_graph_capture(t: torch.Tensor, what: str) -> None:
    """mtrain's calls upload the plan's step tables from host staging
    buffers that later calls reuse (a replayed graph would read another
    call's tables), and the estimate reads scores back: refuse capture with a
    clear error instead of a wrong replay or a CUDA error inside it."""
    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise L.fail(
            L.ERR_NOT_SUPPORTED,
            f"mtrain {what}: the current CUDA stream is capturing a CUDA graph; mtrain's calls "
            "copy their plan's step tables from host buffers that later calls reuse (a replay "
            "would read another call's tables), and the estimate reads its scores back to the "
            "host (run the attention outside the captured region)",
        )


@torch.library.custom_op("mtrain::attn_fwd", mutates_args=(), device_types=_CPU_CUDA)
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward over the plan: (o [T, Hq, d], lse [T, Hq])."""
    check_qkv(q, k, v)
    _refuse_graph_capture(q, "attention forward")
    p = C.resolve_plan(plan)
    ctx = _plan_ctx(p, q)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=_lse_dtype(q.dtype), device=q.device)
    qd, kd, vd = C.descriptor(q), C.descriptor(k), C.descriptor(v)
    od, ld = C.descriptor(o), _lse_descriptor(lse)
    ctx.bind_stream()
    with C._device_guard(q.device):
        st = L.lib().attention_forward(
            ctx.ptr, p.ptr, ctypes.byref(qd), ctypes.byref(kd), ctypes.byref(vd),
            ctypes.byref(od), ctypes.byref(ld),
        )  # fmt: skip
    L.check(st, "mtrain attention forward")
    return o, lse


@attn_fwd.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[1]), dtype=_lse_dtype(q.dtype))
    return o, lse


@torch.library.custom_op("mtrain::attn_bwd", mutates_args=(), device_types=_CPU_CUDA)
def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    plan: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention backward over the plan: (dq, dk, dv)."""
    check_qkv(q, k, v)
    _refuse_graph_capture(q, "attention backward")
    _check_tensor(o, "o", 3)
    _check_tensor(dout, "dout", 3)
    _check_tensor(lse, "lse", 2)
    for name, t in (("o", o), ("dout", dout)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{name} is {t.dtype} {tuple(t.shape)} on {t.device}; it must match q "
                f"({q.dtype} {tuple(q.shape)} on {q.device})",
            )
    if tuple(lse.shape) != tuple(q.shape[:2]) or lse.dtype != _lse_dtype(q.dtype):
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"lse is {lse.dtype} {tuple(lse.shape)}; expected {_lse_dtype(q.dtype)} "
            f"{tuple(q.shape[:2])}",
        )
    p = C.resolve_plan(plan)
    ctx = _plan_ctx(p, q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ds = [C.descriptor(t) for t in (q, k, v, o)]
    ld = _lse_descriptor(lse)
    gd = C.descriptor(dout)
    outs = [C.descriptor(t) for t in (dq, dk, dv)]
    ctx.bind_stream()
    with C._device_guard(q.device):
        st = L.lib().attention_backward(
            ctx.ptr, p.ptr, *[ctypes.byref(d) for d in ds], ctypes.byref(ld), ctypes.byref(gd),
            *[ctypes.byref(d) for d in outs],
        )  # fmt: skip
    L.check(st, "mtrain attention backward")
    return dq, dk, dv


@attn_bwd.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    plan: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse_descriptor(lse: torch.Tensor) -> L.Tensor:
    d = L.Tensor()
    d.data = lse.data_ptr()
    d.dtype = L.F64 if lse.dtype == torch.float64 else L.F32
    d.ndim = 2
    d.shape[0], d.shape[1] = int(lse.shape[0]), int(lse.shape[1])
    return d


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    q, k, v, plan = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, plan)
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, grad_o: torch.Tensor, grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, o, lse, plan = ctx.saved_tensors
    dq, dk, dv = torch.ops.mtrain.attn_bwd(grad_o.contiguous(), q, k, v, o, lse, plan)
    return dq, dk, dv, None


torch.library.register_autograd("mtrain::attn_fwd", _backward, setup_context=_setup_context)
