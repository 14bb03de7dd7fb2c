"""mtrain.BlockPatternCache: the library's pattern cache (mtrain_block_cache.h)
for a training loop: one block pattern per layer, selected anew every
``refresh_every`` steps of that layer and reused in between, with the recall
of the cached pattern against a fresh selection on request (docs/PATTERNS.md,
"Pattern cache"). With ``group=`` the cache is context parallel: each rank
passes its slots of the layout (mtrain.dispatch) and every rank gets the
global pattern (mtrain_block_cache_select_ring); the calls are collective."""

from __future__ import annotations

import ctypes
import hashlib
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _comm
from . import _core as C
from . import _lib as L
from .api import _block_options, _options, _world, select_blocks
from .errors import MtrainError

__all__ = ["BlockPatternCache", "RecallCheck"]

_MAX_REFRESH = 1 << 30
_MAX_LAYERS = 1 << 20


class RecallCheck(NamedTuple):
    """The recall of a layer's cached pattern against a fresh selection on the
    same q and k (BlockPatternCache.measure). Recall: the share of the dense
    softmax mass (causal, or over every key for a non-causal pattern) inside
    the pattern, averaged over rows and heads (mtrain_cpu_pattern_recall, fp64)."""

    cached: float
    """the recall of the pattern the cache holds (what select returned last)"""
    fresh: float
    """the recall of mtrain.select_blocks with the cache's options on this q and k"""
    cached_per_head: torch.Tensor
    """float64 [Hq]"""
    fresh_per_head: torch.Tensor
    """float64 [Hq]"""
    age: int
    """steps since the cached pattern was selected (0: selected on the last step)"""
    cached_density: float
    fresh_density: float

    @property
    def drop(self) -> float:
        """fresh - cached: the recall lost by reusing the cached pattern."""
        return self.fresh - self.cached


def _signature(q: torch.Tensor, k: torch.Tensor, seq_len: int | None) -> tuple[Any, ...]:
    """What a layer's pattern was selected for; seq_len: the global length
    under a group (None: one process, q's tokens)."""
    return (
        int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2]), q.dtype, q.device,
        seq_len,
    )  # fmt: skip


def _describe(sig: tuple[Any, ...]) -> str:
    n, hq, hkv, d, dtype, device, seq_len = sig
    where = f"{n} tokens" if seq_len is None else f"{n} local slots of {seq_len} tokens"
    return f"{where}, {hq} query heads, {hkv} kv heads, head_dim {d}, {dtype} on {device}"


def _check_options(o: L.BlockOptions, method: str, granularity: int) -> None:
    """The library's option checks (block_entry.c check_options), made at
    construction rather than at the first selection."""
    what = "BlockPatternCache"
    if o.kind == L.BUDGET_TOP_K and o.top_k < 0:
        raise L.fail(L.ERR_INVALID_BUDGET, f"{what}: top_k={o.top_k} must be >= 0")
    if o.kind == L.BUDGET_TOP_P and not 0.0 < o.top_p <= 1.0:
        raise L.fail(L.ERR_INVALID_BUDGET, f"{what}: top_p={o.top_p} must be in (0, 1]")
    if o.kind == L.BUDGET_TOP_P and o.method == L.BLOCK_MEANPOOL:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"{what}: method='meanpool' is top-k only (its scores are logits, not masses)",
        )
    if o.head_adaptive and (o.kind != L.BUDGET_TOP_K or o.method == L.BLOCK_MEANPOOL):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT, f"{what}: head_adaptive needs top_k= with precise or antidiag"
        )
    if o.sink_blocks < 0 or o.local_blocks < 0:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"{what}: sink_blocks={o.sink_blocks} and local_blocks={o.local_blocks} must be >= 0",
        )
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"{what}: granularity={granularity!r} must be >= 1")
    if method == "antidiag" and (o.stride < 1 or granularity % o.stride != 0):
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"{what}: stride={o.stride} must divide the granularity {granularity}",
        )


def _recall(p: C.Pattern, q64: torch.Tensor, k64: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head recall of p over q64 [N, Hq, d], k64 [N, Hkv, d] (fp64, CPU)."""
    per_head = torch.zeros(p.num_heads, dtype=torch.float64)
    mean = ctypes.c_double()
    dp = ctypes.POINTER(ctypes.c_double)
    L.check(
        L.lib().cpu_pattern_recall(
            p.ptr, int(k64.shape[1]), int(q64.shape[2]), scale,
            ctypes.cast(q64.data_ptr(), dp), ctypes.cast(k64.data_ptr(), dp),
            ctypes.cast(per_head.data_ptr(), dp), ctypes.byref(mean),
        ),
        "BlockPatternCache.measure: the recall",
    )  # fmt: skip
    return per_head


def _sequence_length(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**62:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"BlockPatternCache: seq_len={value!r} must be an int >= 1 (the global length of "
            "each layer's sequence under group=)",
        )
    return value


class BlockPatternCache:
    """Block patterns of ``num_layers`` layers, each selected by
    mtrain.select_blocks' rules (docs/SPEC.md section 9) on the first call for
    the layer and then every ``refresh_every`` calls (steps 0, k, 2k, ... of
    that layer), and reused unchanged in between (AdaSpa-style reuse of one
    search for several steps; mtrain_block_cache.h).

    Call ``select(layer, q, k)`` once per step and layer; pass the pattern it
    returns as ``pattern=`` to mtrain.attention. The selection options are
    fixed at construction (the arguments of mtrain.select_blocks). Each layer
    holds one sequence: q [N, Hq, d] and k [N, Hkv, d] of the same shape,
    dtype and device on every step; a change raises (call
    ``invalidate(layer)`` to select anew for a new shape). Not thread-safe
    (one thread at a time per cache).

    Context parallel (``group=``): q, k (and lse) are this rank's slots of the
    layout of one sequence of ``seq_len`` tokens (mtrain.dispatch makes them;
    ``layout``, ``granularity`` as its info), each rank scores its own query
    blocks and every rank gets the global pattern, bitwise the one a single
    process selects on the whole sequence. select() and measure() are then
    collective: every rank keeps its own cache, built with the same arguments,
    and calls select() (and invalidate(), measure()) for the same layer on the
    same steps, so that the ranks' schedules stay equal. Each select() first
    compares the ranks' steps (layer, step and selection counts, whether it
    selects, the global shape: one small all-gather); ranks out of step all
    raise MtrainError (MTRAIN_ERR_INVALID_CONFIG) and their layers stay as
    they were.

    Args:
        refresh_every: select every this many steps of a layer (1 .. 2^30; 1:
            every step selects).
        num_layers: layers 0 .. num_layers - 1 (1 .. 2^20).
        method, top_k, top_p, granularity, softmax_scale, backend,
        deterministic, sink_blocks, local_blocks, stride, head_adaptive,
        causal: as mtrain.select_blocks.
        group: a torch.distributed process group (gloo with CPU tensors, NCCL
            with CUDA tensors): context parallel, as mtrain.select_blocks.
        layout, ranks_per_node: the layout of the local slots and the ring (as
            mtrain.select_blocks; the dispatch's layout).
        seq_len: with group=, the global length of each layer's sequence
            (default: the local slots times the world size, i.e. no padding;
            give it when the layout pads, e.g. a length not a multiple of
            world x granularity).
    """

    def __init__(
        self,
        refresh_every: int,
        num_layers: int = 1,
        *,
        method: str = "antidiag",
        top_k: int | None = None,
        top_p: float | None = None,
        granularity: int = 128,
        softmax_scale: float | None = None,
        backend: str | None = None,
        deterministic: bool = True,
        sink_blocks: int = 1,
        local_blocks: int = 1,
        stride: int = 8,
        head_adaptive: bool = False,
        causal: bool = True,
        group: Any = None,
        layout: str = "striped",
        ranks_per_node: int = 0,
        seq_len: int | None = None,
    ) -> None:
        self._ptr = ctypes.c_void_p()
        for name, value, most in (
            ("refresh_every", refresh_every, _MAX_REFRESH),
            ("num_layers", num_layers, _MAX_LAYERS),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise L.fail(L.ERR_INVALID_ARGUMENT, f"{name}={value!r} must be an int")
            if not 1 <= value <= most:
                extra = " (1: every step selects)" if name == "refresh_every" else ""
                raise L.fail(
                    L.ERR_INVALID_ARGUMENT, f"{name}={value} must be in 1 .. {most}{extra}"
                )
        self._options = _block_options(
            method, top_k, top_p, sink_blocks, local_blocks, stride, head_adaptive, causal
        )
        _check_options(self._options, method, granularity)
        self._select_kwargs: dict[str, Any] = {
            "method": method, "top_k": top_k, "top_p": top_p, "granularity": granularity,
            "softmax_scale": softmax_scale, "backend": backend, "deterministic": deterministic,
            "sink_blocks": sink_blocks, "local_blocks": local_blocks, "stride": stride,
            "head_adaptive": head_adaptive, "causal": causal,
        }  # fmt: skip
        if group is None and seq_len is not None:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"BlockPatternCache: seq_len={seq_len!r} is the global length of context "
                "parallel: give it with group= (one process: q's tokens are the length)",
            )
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"BlockPatternCache: ranks_per_node={ranks_per_node!r} must be an int",
            )
        self._seq_len = _sequence_length(seq_len)
        # the context options, checked now (granularity, scale, backend name, layout; with a
        # group, torch.distributed initialised)
        _options(
            0, group=group, layout=layout, ranks_per_node=ranks_per_node, granularity=granularity,
            softmax_scale=softmax_scale, backend=backend, deterministic=deterministic,
            pattern="blocks",
        )  # fmt: skip
        self.refresh_every = refresh_every
        self.num_layers = num_layers
        self.granularity = int(granularity)
        self.group = group
        self.layout = layout
        self.ranks_per_node = ranks_per_node
        self.world = _world(group)
        self.rank = 0
        if group is not None:
            self.rank = int(dist.get_rank(group))
        self._softmax_scale = softmax_scale
        self._backend = backend
        self._deterministic = deterministic
        self._patterns: list[C.Pattern | None] = [None] * num_layers
        self._cached_ptr: list[int] = [0] * num_layers
        self._signatures: list[tuple[Any, ...] | None] = [None] * num_layers
        self._ages: list[int] = [0] * num_layers
        # under a group: the context of the layer's selection, reused on its cached steps
        # (those read no data and communicate nothing in the library)
        self._contexts: list[C.Context | None] = [None] * num_layers
        L.check(
            L.lib().block_cache_create(num_layers, refresh_every, ctypes.byref(self._ptr)),
            "BlockPatternCache",
        )

    def __del__(self) -> None:
        ptr = getattr(self, "_ptr", None)
        if ptr is not None and ptr.value and L._lib is not None:
            L.lib().block_cache_destroy(ptr)
            self._ptr = ctypes.c_void_p()

    def __repr__(self) -> str:
        ring = f", world={self.world}, layout={self.layout!r}" if self.group is not None else ""
        return (
            f"mtrain.BlockPatternCache(refresh_every={self.refresh_every}, "
            f"num_layers={self.num_layers}, method={self._select_kwargs['method']!r}, "
            f"causal={self._select_kwargs['causal']}{ring})"
        )

    # ---- checks ----

    def _layer(self, layer: int, what: str) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"{what}: layer={layer!r} must be an int")
        if not 0 <= layer < self.num_layers:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: layer {layer} is out of range (the cache has {self.num_layers} "
                f"layers: 0 .. {self.num_layers - 1})",
            )
        return layer

    def _inputs(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor):
                raise L.fail(L.ERR_INVALID_ARGUMENT, f"{what}: {name} is not a tensor")
            if t.ndim != 3:
                raise L.fail(
                    L.ERR_SHAPE_MISMATCH,
                    f"{what}: {name} has shape {tuple(t.shape)}: expected [tokens, heads, "
                    "head_dim] (one sequence per layer)",
                )
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same tokens "
                "and head_dim",
            )
        if k.dtype != q.dtype or k.device != q.device:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: q is {q.dtype} on {q.device} but k is {k.dtype} on {k.device}",
            )
        return q.detach().contiguous(), k.detach().contiguous()

    def _check_lse(self, lse: torch.Tensor | None, q: torch.Tensor, what: str) -> None:
        precise = self._options.method == L.BLOCK_PRECISE
        if lse is None:
            return
        if not precise:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: lse= is read by method='precise' only, not "
                f"{self._select_kwargs['method']!r}",
            )
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:2]):
            shape = tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{what}: lse is {shape}: expected [{q.shape[0]}, {q.shape[1]}] (q's tokens "
                "and heads)",
            )
        if lse.dtype not in (torch.float32, torch.float64) or lse.device != q.device:
            raise L.fail(
                L.ERR_UNSUPPORTED_DTYPE,
                f"{what}: lse is {lse.dtype} on {lse.device}: float32 or float64 on q's "
                f"device {q.device}",
            )

    def _global_length(self, q3: torch.Tensor, what: str) -> tuple[int | None, C.Layout | None]:
        """Under a group: the sequence's global length and its layout (None on
        one rank), q3's slots checked against the layout's."""
        if self.group is None:
            return None, None
        local = int(q3.shape[0])
        n = self._seq_len if self._seq_len is not None else local * self.world
        if self.world == 1:
            if n != local:
                raise L.fail(
                    L.ERR_SHAPE_MISMATCH,
                    f"{what}: seq_len={n} but q has {local} tokens (a group of one rank)",
                )
            return n, None
        lay = C.layout(self.layout, n, self.granularity, self.world)
        want = lay.local_tokens(self.rank)
        if want != local:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{what}: q has {local} tokens but rank {self.rank} holds {want} slots of the "
                f"{self.layout} layout of {n} tokens over {self.world} ranks (padding "
                "included; mtrain.dispatch makes them; seq_len= gives the global length)",
            )
        return n, lay

    def _context(self, q: torch.Tensor) -> C.Context:
        """The context of a selection (collective under a group: the ranks
        compare their settings and layout)."""
        opts = C.decode_options(
            _options(
                int(q.shape[-1]), group=self.group, layout=self.layout,
                ranks_per_node=self.ranks_per_node, granularity=self.granularity,
                softmax_scale=self._softmax_scale, backend=self._backend,
                deterministic=self._deterministic, pattern="blocks",
            )
        )  # fmt: skip
        return C.context(opts, q.device, q.dtype)

    def _agree(self, call: str, layer: Any, step: tuple[Any, ...] | None, device: Any) -> bool:
        """Collective under a group (one all-gather of a 16-byte digest, the
        library's agreement mechanism, _comm agree_context): whether every rank
        makes the same call of the cache: ``step`` is what the ranks must share
        (None: this rank refused its inputs, so that the others fail too rather
        than wait in a collective this rank never joins)."""
        agreed = (
            "mtrain.BlockPatternCache", call, self.refresh_every, self.num_layers, layer,
            "refused" if step is None else step,
        )  # fmt: skip
        digest = hashlib.blake2b(repr(agreed).encode(), digest_size=16).digest()
        dev = device if isinstance(device, torch.device) else torch.device("cpu")
        comm = _comm.communicator(_comm.register_group(self.group), dev)
        same, _ = comm.agree_context(digest, True)
        return same

    def _step_key(self, layer: int, sig: tuple[Any, ...], due: bool) -> tuple[Any, ...]:
        """What the ranks of a group share on a step of ``layer`` (not the
        local slot count, which the layout may make differ between ranks)."""
        steps, selections = self.counts(layer)
        _, hq, hkv, d, dtype, device, seq_len = sig
        o = self._options
        return (
            steps, selections, due, seq_len, hq, hkv, d, str(dtype), device.type, o.method,
            o.kind, o.top_k, o.top_p, o.sink_blocks, o.local_blocks, o.stride, o.head_adaptive,
            o.noncausal, self.granularity,
        )  # fmt: skip

    def _out_of_step(self, what: str, layer: int, key: tuple[Any, ...] | None) -> MtrainError:
        mine = "refused its inputs"
        if key is not None:
            steps, selections, due, seq_len, hq, hkv, d, dtype = key[:8]
            mine = (
                f"is at step {steps} of layer {layer} ({selections} selections), "
                f"{'selects' if due else 'reuses the cached pattern'}, {seq_len} tokens, "
                f"{hq} query heads, {hkv} kv heads, head_dim {d}, {dtype}"
            )
        return L.fail(
            L.ERR_INVALID_CONFIG,
            f"{what}: the ranks are out of step (this rank {self.rank} {mine}; another rank "
            "differs or refused its inputs): every rank must build the cache alike and call "
            "select() and invalidate() for the same layers on the same steps with the same "
            "global shapes (the refresh schedule is collective); the layer is unchanged",
        )

    # ---- the schedule ----

    def due(self, layer: int) -> bool:
        """Whether the next select() of ``layer`` selects (no pattern yet,
        ``refresh_every`` steps passed, or invalidated): the steps on which
        method='precise' needs lse=. Local (no communication): under a group
        it is the same on every rank as long as they keep the schedule."""
        self._layer(layer, "BlockPatternCache.due")
        flag = ctypes.c_int()
        L.check(L.lib().block_cache_due(self._ptr, layer, ctypes.byref(flag)), "due")
        return bool(flag.value)

    def age(self, layer: int) -> int:
        """Steps since the layer's pattern was selected (0: its last select()
        selected); -1 when it holds none."""
        self._layer(layer, "BlockPatternCache.age")
        return self._ages[layer] if self._patterns[layer] is not None else -1

    def counts(self, layer: int) -> tuple[int, int]:
        """(steps, selections) of ``layer``: its successful select() calls and
        how many of them selected."""
        self._layer(layer, "BlockPatternCache.counts")
        steps, selections = ctypes.c_int64(), ctypes.c_int64()
        L.check(
            L.lib().block_cache_counts(
                self._ptr, layer, ctypes.byref(steps), ctypes.byref(selections)
            ),
            "counts",
        )
        return int(steps.value), int(selections.value)

    def invalidate(self, layer: int | None = None) -> None:
        """Drops the pattern of ``layer`` (None: of every layer): its next
        select() selects, for any shape. Local; under a group every rank must
        invalidate alike (the next select() compares the ranks' schedules)."""
        if layer is not None:
            self._layer(layer, "BlockPatternCache.invalidate")
        L.check(L.lib().block_cache_invalidate(self._ptr, -1 if layer is None else layer))
        for i in range(self.num_layers) if layer is None else (layer,):
            self._patterns[i] = None
            self._cached_ptr[i] = 0
            self._signatures[i] = None
            self._ages[i] = 0
            self._contexts[i] = None

    def pattern(self, layer: int) -> C.Pattern | None:
        """The layer's cached pattern (what select() returned last), or None."""
        self._layer(layer, "BlockPatternCache.pattern")
        return self._patterns[layer]

    # ---- one step ----

    def _prepare(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, what: str
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...], bool, C.Layout | None]:
        """select()'s local checks: (q3, k3, signature, due, layout)."""
        self._layer(layer, what)
        q3, k3 = self._inputs(layer, q, k, what)
        seq_len, lay = self._global_length(q3, what)
        sig = _signature(q3, k3, seq_len)
        had = self._signatures[layer]
        if had is not None and had != sig:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{what}: the inputs changed between steps: the cached pattern was selected "
                f"for {_describe(had)}, this step gives {_describe(sig)} (call "
                f"invalidate({layer}) to select anew for the new shape)",
            )
        self._check_lse(lse, q3, what)
        due = self.due(layer)
        if due and self._options.method == L.BLOCK_PRECISE and lse is None:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: method='precise' selects on this step (due({layer}) is True) and "
                "needs lse= (the forward's log-sum-exp [N, Hq], e.g. attention(q, k, v, "
                "return_lse=True)[1]; under a group this rank's slots)",
            )
        return q3, k3, sig, due, lay

    @torch.compiler.disable
    def select(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None = None
    ) -> C.Pattern:
        """One step of ``layer``: its cached pattern (the same Pattern object
        as on the previous step), or a new selection from post-RoPE q [N, Hq, d]
        and k [N, Hkv, d] (and, for method='precise', lse [N, Hq], needed only
        when due(layer)) when the schedule says so. Detached: no gradient
        flows through it. Raises MtrainError (SHAPE_MISMATCH) when q or k
        differ in shape, dtype or device from the layer's cached selection.
        Under a group: q, k, lse are this rank's slots; collective (every rank
        calls it for the same layer on the same step; ranks out of step raise
        MTRAIN_ERR_INVALID_CONFIG on every rank); the pattern is global."""
        what = f"BlockPatternCache.select(layer={layer})"
        if self.group is None:
            q3, k3, sig, due, lay = self._prepare(layer, q, k, lse, what)
            ctx = self._context(q3)
        else:
            refused: MtrainError | None = None
            key: tuple[Any, ...] | None = None
            try:
                q3, k3, sig, due, lay = self._prepare(layer, q, k, lse, what)
                key = self._step_key(layer, sig, due)
            except MtrainError as e:
                refused = e
            same = self._agree("select", layer, key, getattr(q, "device", None))
            if refused is not None:
                raise refused
            if not same:
                raise self._out_of_step(what, layer, key)
            ctx_held = self._contexts[layer]
            if due or ctx_held is None:
                try:
                    ctx = self._context(q3)  # collective: the settings and the layout
                except MtrainError as e:
                    raise L.fail(e.code, f"{what}: {e.message}") from e
            else:
                ctx = ctx_held
        lse2 = lse.detach().contiguous() if (lse is not None and due) else None
        qd, kd = C.descriptor(q3), C.descriptor(k3)
        ld = C.descriptor(lse2) if lse2 is not None else None
        out = ctypes.c_void_p()
        age = ctypes.c_int32()
        ctx.bind_stream()
        with torch.no_grad(), C._device_guard(q3.device):
            if lay is None:
                st = L.lib().block_cache_select(
                    self._ptr, layer, ctx.ptr, ctypes.byref(qd), ctypes.byref(kd),
                    ctypes.byref(ld) if ld is not None else None, ctypes.byref(self._options),
                    None, ctypes.byref(out), ctypes.byref(age),
                )  # fmt: skip
            else:
                st = L.lib().block_cache_select_ring(
                    self._ptr, layer, ctx.ptr, lay.ptr, ctypes.byref(qd), ctypes.byref(kd),
                    ctypes.byref(ld) if ld is not None else None, ctypes.byref(self._options),
                    None, ctypes.byref(out), ctypes.byref(age),
                )  # fmt: skip
        L.check(st, what)
        ptr = int(out.value or 0)
        current = self._patterns[layer]
        if age.value == 0 or current is None or ptr != self._cached_ptr[layer]:
            # a new selection: a copy this object owns (the cache's own is
            # freed at its next refresh, while a step may still hold this one)
            current = C._make_pattern(L.lib().pattern_clone, ctypes.c_void_p(ptr))
            self._patterns[layer] = current
            self._cached_ptr[layer] = ptr
            self._contexts[layer] = ctx if self.group is not None else None
        self._signatures[layer] = sig
        self._ages[layer] = int(age.value)
        return current

    # ---- the recall ----

    def _gather(self, t: torch.Tensor, lay: C.Layout | None, n: int) -> torch.Tensor:
        """Collective: the global [n, ...] tensor from every rank's slots of
        ``lay`` (all-gather over the group, padded to the largest rank's
        slots; the padding dropped)."""
        if lay is None:
            return t
        most = max(lay.local_tokens(r) for r in range(self.world))
        mine = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
        mine[: t.shape[0]] = t
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        out = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for r, part in enumerate(parts):
            index = lay.token_index(r).to(t.device)
            real = index < n
            out[index[real]] = part[: index.numel()][real]
        return out

    def measure(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None = None
    ) -> RecallCheck:
        """The recall of the layer's cached pattern on this q and k against a
        fresh mtrain.select_blocks with the same options (for method='precise'
        lse= is needed: the fresh selection's). Does not step or change the
        cache. Computed in fp64 on the CPU over every (query, key) pair,
        O(N^2 Hq d): a measurement tool for small N. Under a group: q, k, lse
        are this rank's slots; collective (the ranks agree on the call, then
        all-gather q, k and lse); every rank computes the same RecallCheck
        over the whole sequence, equal to that of one process on the gathered
        inputs (the fresh selection is the single-process one: bitwise the
        ring's)."""
        what = f"BlockPatternCache.measure(layer={layer})"
        refused: MtrainError | None = None
        key: tuple[Any, ...] | None = None
        try:
            q3, k3, sig, lay = self._prepare_measure(layer, q, k, lse, what)
            key = (*sig[1:4], str(sig[4]), sig[5].type, sig[6], self.counts(layer))
        except MtrainError as e:
            if self.group is None:
                raise
            refused = e
        if self.group is not None:
            same = self._agree("measure", layer, key, getattr(q, "device", None))
            if refused is not None:
                raise refused
            if not same:
                raise L.fail(
                    L.ERR_INVALID_CONFIG,
                    f"{what}: the ranks are out of step (this rank {self.rank} measures layer "
                    f"{layer} at step {self.counts(layer)[0]}; another rank differs): every "
                    "rank must call measure() for the same layer on the same step with the "
                    "same global shapes",
                )
        n = int(sig[6]) if sig[6] is not None else int(q3.shape[0])
        qg, kg = self._gather(q3, lay, n), self._gather(k3, lay, n)
        lseg = None
        if lse is not None:
            lseg = self._gather(lse.detach().contiguous(), lay, n)
        cached = self._patterns[layer]
        assert cached is not None
        fresh = select_blocks(qg, kg, lse=lseg, **self._select_kwargs)[0]
        q64 = qg.to("cpu", torch.float64).contiguous()
        k64 = kg.to("cpu", torch.float64).contiguous()
        scale = float(self._softmax_scale) if self._softmax_scale else 1 / math.sqrt(q3.shape[2])
        got = _recall(cached, q64, k64, scale)
        want = _recall(fresh, q64, k64, scale)
        return RecallCheck(
            cached=float(got.mean()), fresh=float(want.mean()), cached_per_head=got,
            fresh_per_head=want, age=self._ages[layer], cached_density=cached.density(),
            fresh_density=fresh.density(),
        )  # fmt: skip

    def _prepare_measure(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor | None, what: str
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...], C.Layout | None]:
        """measure()'s local checks: (q3, k3, signature, layout)."""
        self._layer(layer, what)
        if self._patterns[layer] is None:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: the layer holds no pattern yet (call select({layer}, q, k) first)",
            )
        q3, k3 = self._inputs(layer, q, k, what)
        seq_len, lay = self._global_length(q3, what)
        sig = _signature(q3, k3, seq_len)
        if sig != self._signatures[layer]:
            raise L.fail(
                L.ERR_SHAPE_MISMATCH,
                f"{what}: the cached pattern was selected for {_describe(self._signatures[layer])}"
                f", these inputs are {_describe(sig)}",
            )
        self._check_lse(lse, q3, what)
        if self._options.method == L.BLOCK_PRECISE and lse is None:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"{what}: method='precise' needs lse= for the fresh selection",
            )
        return q3, k3, sig, lay
