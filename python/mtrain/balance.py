"""SparseBalance from Python: sparsity-aware batching and bidirectional
per-head sparsity tuning (docs/BALANCE.md, "SparseBalance").

A training loop calls :func:`balance_batch` once per step with the lengths of
the global batch's sequences and gets, for each sequence, the data-parallel
rank and micro-batch that should compute it, and for each rank the per-head
budget scale it should estimate with. With ``split_above`` the largest
documents are split over several ranks as a context-parallel ring, and each
document's ranks are in ``BalanceResult.ranks_of``. Everything is a prediction of the C
library's calibrated cost predictor (``mtrain_balance.h``), reached through
ctypes; the prototypes are declared here on the loaded library.
:func:`mass_curve` gives the heads' sensitivity (attention mass kept per
budget level) from one layer's q and k, as the estimate scores them.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _lib
from ._lib import EstimateOptions, HeadBudget

__all__ = ["DEFAULT_LEVELS", "BalanceResult", "balance_batch", "mass_curve"]

DEFAULT_LEVELS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
_METHODS = {"cost": 0, "tokens": 1, "sorted": 2}
_SPREADS = {"even": 0, "local": 2}


class _Calibration(ctypes.Structure):
    _fields_ = (
        ("pair_s", ctypes.c_double),
        ("row_s", ctypes.c_double),
        ("seq_s", ctypes.c_double),
        ("linear_flops", ctypes.c_double),
        ("linear_seq_s", ctypes.c_double),
    )


class _Model(ctypes.Structure):
    _fields_ = (
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
    )


class _PositionModel(ctypes.Structure):
    _fields_ = (
        ("num_sinks", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("spread", ctypes.c_int),
        ("seed", ctypes.c_uint64),
        ("budget_context", ctypes.c_int64),
    )


class _BatchOptions(ctypes.Structure):
    _fields_ = (
        ("ranks", ctypes.c_int32),
        ("micro_batches", ctypes.c_int32),
        ("method", ctypes.c_int),
        ("tune", ctypes.c_int32),
        ("min_level", ctypes.c_int32),
        ("max_level", ctypes.c_int32),
        ("target_s", ctypes.c_double),
    )


class _SplitOptions(ctypes.Structure):
    _fields_ = (
        ("split_above", ctypes.c_double),
        ("ring_overhead", ctypes.c_double),
        ("max_ranks", ctypes.c_int32),
    )


class _Split(ctypes.Structure):
    _fields_ = (
        ("n", ctypes.c_int32),
        ("ranks", ctypes.c_int32),
        ("num_split", ctypes.c_int32),
        ("rank_of", ctypes.POINTER(ctypes.c_int32)),
        ("num_ranks", ctypes.POINTER(ctypes.c_int32)),
        ("offset", ctypes.POINTER(ctypes.c_int32)),
        ("group", ctypes.POINTER(ctypes.c_int32)),
        ("micro_of", ctypes.POINTER(ctypes.c_int32)),
        ("split_order", ctypes.POINTER(ctypes.c_int32)),
        ("share", ctypes.POINTER(ctypes.c_double)),
        ("start", ctypes.POINTER(ctypes.c_double)),
        ("rank_load", ctypes.POINTER(ctypes.c_double)),
        ("rank_idle", ctypes.POINTER(ctypes.c_double)),
    )


class _Report(ctypes.Structure):
    _fields_ = (
        ("max_before", ctypes.c_double),
        ("mean_before", ctypes.c_double),
        ("max_after", ctypes.c_double),
        ("mean_after", ctypes.c_double),
        ("target_s", ctypes.c_double),
        ("recall_before", ctypes.c_double),
        ("recall_after", ctypes.c_double),
        ("worst_recall_before", ctypes.c_double),
        ("worst_recall_after", ctypes.c_double),
        ("ranks_over_target", ctypes.c_int32),
        ("empty_ranks", ctypes.c_int32),
        ("moves_down", ctypes.c_int64),
        ("moves_up", ctypes.c_int64),
    )


_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)
_DP = ctypes.POINTER(ctypes.c_double)
_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "mtrain_balance_calibration_read": (
        ctypes.c_int,
        (ctypes.c_char_p, ctypes.POINTER(_Calibration)),
    ),
    "mtrain_balance_predictor_create": (
        ctypes.c_int,
        (
            _P,
            _DP,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.POINTER(_PositionModel),
            ctypes.c_int32,
            ctypes.POINTER(_Calibration),
            ctypes.POINTER(_Model),
            _PP,
        ),
    ),
    "mtrain_balance_predictor_destroy": (None, (_P,)),
    "mtrain_balance_predictor_num_heads": (ctypes.c_int32, (_P,)),
    "mtrain_balance_predictor_set_row_pairs": (ctypes.c_int, (_P, ctypes.POINTER(ctypes.c_double))),
    "mtrain_balance_predictor_read_row_pairs": (ctypes.c_int, (_P, ctypes.c_char_p)),
    "mtrain_balance_predictor_set_row_pairs_grid": (
        ctypes.c_int,
        (_P, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)),
    ),
    "mtrain_balance_batch": (
        ctypes.c_int,
        (
            _P,
            _I64P,
            ctypes.c_int32,
            _DP,
            ctypes.POINTER(_BatchOptions),
            _I32P,
            _I32P,
            _I32P,
            _DP,
            _DP,
            ctypes.POINTER(_Report),
        ),
    ),
    "mtrain_balance_batch_split": (
        ctypes.c_int,
        (
            _P,
            _I64P,
            ctypes.c_int32,
            _DP,
            ctypes.POINTER(_BatchOptions),
            ctypes.POINTER(_SplitOptions),
            ctypes.POINTER(_Split),
            _I32P,
            _DP,
            _DP,
            ctypes.POINTER(_Report),
        ),
    ),
    "mtrain_balance_split_free": (None, (ctypes.POINTER(_Split),)),
    "mtrain_balance_mass_curve": (
        ctypes.c_int,
        (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.POINTER(HeadBudget),
            _DP,
            ctypes.c_int32,
            ctypes.c_int64,
            ctypes.POINTER(EstimateOptions),
            _DP,
        ),
    ),
}
_declared = False


def _dll() -> ctypes.CDLL:
    global _declared  # noqa: PLW0603 -- the prototypes are set once per process
    dll = _lib.lib().dll
    if not _declared:
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(dll, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
        _declared = True
    return dll


def _bad(message: str) -> Exception:
    return _lib.fail(_lib.ERR_INVALID_ARGUMENT, message)


@dataclass
class BalanceResult:
    """What :func:`balance_batch` decided (all times are predictions).

    Attributes:
        rank_of: the data-parallel rank of each sequence (a split one: the
            first of its ranks).
        micro_of: its micro-batch within that rank (-1: split, run in the
            split phase before the rank's micro-batches, in ``split_order``).
        levels: [world, heads] budget level index per rank and head (heads over
            all layers, layer-major), after tuning; with splitting they apply
            to the rank's whole sequences (split ones run at the base level).
        head_scales: [world, heads] the matching budget scale (multiply the
            head's v_size/s_size, or caps for top-p entries, by it).
        rank_seconds_before: [world] predicted seconds after batching, untuned.
        rank_seconds_after: [world] predicted seconds after tuning.
        report: the C report (max/mean before and after, target, recall mean
            and worst before and after, ranks over target, level moves); with
            ``split_above``, also num_split, split_idle_max_s, split_idle_sum_s.
        ranks_of: each sequence's ranks, ascending: one for a whole sequence,
            k >= 2 distinct ones for a split sequence (its context-parallel
            ring; the position in the list is the rank's index in the ring).
        split_order: the split sequences in the order every rank of their
            rings runs them (empty without splitting).
        rank_idle_seconds: [world] waits in the split phase (zeros without).
    """

    rank_of: list[int]
    micro_of: list[int]
    levels: np.ndarray
    head_scales: np.ndarray
    rank_seconds_before: np.ndarray
    rank_seconds_after: np.ndarray
    report: dict[str, float] = field(default_factory=dict)
    ranks_of: list[list[int]] = field(default_factory=list)
    split_order: list[int] = field(default_factory=list)
    rank_idle_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))


def _calibration(calibration: str | os.PathLike[str] | Mapping[str, float]) -> _Calibration:
    cal = _Calibration()
    if isinstance(calibration, Mapping):
        for key in ("pair_s", "row_s", "seq_s", "linear_flops"):
            if key not in calibration:
                raise _bad(f"calibration: missing key {key!r}")
            setattr(cal, key, float(calibration[key]))
        cal.linear_seq_s = float(calibration.get("linear_seq_s", 0.0))  # optional, as in files
        return cal
    _lib.check(
        _dll().mtrain_balance_calibration_read(os.fsencode(calibration), ctypes.byref(cal)),
        "balance_batch: calibration",
    )
    return cal


def _read_budgets(path: str | os.PathLike[str]) -> int:
    handle = ctypes.c_void_p()
    _lib.check(_lib.lib().budgets_read(os.fsencode(path), ctypes.byref(handle)), "budgets")
    return handle.value or 0


def balance_batch(
    lengths: Sequence[int],
    world: int,
    budgets: str | os.PathLike[str],
    calibration: str | os.PathLike[str] | Mapping[str, float],
    *,
    micro_batches: int = 1,
    method: str = "cost",
    tune: bool = True,
    mass: Any = None,
    levels: Sequence[float] = DEFAULT_LEVELS,
    bounds: tuple[float, float] | None = None,
    target_s: float | None = None,
    budget_context: int = 0,
    spread: str = "even",
    granularity: int = 128,
    model: Mapping[str, int] | None = None,
    split_above: float = 0.0,
    ring_overhead: float = 1.01,
    max_split: int = 0,
    num_sinks: int = 30,
    window: int = 100,
    row_pairs: Any = None,
    row_pairs_lengths: Sequence[int] | None = None,
    row_pairs_file: str | os.PathLike[str] | None = None,
) -> BalanceResult:
    """Deals a global batch's sequences to ``world`` ranks and tunes sparsity.

    Args:
        lengths: token count of every sequence of the global batch (>= 1 each).
        world: data-parallel ranks.
        budgets: MInference budget file (every layer and head).
        calibration: a calibration JSON (``data/calibration/``) or a mapping
            with pair_s, row_s, seq_s and linear_flops (and optionally
            linear_seq_s, the linear layers' seconds per sequence; 0 when absent).
        micro_batches: micro-batches per rank.
        method: "cost" (predicted cost, the default), "tokens" (token-count
            balancing) or "sorted" (length-sorted batching).
        tune: bidirectional per-head sparsity tuning after batching.
        mass: [heads, len(levels)] attention mass kept per head and level (see
            :func:`mass_curve`, one layer at a time); required with tune.
        levels: budget scales, strictly increasing, holding 1.0 (untuned).
        bounds: (lowest, highest) scale the tuner may choose (default: all).
        target_s: step target in seconds (default: the mean rank time).
        budget_context: scale budget counts by N / budget_context (0: as given).
        spread: "even" or "local" placement of the position model.
        granularity: block size G.
        model: linear-layer dimensions (hidden, intermediate, vocab, kv_heads,
            head_dim); default Qwen2.5-3B. hidden 0 leaves them out.
        split_above: split every sequence whose predicted seconds (token
            count with method "tokens") exceed this times the mean rank load
            over the fewest ranks that bring its per-rank share under it, as
            a context-parallel ring (docs/BALANCE.md, "Splitting the longest
            documents over a ring"); 0: no splitting.
        ring_overhead: factor (>= 1) on a split sequence's attention share
            per rank (default 1.01, from the measured ring).
        max_split: most ranks one sequence may span (0: world).
        num_sinks, window: the position model's forced sink keys and local
            token diagonals (the estimate's options; defaults 30 and 100).
        row_pairs: [heads, len(levels)] measured pairs per query row of each
            head's estimated pattern at each level (pairs / the measured
            sequence's length; heads over all layers, layer-major), to price
            the heads by them instead of the position model: a sequence of N
            tokens costs min(N (N + 1) / 2, round(row_pairs * N)) pairs.
        row_pairs_lengths: with row_pairs of shape [len(row_pairs_lengths),
            heads, len(levels)], the lengths (increasing) at which each row
            was measured: at N the pairs per row are interpolated linearly in
            log N between the two measured lengths around N (the nearest
            end's outside them), then charged as above (docs/BALANCE.md,
            "Pricing on a length grid").
        row_pairs_file: a measured table on a length grid (format
            "mtrain-row-pairs-1", written by tools/balance_row_pairs.py, e.g.
            data/calibration/qwen2.5-3b-row-pairs.json) instead of row_pairs:
            its levels, granularity, layers and heads must be this call's.

    Returns:
        BalanceResult. Raises MtrainError naming the bad input.
    """
    lens = np.ascontiguousarray(np.asarray(lengths, dtype=np.int64).reshape(-1))
    if lens.size == 0:
        raise _bad("balance_batch: lengths is empty (the batch must hold at least one sequence)")
    if method not in _METHODS:
        raise _bad(f"balance_batch: method {method!r} is not one of {sorted(_METHODS)}")
    if spread not in _SPREADS:
        raise _bad(f"balance_batch: spread {spread!r} is not one of {sorted(_SPREADS)}")
    scales = np.ascontiguousarray(np.asarray(levels, dtype=np.float64).reshape(-1))
    base = [i for i, s in enumerate(scales) if s == 1.0]
    if not base:
        raise _bad("balance_batch: levels must hold 1.0 (the untuned budget)")
    lo, hi = -1, -1
    if bounds is not None:
        sel = [i for i, s in enumerate(scales) if bounds[0] <= s <= bounds[1]]
        if not sel:
            raise _bad(f"balance_batch: bounds {bounds} hold no level of {list(scales)}")
        lo, hi = sel[0], sel[-1]
    cal = _calibration(calibration)
    mdl = _Model(2048, 11008, 151936, 2, 128)
    for key, value in (model or {}).items():
        if key not in ("hidden", "intermediate", "vocab", "kv_heads", "head_dim"):
            raise _bad(f"balance_batch: model has no dimension {key!r}")
        setattr(mdl, key, int(value))
    if num_sinks < 0 or window < 0:
        raise _bad(f"balance_batch: num_sinks {num_sinks} and window {window} must be >= 0")
    pm = _PositionModel(int(num_sinks), int(window), _SPREADS[spread], 0, int(budget_context))
    dll = _dll()
    b = _read_budgets(budgets)
    pred = ctypes.c_void_p()
    try:
        _lib.check(
            dll.mtrain_balance_predictor_create(
                b,
                scales.ctypes.data_as(_DP),
                len(scales),
                base[0],
                ctypes.byref(pm),
                int(granularity),
                ctypes.byref(cal),
                ctypes.byref(mdl),
                ctypes.byref(pred),
            ),
            "balance_batch",
        )
    finally:
        _lib.lib().budgets_destroy(b)
    try:
        heads = dll.mtrain_balance_predictor_num_heads(pred)
        if row_pairs is not None:
            rp = np.ascontiguousarray(np.asarray(row_pairs, dtype=np.float64))
            if row_pairs_lengths is None:
                if rp.shape != (heads, len(scales)):
                    raise _bad(
                        f"balance_batch: row_pairs has shape {rp.shape}, expected "
                        f"({heads}, {len(scales)}) (heads over all layers x levels)"
                    )
                _lib.check(
                    dll.mtrain_balance_predictor_set_row_pairs(pred, rp.ctypes.data_as(_DP)),
                    "balance_batch",
                )
            else:
                rl = np.ascontiguousarray(np.asarray(row_pairs_lengths, dtype=np.int64).reshape(-1))
                if rp.shape != (rl.size, heads, len(scales)):
                    raise _bad(
                        f"balance_batch: row_pairs has shape {rp.shape}, expected "
                        f"({rl.size}, {heads}, {len(scales)}) (row_pairs_lengths x heads over "
                        "all layers x levels)"
                    )
                _lib.check(
                    dll.mtrain_balance_predictor_set_row_pairs_grid(
                        pred, int(rl.size), rl.ctypes.data_as(_I64P), rp.ctypes.data_as(_DP)
                    ),
                    "balance_batch",
                )
        elif row_pairs_lengths is not None:
            raise _bad("balance_batch: row_pairs_lengths without row_pairs")
        if row_pairs_file is not None:
            if row_pairs is not None:
                raise _bad("balance_batch: give row_pairs or row_pairs_file, not both")
            _lib.check(
                dll.mtrain_balance_predictor_read_row_pairs(pred, os.fsencode(row_pairs_file)),
                "balance_batch",
            )
        mass_arr = None
        if mass is not None:
            mass_arr = np.ascontiguousarray(np.asarray(mass, dtype=np.float64))
            if mass_arr.shape != (heads, len(scales)):
                raise _bad(
                    f"balance_batch: mass has shape {mass_arr.shape}, expected "
                    f"({heads}, {len(scales)}) (heads over all layers x levels)"
                )
        elif tune:
            raise _bad(
                "balance_batch: tune=True needs mass, the heads' mass curves "
                "(mtrain.mass_curve per layer), or pass tune=False"
            )
        n = int(lens.size)
        opts = _BatchOptions(
            int(world),
            int(micro_batches),
            _METHODS[method],
            int(bool(tune)),
            lo,
            hi,
            float(target_s or 0.0),
        )
        rank_of = np.zeros(n, dtype=np.int32)
        micro_of = np.zeros(n, dtype=np.int32)
        w = max(int(world), 1)
        lv = np.zeros((w, heads), dtype=np.int32)
        before = np.zeros(w, dtype=np.float64)
        after = np.zeros(w, dtype=np.float64)
        rep = _Report()
        mass_p = mass_arr.ctypes.data_as(_DP) if mass_arr is not None else None
        ranks_of: list[list[int]] = []
        split_order: list[int] = []
        idle = np.zeros(w, dtype=np.float64)
        if split_above:
            ranks_of, split_order, idle = _batch_split(
                dll,
                pred,
                lens,
                mass_p,
                opts,
                (split_above, ring_overhead, max_split),
                (rank_of, micro_of, lv, before, after),
                rep,
            )
        else:
            _lib.check(
                dll.mtrain_balance_batch(
                    pred,
                    lens.ctypes.data_as(_I64P),
                    n,
                    mass_p,
                    ctypes.byref(opts),
                    rank_of.ctypes.data_as(_I32P),
                    micro_of.ctypes.data_as(_I32P),
                    lv.ctypes.data_as(_I32P),
                    before.ctypes.data_as(_DP),
                    after.ctypes.data_as(_DP),
                    ctypes.byref(rep),
                ),
                "balance_batch",
            )
            ranks_of = [[int(r)] for r in rank_of]
    finally:
        dll.mtrain_balance_predictor_destroy(pred)
    report: dict[str, float] = {name: getattr(rep, name) for name, _ in _Report._fields_}
    if split_above:
        report["num_split"] = len(split_order)
        report["split_idle_max_s"] = float(idle.max())
        report["split_idle_sum_s"] = float(idle.sum())
    return BalanceResult(
        rank_of=rank_of.tolist(),
        micro_of=micro_of.tolist(),
        levels=lv,
        head_scales=scales[lv],
        rank_seconds_before=before,
        rank_seconds_after=after,
        report=report,
        ranks_of=ranks_of,
        split_order=split_order,
        rank_idle_seconds=idle,
    )


def _batch_split(
    dll: ctypes.CDLL,
    pred: ctypes.c_void_p,
    lens: np.ndarray,
    mass_p: Any,
    opts: _BatchOptions,
    split: tuple[float, float, int],
    outs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    rep: _Report,
) -> tuple[list[list[int]], list[int], np.ndarray]:
    """mtrain_balance_batch_split: fills rank_of, micro_of, levels, before and
    after (outs) and rep; returns each sequence's ranks, the split order and
    the ranks' split-phase waits, copied out of the C result before it is
    freed."""
    rank_of, micro_of, lv, before, after = outs
    so = _SplitOptions(float(split[0]), float(split[1]), int(split[2]))
    res = _Split()
    _lib.check(
        dll.mtrain_balance_batch_split(
            pred,
            lens.ctypes.data_as(_I64P),
            int(lens.size),
            mass_p,
            ctypes.byref(opts),
            ctypes.byref(so),
            ctypes.byref(res),
            lv.ctypes.data_as(_I32P),
            before.ctypes.data_as(_DP),
            after.ctypes.data_as(_DP),
            ctypes.byref(rep),
        ),
        "balance_batch",
    )
    try:
        n = int(res.n)
        offset = np.ctypeslib.as_array(res.offset, shape=(n + 1,)).copy()
        group = np.ctypeslib.as_array(res.group, shape=(int(offset[-1]),)).copy()
        rank_of[:] = np.ctypeslib.as_array(res.rank_of, shape=(n,))
        micro_of[:] = np.ctypeslib.as_array(res.micro_of, shape=(n,))
        order = [int(res.split_order[j]) for j in range(int(res.num_split))]
        idle = np.ctypeslib.as_array(res.rank_idle, shape=(int(res.ranks),)).copy()
    finally:
        dll.mtrain_balance_split_free(ctypes.byref(res))
    ranks_of = [[int(r) for r in group[offset[i] : offset[i + 1]]] for i in range(n)]
    return ranks_of, order, idle


def mass_curve(
    q: Any,
    k: Any,
    budgets: str | os.PathLike[str],
    layer: int,
    *,
    levels: Sequence[float] = DEFAULT_LEVELS,
    granularity: int = 128,
    budget_context: int = 0,
    last_q: int = 64,
    num_sinks: int = 30,
    window: int = 100,
) -> np.ndarray:
    """Attention mass kept by each head of one layer at each budget level.

    q [N, Hq, d] and k [N, Hkv, d] are one sequence's post-RoPE queries and
    keys (numpy or CPU torch, converted to float32). The estimate's top-p
    scores (docs/SPEC.md section 2) over the last ``last_q`` queries are
    formed, and each level's budget selects as the static top-k selection;
    the result [Hq, len(levels)] is the share of the scores kept. Stack the
    layers' results (layer-major) for :func:`balance_batch`'s mass.
    """
    qa = np.ascontiguousarray(np.asarray(_host(q), dtype=np.float32))
    ka = np.ascontiguousarray(np.asarray(_host(k), dtype=np.float32))
    if qa.ndim != 3 or ka.ndim != 3 or qa.shape[0] != ka.shape[0] or qa.shape[2] != ka.shape[2]:
        raise _lib.fail(
            _lib.ERR_SHAPE_MISMATCH,
            f"mass_curve: q {qa.shape} and k {ka.shape} must be [N, Hq, d] and [N, Hkv, d]",
        )
    n, hq, d = qa.shape
    scales = np.ascontiguousarray(np.asarray(levels, dtype=np.float64).reshape(-1))
    b = _read_budgets(budgets)
    try:
        nh = _lib.lib().budgets_num_heads(b, int(layer))
        if nh != hq:
            raise _bad(f"mass_curve: layer {layer} of the budgets has {nh} heads, q has {hq}")
        hb = (HeadBudget * hq)()
        for h in range(hq):
            _lib.check(_lib.lib().budgets_get(b, int(layer), h, ctypes.byref(hb[h])), "mass_curve")
    finally:
        _lib.lib().budgets_destroy(b)
    out = np.zeros((hq, len(scales)), dtype=np.float64)
    eo = EstimateOptions(int(last_q), int(num_sinks), int(window))
    _lib.check(
        _dll().mtrain_balance_mass_curve(
            qa.ctypes.data,
            ka.ctypes.data,
            n,
            hq,
            ka.shape[1],
            d,
            int(granularity),
            hb,
            scales.ctypes.data_as(_DP),
            len(scales),
            int(budget_context),
            ctypes.byref(eo),
            out.ctypes.data_as(_DP),
        ),
        "mass_curve",
    )
    return out


def _host(x: Any) -> Any:
    """A torch tensor moved to the host (numpy arrays pass through)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().float().cpu().numpy()
    return x
