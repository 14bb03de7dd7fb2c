"""mtrain's objects on the Python side: patterns, budgets, contexts and plans.

A plan (mtrain_plan_t) is what the forward and the backward of one step
share. The torch ops cannot take Python objects, so plans and patterns are
named by small int64 "handle" tensors ([MAGIC, id] on the CPU) that travel
through the ops (and through torch.compile graphs) as ordinary tensors; the
registry here maps them back. A plan lives as long as its handle tensor (the
autograd graph keeps it for the backward); a pattern as long as its Pattern
object.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import itertools
import json
import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import _lib as L
from .errors import MtrainError

MAGIC = 0x6D747261  # "mtra"
KIND_PLAN = 1
KIND_PATTERN = 2

_ids = itertools.count(1)
_plans: dict[int, list[Any]] = {}  # plan id -> [Plan, live handle tensors]
_plans_by_key: dict[tuple[Any, ...], int] = {}  # estimated plans by content
_patterns: weakref.WeakValueDictionary[int, Pattern] = weakref.WeakValueDictionary()
_lock = threading.RLock()  # RLock: a handle finalizer may run inside


def _handle_tensor(kind: int, i: int) -> torch.Tensor:
    return torch.tensor([MAGIC, kind, i], dtype=torch.int64)


def _handle_id(handle: torch.Tensor, kind: int, what: str) -> int:
    if (
        not isinstance(handle, torch.Tensor)
        or handle.dtype != torch.int64
        or handle.device.type != "cpu"
        or tuple(handle.shape) != (3,)
    ):
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{what} is not an mtrain handle tensor")
    magic, k, i = (int(x) for x in handle.tolist())
    if magic != MAGIC or k != kind:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{what} is not an mtrain handle of this kind")
    return i


# ---------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------


class Pattern:
    """A sparse pattern of one sequence (mtrain_pattern_t, docs/SPEC.md section 1):
    per query head either block diagonals plus vertical key positions, or a
    block mask. Immutable once built; pass it as ``pattern=`` to
    mtrain.attention."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ctypes.c_void_p(ptr)
        self.id = next(_ids)
        self._handle: torch.Tensor | None = None

    @property
    def handle(self) -> torch.Tensor:
        """The handle tensor that names this pattern to the torch ops (made, and
        the pattern registered for resolve_pattern, on first use: a packed
        batch's estimate makes a pattern per document, and most never reach an
        op)."""
        if self._handle is None:
            _patterns[self.id] = self
            self._handle = _handle_tensor(KIND_PATTERN, self.id)
        return self._handle

    def __del__(self) -> None:
        ptr = getattr(self, "_ptr", None)
        if ptr is not None and ptr.value and L._lib is not None:
            L.lib().pattern_destroy(ptr)
            self._ptr = ctypes.c_void_p(0)

    @property
    def ptr(self) -> ctypes.c_void_p:
        """The mtrain_pattern_t pointer (borrowed)."""
        return self._ptr

    @property
    def seq_len(self) -> int:
        return int(L.lib().pattern_seq_len(self._ptr))

    @property
    def num_heads(self) -> int:
        return int(L.lib().pattern_num_heads(self._ptr))

    @property
    def granularity(self) -> int:
        return int(L.lib().pattern_granularity(self._ptr))

    @property
    def num_blocks(self) -> int:
        return int(L.lib().pattern_num_blocks(self._ptr))

    @property
    def causal(self) -> bool:
        """False for a non-causal pattern (block_mask_pattern(..., causal=False))."""
        return bool(L.lib().pattern_is_causal(self._ptr))

    def is_block_mask(self, head: int) -> bool:
        """True when head `head` is in block-mask form."""
        self._check_head(head)
        return bool(L.lib().pattern_head_is_block_mask(self._ptr, head))

    def head(self, head: int) -> tuple[list[int], list[int]]:
        """(block diagonals, vertical positions) of a vertical-slash head."""
        self._check_head(head)
        dp = ctypes.POINTER(ctypes.c_int32)()
        vp = ctypes.POINTER(ctypes.c_int64)()
        nd, nv = ctypes.c_int32(), ctypes.c_int32()
        L.check(
            L.lib().pattern_get_head(
                self._ptr, head, ctypes.byref(dp), ctypes.byref(nd), ctypes.byref(vp),
                ctypes.byref(nv),
            )
        )  # fmt: skip
        return [dp[i] for i in range(nd.value)], [vp[i] for i in range(nv.value)]

    def count_pairs(self, head: int) -> int:
        """Allowed (query, key) pairs of a head."""
        self._check_head(head)
        return int(L.lib().pattern_count_pairs(self._ptr, head))

    def density(self) -> float:
        """Allowed pairs over the dense pairs (causal: N (N + 1) / 2; non-causal:
        N^2), averaged over heads."""
        n = self.seq_len
        dense = n * (n + 1) // 2 if self.causal else n * n
        return sum(self.count_pairs(h) for h in range(self.num_heads)) / (dense * self.num_heads)

    def block_mask(self, head: int) -> torch.Tensor:
        """The (query block, key block) pairs of a block-mask head as a bool
        tensor [nb, nb] (one library call per causal block pair)."""
        self._check_head(head)
        if not self.is_block_mask(head):
            raise L.fail(
                L.ERR_INVALID_ARGUMENT, f"head {head} is a vertical-slash head, not a block mask"
            )
        n, g, nb = self.seq_len, self.granularity, self.num_blocks
        allowed = L.lib().pattern_allowed
        blocks = torch.zeros(nb, nb, dtype=torch.bool)
        for a in range(nb):
            i = min(a * g, n - 1)
            for b in range(a + 1 if self.causal else nb):
                # the first query of block a sees the first key of block b exactly when the
                # pair is in the mask (causal: b <= a, so that key is not after the query)
                blocks[a, b] = bool(allowed(self._ptr, head, i, b * g))
        return blocks

    def mask(self) -> torch.Tensor:
        """The allowed(h, i, j) predicate as a bool tensor [H, N, N] (for
        references and tests: O(H N^2) memory)."""
        n, g, nb = self.seq_len, self.granularity, self.num_blocks
        i = torch.arange(n)
        causal = i[:, None] >= i[None, :]
        if not self.causal:
            causal = torch.ones(n, n, dtype=torch.bool)
        qb = (i // g)[:, None]
        kb = (i // g)[None, :]
        out = torch.zeros(self.num_heads, n, n, dtype=torch.bool)
        for h in range(self.num_heads):
            if self.is_block_mask(h):
                out[h] = self.block_mask(h)[qb, kb] & causal
                continue
            diagonals, verticals = self.head(h)
            on_diag = torch.zeros(nb, dtype=torch.bool)
            on_diag[torch.tensor(diagonals, dtype=torch.long)] = True
            allowed = on_diag[qb - kb.clamp(max=qb)] & (qb >= kb)
            if verticals:
                vert = torch.zeros(n, dtype=torch.bool)
                vert[torch.tensor(verticals, dtype=torch.long)] = True
                allowed = allowed | (vert[None, :] & (kb < qb))
            out[h] = allowed & causal
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the pattern JSON (docs/SPEC.md section 8)."""
        L.check(L.lib().pattern_write_json(os.fsencode(path), self._ptr))

    def _check_head(self, head: int) -> None:
        if not 0 <= head < self.num_heads:
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"head {head} out of range [0, {self.num_heads})")

    def __repr__(self) -> str:
        return (
            f"mtrain.Pattern(seq_len={self.seq_len}, num_heads={self.num_heads}, "
            f"granularity={self.granularity}, density={self.density():.4f})"
        )


def _make_pattern(fn: Any, *args: Any) -> Pattern:
    out = ctypes.c_void_p()
    L.check(fn(*args, ctypes.byref(out)))
    return Pattern(int(out.value or 0))


def load_pattern(path: str | os.PathLike[str]) -> Pattern:
    """Reads a pattern JSON file (docs/SPEC.md section 8; mtrain_pattern_read_json)."""
    return _make_pattern(L.lib().pattern_read_json, os.fsencode(path))


def parse_pattern(text: str, origin: str = "<string>") -> Pattern:
    """Parses the pattern JSON format from a string."""
    return _make_pattern(L.lib().pattern_parse_json, text.encode(), origin.encode())


def dense_pattern(seq_len: int, num_heads: int, granularity: int = 128) -> Pattern:
    """The dense causal pattern (every block diagonal)."""
    return _make_pattern(L.lib().pattern_create_dense, seq_len, num_heads, granularity)


def vertical_slash_pattern(
    seq_len: int,
    heads: Sequence[tuple[Sequence[int], Sequence[int]]],
    granularity: int = 128,
) -> Pattern:
    """A vertical-slash pattern: heads[h] = (block diagonals, vertical key
    positions), both strictly increasing (diagonal 0 is added)."""
    p = _make_pattern(L.lib().pattern_create, seq_len, len(heads), granularity)
    for h, (diagonals, verticals) in enumerate(heads):
        d = (ctypes.c_int32 * max(1, len(diagonals)))(*diagonals)
        v = (ctypes.c_int64 * max(1, len(verticals)))(*verticals)
        L.check(
            L.lib().pattern_set_head(p.ptr, h, d, len(diagonals), v, len(verticals)),
            f"head {h}",
        )
    return p


def block_mask_pattern(
    mask: torch.Tensor, seq_len: int, granularity: int = 128, causal: bool = True
) -> Pattern:
    """A block-mask pattern from a bool tensor [H, nb, nb] (query block, key
    block; nb = ceil(seq_len / granularity)): nonzero blocks are computed;
    the diagonal is always on. Causal (the default): blocks above the
    diagonal are rejected and the diagonal block is masked token by token.
    causal=False: bidirectional attention within the mask (SPEC.md section
    1.3; the CPU backends run it, "cuda" refuses it)."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 3:
        raise L.fail(L.ERR_SHAPE_MISMATCH, "block mask must be a tensor [heads, blocks, blocks]")
    nb = -(-seq_len // granularity)
    if mask.shape[1] != nb or mask.shape[2] != nb:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"block mask is {tuple(mask.shape)} but seq_len {seq_len} at granularity "
            f"{granularity} has {nb} blocks: expected [heads, {nb}, {nb}]",
        )
    heads = int(mask.shape[0])
    create = L.lib().pattern_create if causal else L.lib().pattern_create_noncausal
    p = _make_pattern(create, seq_len, heads, granularity)
    data = mask.detach().to("cpu", torch.uint8).contiguous()
    for h in range(heads):
        ptr = ctypes.cast(data[h].data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        L.check(L.lib().pattern_set_block_mask(p.ptr, h, ptr), f"block mask head {h}")
    return p


def resolve_pattern(handle: torch.Tensor) -> Pattern:
    i = _handle_id(handle, KIND_PATTERN, "pattern")
    p = _patterns.get(i)
    if p is None:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"pattern handle {i} no longer has its Pattern")
    return p


# ---------------------------------------------------------------------------
# Budgets (docs/SPEC.md section 2 and section 8)
# ---------------------------------------------------------------------------


class TopK(NamedTuple):
    """Static top-k budget: keep v_size verticals and s_size slashes."""

    v_size: int
    s_size: int


class TopP(NamedTuple):
    """Top-p budget: keep the fewest verticals (slashes) whose mass stays below
    p_v (p_s), at most cap_v (cap_s)."""

    p_v: float
    p_s: float
    cap_v: int = 4096
    cap_s: int = 4096


Budget = TopK | TopP


def budgets_spec(budgets: Any, layer: int | None) -> dict[str, Any]:
    """The JSON-able description of a budget argument (the ops' options)."""
    if isinstance(budgets, (str, os.PathLike)):
        if layer is None:
            raise L.fail(L.ERR_INVALID_ARGUMENT, "a budget file needs layer=")
        return {"file": str(Path(budgets).resolve()), "layer": int(layer)}
    if isinstance(budgets, (TopK, TopP)):
        return {"heads": [_budget_json(budgets)]}
    if (
        isinstance(budgets, Sequence)
        and budgets
        and all(isinstance(b, (TopK, TopP)) for b in budgets)
    ):
        return {"heads": [_budget_json(b) for b in budgets]}
    raise L.fail(
        L.ERR_INVALID_ARGUMENT,
        "budgets= must be a budget file path (with layer=), mtrain.TopK, mtrain.TopP, or a list "
        f"of them (one per query head); got {type(budgets).__name__}",
    )


def _budget_json(b: Budget) -> list[Any]:
    if isinstance(b, TopK):
        return ["topk", int(b.v_size), int(b.s_size)]
    return ["topp", float(b.p_v), float(b.p_s), int(b.cap_v), int(b.cap_s)]


class _Budgets:
    """A budget file read by mtrain_budgets_read (kept for the process)."""

    def __init__(self, path: str) -> None:
        out = ctypes.c_void_p()
        L.check(L.lib().budgets_read(path.encode(), ctypes.byref(out)))
        self.ptr = out

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value and L._lib is not None:
            L.lib().budgets_destroy(self.ptr)


@functools.lru_cache(maxsize=16)
def _budget_file(path: str) -> _Budgets:
    return _Budgets(path)


def head_budgets(spec: dict[str, Any], num_heads: int) -> ctypes.Array[L.HeadBudget]:
    """The per-query-head budget array of a spec, checked against num_heads."""
    arr = (L.HeadBudget * num_heads)()
    if "file" in spec:
        b = _budget_file(spec["file"])
        layer = int(spec["layer"])
        nl = int(L.lib().budgets_num_layers(b.ptr))
        if not 0 <= layer < nl:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"budget file {spec['file']}: layer {layer} not in [0, {nl})",
            )
        nh = int(L.lib().budgets_num_heads(b.ptr, layer))
        if nh != num_heads:
            raise L.fail(
                L.ERR_HEAD_MISMATCH,
                f"budget file {spec['file']} layer {layer} has {nh} heads but q has {num_heads} "
                "query heads",
            )
        for h in range(num_heads):
            L.check(L.lib().budgets_get(b.ptr, layer, h, ctypes.byref(arr[h])))
        return arr
    heads = spec["heads"]
    if len(heads) == 1:
        heads = heads * num_heads
    if len(heads) != num_heads:
        raise L.fail(L.ERR_HEAD_MISMATCH, f"{len(heads)} budgets given for {num_heads} query heads")
    for h, b in enumerate(heads):
        if b[0] == "topk":
            arr[h].kind, arr[h].v_size, arr[h].s_size = L.BUDGET_TOP_K, b[1], b[2]
        else:
            arr[h].kind = L.BUDGET_TOP_P
            arr[h].p_v, arr[h].p_s, arr[h].cap_v, arr[h].cap_s = b[1], b[2], b[3], b[4]
        L.check(L.lib().head_budget_validate(ctypes.byref(arr[h])), f"budget of head {h}")
    return arr


# ---------------------------------------------------------------------------
# Options of the ops (one JSON string, a constant in compiled graphs)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    backend: str = ""  # "" = by device and dtype
    granularity: int = 128
    scale: float = 0.0  # 0 = 1/sqrt(d)
    deterministic: int = 1
    group: str = ""  # "" = one rank; else a registered process group's name
    layout: str = "striped"
    ranks_per_node: int = 0
    pattern: str = "given"  # "given" | "dense" | "estimate"
    budgets: str = ""  # json of budgets_spec
    last_q: int = 64
    num_sinks: int = 30
    window: int = 100
    top_p_forced: int = 0  # 1: top-p budgets force the sinks and the window too

    def encode(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":"))


def estimate_options(opts: Options) -> L.EstimateOptions:
    """The mtrain_estimate_options_t of the ops' options."""
    return L.EstimateOptions(
        last_q=opts.last_q,
        num_sinks=opts.num_sinks,
        window=opts.window,
        top_p_forced=opts.top_p_forced,
    )


@functools.lru_cache(maxsize=256)
def decode_options(text: str) -> Options:
    try:
        return Options(**json.loads(text))
    except (TypeError, ValueError) as e:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"malformed mtrain options {text!r}: {e}") from e


# ---------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------

_DTYPES = {torch.float32: L.F32, torch.bfloat16: L.BF16, torch.float16: L.F16, torch.float64: L.F64}


def mtrain_dtype(t: torch.dtype) -> int:
    try:
        return _DTYPES[t]
    except KeyError:
        raise L.fail(
            L.ERR_UNSUPPORTED_DTYPE,
            f"dtype {t} is not supported (bfloat16, float16, float32; float64 on the CPU)",
        ) from None


def backend_for(opts: Options, device: torch.device, dtype: torch.dtype) -> str:
    if opts.backend:
        return opts.backend
    if device.type == "cuda":
        return "cuda"
    return "cpu-ref" if dtype == torch.float64 else "cpu"


_CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy (cuda_runtime_api.h)


class Context:
    """An mtrain_context_t with its communicator (None: one rank)."""

    def __init__(self, backend: str, opts: Options, device: torch.device) -> None:
        from . import _comm

        self.comm = _comm.communicator(opts.group, device) if opts.group else None
        cfg = L.Config(
            api_version=L.API_VERSION,
            backend=backend.encode(),
            granularity=opts.granularity,
            num_threads=int(os.environ.get("MTRAIN_NUM_THREADS", "0") or 0),
            check_inputs=0,
            softmax_scale=opts.scale,
            deterministic=opts.deterministic,
        )
        out = ctypes.c_void_p()
        comm_ptr = self.comm.handle() if self.comm else None
        with _device_guard(device):
            L.check(L.lib().context_create(ctypes.byref(cfg), comm_ptr, ctypes.byref(out)))
        self.ptr = out
        self.backend = backend
        self.device = device
        self._allocator: L.Allocator | None = None
        if device.type == "cuda":
            self._use_torch_allocator()
            # stream-ordered calls: a single-rank call returns once queued
            # (MTRAIN_CUDA_SYNC=1: every call waits for its work, as before)
            if os.environ.get("MTRAIN_CUDA_SYNC", "0") in ("", "0"):
                L.check(L.lib().cuda_set_async(out, 1))
        self.rank = int(L.lib().context_rank(out))
        self.world = int(L.lib().context_world(out))

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value and L._lib is not None:
            L.lib().context_destroy(self.ptr)

    def _use_torch_allocator(self) -> None:
        """The library's blocks of a call (accumulators, ring buffers, scores)
        come from torch's caching allocator on the current stream, the stream
        the call runs on (bind_stream), instead of cudaMalloc."""
        device = self.device

        def alloc(size: int, _user: int | None) -> int:
            try:
                stream = torch.cuda.current_stream(device)
                return int(torch.cuda.caching_allocator_alloc(max(size, 1), device, stream))
            except Exception:  # C reports OUT_OF_MEMORY naming the allocator
                return 0

        def free(ptr: int | None, _size: int, _user: int | None) -> None:
            if ptr:
                torch.cuda.caching_allocator_delete(ptr)

        self._allocator = L.Allocator(L.ALLOC_FN(alloc), L.FREE_FN(free), None)
        L.check(L.lib().context_set_allocator(self.ptr, ctypes.byref(self._allocator)))

    def bind_stream(self) -> None:
        """Queues the context's CUDA work on the caller's current stream."""
        if self.device.type == "cuda":
            # torch's default stream is the legacy NULL stream (handle 0), which
            # the C API takes as cudaStreamLegacy (1): NULL would select the
            # backend's own stream, unordered with torch's work
            stream = torch.cuda.current_stream(self.device).cuda_stream or _CUDA_STREAM_LEGACY
            L.check(L.lib().cuda_set_stream(self.ptr, ctypes.c_void_p(stream)))


_contexts: dict[tuple[Any, ...], Context] = {}


def synchronize() -> None:
    """Waits for the deferred output checks of every context of this process
    (mtrain_context_check_deferred) and raises the first finding."""
    with _lock:
        cached = list(_contexts.values())
    for ctx in cached:
        with _device_guard(ctx.device):
            L.check(L.lib().context_check_deferred(ctx.ptr))


class _NullGuard:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _device_guard(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda.device(device)
    return _NullGuard()


def agreement_digest(backend: str, opts: Options, device_type: str) -> bytes:
    """What the ranks of a group must ask for alike, as a digest they compare
    before a collective call: the context's settings, and the layout and ring
    schedule (not part of the context, but of every plan made with it: the
    library's plan checks the ranks' slot counts only, and two layouts of equal
    counts, striped and zigzag, ran without an error and with wrong results).
    Not the device index: each rank of an NCCL group has its own GPU (the
    index in the digest made every call on several GPUs fail)."""
    agreed = (
        backend,
        opts.granularity,
        opts.scale,
        opts.deterministic,
        opts.group,
        device_type,
        opts.layout,
        opts.ranks_per_node,
    )
    return hashlib.blake2b(repr(agreed).encode(), digest_size=16).digest()


def context(opts: Options, device: torch.device, dtype: torch.dtype) -> Context:
    """The cached context for these options, device and dtype's backend. With
    a group, collective: the ranks first compare what they ask for; when they
    differ, each creates a fresh context, so that the library's own
    collective check reports the disagreement (MTRAIN_ERR_INVALID_CONFIG)."""
    backend = backend_for(opts, device, dtype)
    index = device.index if device.type == "cuda" else None
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (
        backend,
        opts.granularity,
        opts.scale,
        opts.deterministic,
        opts.group,
        device.type,
        index,
    )
    dev = torch.device(device.type, index) if index is not None else device
    with _lock:
        ctx = _contexts.get(key)
        if not opts.group:
            if ctx is None:
                ctx = Context(backend, opts, dev)
                _contexts[key] = ctx
            return ctx
    from . import _comm

    comm = _comm.communicator(opts.group, dev)
    digest = agreement_digest(backend, opts, device.type)
    same, all_cached = comm.agree_context(digest, ctx is not None)
    if same and all_cached:
        assert ctx is not None
        return ctx
    fresh = Context(backend, opts, dev)  # collective: the library compares the configs
    if not same:
        raise L.fail(
            L.ERR_INVALID_CONFIG,
            f"the ranks ask for different contexts (this rank: backend {backend}, granularity "
            f"{opts.granularity}, softmax_scale {opts.scale}, deterministic {opts.deterministic}, "
            f"layout {opts.layout}, ranks_per_node {opts.ranks_per_node})",
        )
    with _lock:
        _contexts[key] = fresh
    return fresh


def reset() -> None:
    """Destroys the cached contexts, communicators and plans and forgets the
    process groups mtrain was given (for example before destroying a process
    group that mtrain used). Also run at interpreter exit: a gloo group still
    referenced while the interpreter shuts down was seen aborting the process
    ("terminate called without an active exception")."""
    from . import _comm

    with _lock:
        _plan_cache.clear()
        _contexts.clear()
        _layouts.clear()
        _comm.reset()


atexit.register(reset)


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------


def descriptor(t: torch.Tensor, rows: tuple[int, int] | None = None) -> L.Tensor:
    """The mtrain_tensor_t of a contiguous tensor (optionally rows [a, b) of dim 0)."""
    d = L.Tensor()
    ptr = t.data_ptr()
    shape = list(t.shape)
    if rows is not None:
        a, b = rows
        ptr += a * (t.stride(0) * t.element_size())
        shape[0] = b - a
    d.data = ptr
    d.dtype = mtrain_dtype(t.dtype)
    d.ndim = len(shape)
    for i, s in enumerate(shape):
        d.shape[i] = s
    return d


# ---------------------------------------------------------------------------
# Layouts and plans
# ---------------------------------------------------------------------------


class Layout:
    """An mtrain_layout_t of one sequence."""

    def __init__(self, kind: str, seq_len: int, granularity: int, world: int) -> None:
        if kind not in L.LAYOUT_KINDS:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"layout {kind!r} is not one of {', '.join(L.LAYOUT_KINDS)}",
            )
        out = ctypes.c_void_p()
        L.check(
            L.lib().layout_create(
                L.LAYOUT_KINDS[kind], seq_len, granularity, world, None, ctypes.byref(out)
            ),
            f"{kind} layout of {seq_len} tokens over {world} ranks",
        )
        self.ptr = out
        self.kind, self.seq_len, self.granularity, self.world = kind, seq_len, granularity, world

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value and L._lib is not None:
            L.lib().layout_destroy(self.ptr)

    def local_tokens(self, rank: int) -> int:
        return int(L.lib().layout_local_tokens(self.ptr, rank))

    def token_index(self, rank: int) -> torch.Tensor:
        """Global position of each local slot of `rank` (>= seq_len: padding)."""
        n = self.local_tokens(rank)
        out = torch.empty(n, dtype=torch.int64)
        L.check(
            L.lib().layout_rank_token_index(
                self.ptr, rank, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_int64))
            )
        )
        return out


_layouts: dict[tuple[str, int, int, int], Layout] = {}


def layout(kind: str, seq_len: int, granularity: int, world: int) -> Layout:
    key = (kind, seq_len, granularity, world)
    with _lock:
        lay = _layouts.get(key)
        if lay is None:
            lay = Layout(kind, seq_len, granularity, world)
            _layouts[key] = lay
        return lay


class Plan:
    """An mtrain_plan_t with everything it was built from. A plan built on the
    device (mtrain_plan_create_estimated on a CUDA context: ``on_device``) reads
    its patterns and pair count back only when they are asked for, which waits
    for the GPU."""

    def __init__(
        self,
        ctx: Context,
        ptr: ctypes.c_void_p,
        patterns: list[Pattern] | None,
        seq_lens: list[int],
        layouts: list[Layout] | None,
    ) -> None:
        self.ctx = ctx
        self.ptr = ptr
        self._patterns = patterns
        self.seq_lens = seq_lens
        self.layouts = layouts
        self.local_tokens = int(L.lib().plan_local_tokens(ptr))
        self.num_heads = int(L.lib().plan_num_heads(ptr))
        self.on_device = bool(L.lib().plan_on_device(ptr))
        self._pairs: int | None = None if self.on_device else int(L.lib().plan_computed_pairs(ptr))
        self.id = 0  # set when registered
        self.key: tuple[Any, ...] | None = None  # content key of an estimated plan

    @property
    def patterns(self) -> list[Pattern]:
        """Each sequence's pattern (a plan built on the device copies them to the
        host on the first access: a wait for the GPU)."""
        if self._patterns is None:
            out: list[Pattern] = []
            with _device_guard(self.ctx.device):
                for s in range(len(self.seq_lens)):
                    borrowed = ctypes.c_void_p()
                    L.check(L.lib().plan_pattern(self.ptr, s, ctypes.byref(borrowed)), "plan")
                    own = ctypes.c_void_p()
                    L.check(L.lib().pattern_clone(borrowed, ctypes.byref(own)), "plan pattern")
                    out.append(Pattern(int(own.value or 0)))
            self._patterns = out
        return self._patterns

    @property
    def computed_pairs(self) -> int:
        """(query, key) pairs this rank computes (a plan built on the device reads
        them back on the first access: a wait for the GPU)."""
        if self._pairs is None:
            with _device_guard(self.ctx.device):
                # the read back (status and message on failure), then the count
                first = ctypes.c_void_p()
                L.check(L.lib().plan_pattern(self.ptr, 0, ctypes.byref(first)), "plan")
                self._pairs = int(L.lib().plan_computed_pairs(self.ptr))
        return self._pairs

    @property
    def causal(self) -> bool:
        """Every sequence's pattern is causal (an estimated plan always is)."""
        return self.on_device or all(p.causal for p in self.patterns)

    def __del__(self) -> None:
        if getattr(self, "ptr", None) is not None and self.ptr.value and L._lib is not None:
            L.lib().plan_destroy(self.ptr)


def register_plan(plan: Plan) -> torch.Tensor:
    """A handle tensor for plan. Handles of one plan carry the same id (so an
    op returns equal outputs for equal inputs); the plan stays registered
    while any of its handle tensors lives."""
    with _lock:
        if plan.id == 0:
            plan.id = next(_ids)
        entry = _plans.setdefault(plan.id, [plan, 0])
        entry[1] += 1
    handle = torch.tensor([MAGIC, KIND_PLAN, plan.id], dtype=torch.int64)
    weakref.finalize(handle, _release_plan, plan.id)
    return handle


def _release_plan(i: int) -> None:
    with _lock:
        entry = _plans.get(i)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _plans[i]
            key = entry[0].key
            if key is not None and _plans_by_key.get(key) == i:
                del _plans_by_key[key]


def resolve_plan(handle: torch.Tensor) -> Plan:
    i = _handle_id(handle, KIND_PLAN, "plan")
    entry = _plans.get(i)
    if entry is None:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"plan handle {i} is no longer alive (its handle tensor was freed; keep the "
            "SparsePlan of the step until its backward ran)",
        )
    return entry[0]


def seq_lens_of(cu_seqlens: torch.Tensor | None, tokens: int, world: int) -> list[int]:
    """Global sequence lengths from FlashAttention offsets (None: one sequence)."""
    if cu_seqlens is None:
        return [tokens * world]
    if cu_seqlens.device.type != "cpu":
        # a copy to the host: the plan is host data (docs/PYTORCH.md: pass CPU offsets)
        cu_seqlens = cu_seqlens.cpu()
    offs = [int(x) for x in cu_seqlens.tolist()]
    if len(offs) < 2 or offs[0] != 0 or any(b <= a for a, b in itertools.pairwise(offs)):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"cu_seqlens {offs[:8]}{'...' if len(offs) > 8 else ''} must start at 0 and "
            "increase strictly (FlashAttention's varlen offsets)",
        )
    return [b - a for a, b in itertools.pairwise(offs)]


_plan_cache: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 64


def _seqs(seq_lens: list[int]) -> tuple[L.Seqs, ctypes.Array[ctypes.c_int64]]:
    offs = (ctypes.c_int64 * (len(seq_lens) + 1))(0, *itertools.accumulate(seq_lens))
    return L.Seqs(num_seqs=len(seq_lens), offsets=offs), offs


def build_plan(
    ctx: Context,
    opts: Options,
    tokens: int,
    num_heads: int,
    seq_lens: list[int],
    patterns: list[Pattern] | None,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
) -> Plan:
    """Builds the plan of a batch: given patterns (one per sequence, or one for
    all), the dense pattern, or patterns estimated from q and k."""
    world, rank, g = ctx.world, ctx.rank, opts.granularity
    layouts = [layout(opts.layout, n, g, world) for n in seq_lens] if world > 1 else None
    local = [lay.local_tokens(rank) for lay in layouts] if layouts else list(seq_lens)
    if sum(local) != tokens:
        where = (
            f"rank {rank} holds {sum(local)} slots of the {opts.layout} layout of sequences "
            f"{seq_lens} over {world} ranks (padding included; mtrain.dispatch makes them)"
            if layouts
            else f"the sequences {seq_lens} hold {sum(local)} tokens"
        )
        raise L.fail(L.ERR_SHAPE_MISMATCH, f"q has {tokens} tokens but {where}")
    key = None
    if opts.pattern == "dense":
        patterns = [dense_pattern(n, num_heads, g) for n in seq_lens]
    elif opts.pattern == "estimate" and layouts is None:
        # one rank: estimate and plan in one call; on a GPU the patterns and the
        # plan's tables stay there and nothing waits (mtrain_plan_create_estimated)
        assert q is not None and k is not None
        return _estimated_plan(ctx, opts, q, k, seq_lens)
    elif opts.pattern == "estimate":
        assert q is not None and k is not None
        patterns = _estimate(ctx, opts, q, k, seq_lens, local, layouts)
        # the same patterns give the same plan: reuse a live one (and its id)
        key = (id(ctx), opts.encode(), tokens, tuple(seq_lens), _content_key(patterns))
        with _lock:
            i = _plans_by_key.get(key)
            if i is not None and i in _plans:
                return _plans[i][0]
    assert patterns is not None
    if len(patterns) == 1 and len(seq_lens) > 1:
        patterns = patterns * len(seq_lens)
    if len(patterns) != len(seq_lens):
        raise L.fail(
            L.ERR_SHAPE_MISMATCH, f"{len(patterns)} patterns for {len(seq_lens)} sequences"
        )
    # the given patterns against the batch (dense and estimated ones are made to
    # fit it: no need to read them back, a packed batch's documents one by one)
    checked = patterns if opts.pattern == "given" else []
    for s, (p, n) in enumerate(zip(checked, seq_lens, strict=False)):
        if p.seq_len != n or p.num_heads != num_heads or p.granularity != g:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH if p.seq_len != n else L.ERR_HEAD_MISMATCH
                if p.num_heads != num_heads else L.ERR_INVALID_PATTERN,
                f"pattern of sequence {s} has seq_len {p.seq_len}, {p.num_heads} heads and "
                f"granularity {p.granularity}; the batch needs seq_len {n}, {num_heads} heads and "
                f"granularity {g}",
            )  # fmt: skip
    arr = (ctypes.c_void_p * len(patterns))(*[p.ptr.value for p in patterns])
    seqs, _keep = _seqs(seq_lens)
    out = ctypes.c_void_p()
    if layouts is None:
        L.check(L.lib().plan_create(ctx.ptr, ctypes.byref(seqs), arr, ctypes.byref(out)), "plan")
    else:
        lay = (ctypes.c_void_p * len(layouts))(*[x.ptr.value for x in layouts])
        L.check(
            L.lib().plan_create_ring(
                ctx.ptr, ctypes.byref(seqs), lay, opts.ranks_per_node, arr, ctypes.byref(out)
            ),
            "ring plan",
        )
    plan = Plan(ctx, out, patterns, seq_lens, layouts)
    if key is not None:
        plan.key = key
        with _lock:
            plan.id = next(_ids)
            _plans.setdefault(plan.id, [plan, 0])
            _plans_by_key[key] = plan.id
    return plan


def _content_key(patterns: Sequence[Pattern]) -> tuple[int, int]:
    """The 128-bit digest of the patterns' content, in order
    (mtrain_pattern_digest: one call for the batch)."""
    arr = (ctypes.c_void_p * len(patterns))(*[p.ptr.value for p in patterns])
    out = (ctypes.c_uint64 * 2)()
    L.check(L.lib().pattern_digest(arr, len(patterns), out), "pattern digest")
    return (out[0], out[1])


def cached_plan(
    ctx: Context,
    opts: Options,
    tokens: int,
    num_heads: int,
    seq_lens: list[int],
    patterns: list[Pattern] | None,
) -> Plan:
    """build_plan for given or dense patterns, cached (the same patterns and
    batch give the same plan)."""
    key = (
        id(ctx),
        opts.encode(),
        tokens,
        num_heads,
        tuple(seq_lens),
        tuple(p.id for p in patterns) if patterns is not None else None,
    )
    with _lock:
        plan = _plan_cache.get(key)
        if plan is not None:
            _plan_cache.move_to_end(key)
            return plan
    plan = build_plan(ctx, opts, tokens, num_heads, seq_lens, patterns)
    with _lock:
        _plan_cache[key] = plan
        while len(_plan_cache) > _PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return plan


def _estimated_plan(
    ctx: Context, opts: Options, q: torch.Tensor, k: torch.Tensor, seq_lens: list[int]
) -> Plan:
    """One rank: the patterns of every packed sequence estimated and their plan
    built in one mtrain_plan_create_estimated call. On a CUDA context the plan
    is built on the GPU and the call returns without waiting for it (top-k
    budgets); elsewhere it is the estimate then the host plan."""
    num_heads = int(q.shape[1])
    budgets = head_budgets(json.loads(opts.budgets), num_heads)
    eo = estimate_options(opts)
    ctx.bind_stream()
    qd, kd = descriptor(q), descriptor(k)
    seqs, _keep = _seqs(seq_lens)
    out = ctypes.c_void_p()
    with _device_guard(q.device):
        st = L.lib().plan_create_estimated(
            ctx.ptr, ctypes.byref(seqs), ctypes.byref(qd), ctypes.byref(kd), budgets,
            ctypes.byref(eo), ctypes.byref(out),
        )  # fmt: skip
    n = len(seq_lens)
    L.check(st, f"estimating the patterns of {n} sequence{'s' if n > 1 else ''} of {sum(seq_lens)} "
                "tokens and building their plan")  # fmt: skip
    plan = Plan(ctx, out, None, seq_lens, None)
    if not plan.on_device:
        # a host plan: the same patterns give the same plan, so a live one (and its
        # id) is found again by content, as a recomputed forward does (a plan built
        # on the device is not: reading its patterns would wait for the GPU)
        borrowed = (ctypes.c_void_p * n)()
        for s_ in range(n):
            one = ctypes.c_void_p()
            L.check(L.lib().plan_pattern(out, s_, ctypes.byref(one)), "plan")
            borrowed[s_] = one
        digest = (ctypes.c_uint64 * 2)()
        L.check(L.lib().pattern_digest(borrowed, n, digest), "pattern digest")
        key = (id(ctx), opts.encode(), int(q.shape[0]), tuple(seq_lens), (digest[0], digest[1]))
        with _lock:
            i = _plans_by_key.get(key)
            if i is not None and i in _plans:
                return _plans[i][0]  # (the new plan is freed with its Plan)
            plan.key = key
            plan.id = next(_ids)
            _plans.setdefault(plan.id, [plan, 0])
            _plans_by_key[key] = plan.id
        return plan
    with _lock:
        plan.id = next(_ids)
        _plans.setdefault(plan.id, [plan, 0])
    return plan


def _estimate(
    ctx: Context,
    opts: Options,
    q: torch.Tensor,
    k: torch.Tensor,
    seq_lens: list[int],
    local: list[int],
    layouts: list[Layout] | None,
) -> list[Pattern]:
    """One rank: every packed sequence in one mtrain_pattern_estimate_batch
    call (one wait per stage for the whole batch); a ring: each sequence with
    mtrain_pattern_estimate_ring (collective)."""
    num_heads = int(q.shape[1])
    budgets = head_budgets(json.loads(opts.budgets), num_heads)
    eo = estimate_options(opts)
    ctx.bind_stream()
    with _device_guard(q.device):
        if layouts is None:
            qd, kd = descriptor(q), descriptor(k)
            seqs, _keep = _seqs(local)
            res = (ctypes.c_void_p * len(local))()
            st = L.lib().pattern_estimate_batch(
                ctx.ptr, ctypes.byref(seqs), ctypes.byref(qd), ctypes.byref(kd), budgets,
                ctypes.byref(eo), res,
            )  # fmt: skip
            what = f"{len(local)} sequence{'s' if len(local) > 1 else ''} of {sum(local)} tokens"
            L.check(st, f"estimating the patterns of {what}")
            return [Pattern(int(r or 0)) for r in res]
        out: list[Pattern] = []
        row = 0
        for s, n in enumerate(local):
            qd = descriptor(q, (row, row + n))
            kd = descriptor(k, (row, row + n))
            r = ctypes.c_void_p()
            st = L.lib().pattern_estimate_ring(
                ctx.ptr, layouts[s].ptr, ctypes.byref(qd), ctypes.byref(kd), budgets,
                ctypes.byref(eo), ctypes.byref(r),
            )  # fmt: skip
            L.check(st, f"estimating the pattern of sequence {s} ({seq_lens[s]} tokens)")
            out.append(Pattern(int(r.value or 0)))
            row += n
    return out


def select_blocks(
    ctx: Context,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    seq_lens: list[int],
    layouts: list[Layout] | None,
    options: L.BlockOptions,
    report: bool,
) -> tuple[list[Pattern], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None]:
    """The block selection of every sequence (docs/SPEC.md section 9):
    mtrain_pattern_select_blocks per sequence on one rank, or
    mtrain_pattern_select_blocks_ring with the sequence's layout (collective).
    q [T, Hq, d], k [T, Hkv, d] and lse [T, Hq] (or None) are contiguous, on
    the context's device. Returns the patterns and, when asked, per sequence
    (head recall fp64, head top-k int32, head blocks int64), each [Hq] on the
    CPU."""
    num_heads = int(q.shape[1])
    local = [lay.local_tokens(ctx.rank) for lay in layouts] if layouts else list(seq_lens)
    if sum(local) != int(q.shape[0]):
        where = (
            f"rank {ctx.rank} holds {sum(local)} slots of the layouts of sequences {seq_lens} "
            f"over {ctx.world} ranks (padding included; mtrain.dispatch makes them)"
            if layouts
            else f"the sequences {seq_lens} hold {sum(local)} tokens"
        )
        raise L.fail(L.ERR_SHAPE_MISMATCH, f"q has {int(q.shape[0])} tokens but {where}")
    patterns: list[Pattern] = []
    reports: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    row = 0
    ctx.bind_stream()
    with _device_guard(q.device):
        for s, n in enumerate(local):
            qd = descriptor(q, (row, row + n))
            kd = descriptor(k, (row, row + n))
            ld = descriptor(lse, (row, row + n)) if lse is not None else None
            rep = None
            if report:
                recall = torch.full((num_heads,), math.nan, dtype=torch.float64)
                top_k = torch.zeros(num_heads, dtype=torch.int32)
                blocks = torch.zeros(num_heads, dtype=torch.int64)
                reports.append((recall, top_k, blocks))
                rep = L.BlockReport(
                    ctypes.cast(recall.data_ptr(), ctypes.POINTER(ctypes.c_double)),
                    ctypes.cast(top_k.data_ptr(), ctypes.POINTER(ctypes.c_int32)),
                    ctypes.cast(blocks.data_ptr(), ctypes.POINTER(ctypes.c_int64)),
                )
            res = ctypes.c_void_p()
            lp = ctypes.byref(ld) if ld is not None else None
            rp = ctypes.byref(rep) if rep is not None else None
            if layouts is None:
                st = L.lib().pattern_select_blocks(
                    ctx.ptr, ctypes.byref(qd), ctypes.byref(kd), lp, ctypes.byref(options), rp,
                    ctypes.byref(res),
                )  # fmt: skip
            else:
                st = L.lib().pattern_select_blocks_ring(
                    ctx.ptr, layouts[s].ptr, ctypes.byref(qd), ctypes.byref(kd), lp,
                    ctypes.byref(options), rp, ctypes.byref(res),
                )  # fmt: skip
            L.check(st, f"selecting the blocks of sequence {s} ({seq_lens[s]} tokens)")
            patterns.append(Pattern(int(res.value or 0)))
            row += n
    return patterns, (reports if report else None)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def check_library() -> MtrainError | None:
    """None when the library loads, else the error (for diagnostics)."""
    try:
        L.lib()
    except MtrainError as e:
        return e
    return None
