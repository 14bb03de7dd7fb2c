"""The ctypes binding of libmtrain's C API (include/mtrain/*.h).

Loads the libmtrain.so installed inside this package (or the file named by the
environment variable MTRAIN_LIBRARY, for development), declares the
structures and prototypes this package uses, and turns failing statuses into
MtrainError with mtrain's status name and its thread-local message.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import MtrainError

# ---- constants of mtrain.h / mtrain_layout.h / mtrain_comm.h / mtrain_backend.h ----

API_VERSION = 8
SUCCESS = 0

F32, BF16, F16, F64 = 0, 1, 2, 3
BUDGET_TOP_K, BUDGET_TOP_P = 0, 1
BLOCK_PRECISE, BLOCK_ANTIDIAG, BLOCK_MEANPOOL = 0, 1, 2
LAYOUT_KINDS = {"contiguous": 0, "zigzag": 1, "striped": 2, "balanced": 3}
MEMORY_HOST, MEMORY_DEVICE, MEMORY_ANY = 0, 1, 2
REDUCE_SUM, REDUCE_MAX = 0, 1
TAG_USER = 1 << 20

# status codes (mtrain.h MTRAIN_STATUS_TABLE); names come from the library
ERR_NULL_POINTER = -1
ERR_INVALID_ARGUMENT = -2
ERR_SHAPE_MISMATCH = -3
ERR_HEAD_MISMATCH = -4
ERR_UNSUPPORTED_DTYPE = -5
ERR_UNSUPPORTED_HEAD_DIM = -6
ERR_INVALID_PATTERN = -7
ERR_NONFINITE = -8
ERR_OUT_OF_MEMORY = -9
ERR_IO = -10
ERR_COMM = -14
ERR_TIMEOUT = -15
ERR_NOT_SUPPORTED = -16
ERR_INVALID_CONFIG = -17
ERR_INVALID_BUDGET = -18
ERR_INTERNAL = -19

MAX_DIMS = 4


class Tensor(ctypes.Structure):
    """mtrain_tensor_t."""

    _fields_ = (
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
    )


class Config(ctypes.Structure):
    """mtrain_config_t."""

    _fields_ = (
        ("api_version", ctypes.c_int32),
        ("backend", ctypes.c_char_p),
        ("granularity", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("check_inputs", ctypes.c_int32),
        ("softmax_scale", ctypes.c_double),
        ("deterministic", ctypes.c_int32),
    )


ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class Allocator(ctypes.Structure):
    """mtrain_allocator_t: the caller's allocator of a context."""

    _fields_ = [("alloc", ALLOC_FN), ("free", FREE_FN), ("user", ctypes.c_void_p)]


class Seqs(ctypes.Structure):
    """mtrain_seqs_t."""

    _fields_ = (("num_seqs", ctypes.c_int32), ("offsets", ctypes.POINTER(ctypes.c_int64)))


class HeadBudget(ctypes.Structure):
    """mtrain_head_budget_t."""

    _fields_ = (
        ("kind", ctypes.c_int),
        ("v_size", ctypes.c_int64),
        ("s_size", ctypes.c_int64),
        ("p_v", ctypes.c_double),
        ("p_s", ctypes.c_double),
        ("cap_v", ctypes.c_int64),
        ("cap_s", ctypes.c_int64),
    )


class EstimateOptions(ctypes.Structure):
    """mtrain_estimate_options_t (top_p_forced: 1 forces the sinks and the window in top-p
    mode too)."""

    _fields_ = (
        ("last_q", ctypes.c_int32),
        ("num_sinks", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("top_p_forced", ctypes.c_int32),
    )


class StructuredOptions(ctypes.Structure):
    """mtrain_structured_options_t (include/mtrain/mtrain_inputs.h): the options of
    mtrain_generate_structured, the library's reproducible inputs with the vertical-slash
    structure of real models. MTRAIN_STRUCTURED_INIT is StructuredOptions(1, 10000.0, 2.0, 4,
    16, 4.0). Used by the tools (tools/bench_model.py, tools/balance_measure.py)."""

    _fields_ = (
        ("seed", ctypes.c_uint64),
        ("rope_base", ctypes.c_double),
        ("mean_strength", ctypes.c_double),
        ("num_sinks", ctypes.c_int32),
        ("num_outliers", ctypes.c_int32),
        ("outlier_strength", ctypes.c_double),
    )


class BlockOptions(ctypes.Structure):
    """mtrain_block_options_t (SPEC.md section 9)."""

    _fields_ = (
        ("method", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_double),
        ("sink_blocks", ctypes.c_int32),
        ("local_blocks", ctypes.c_int32),
        ("stride", ctypes.c_int32),
        ("head_adaptive", ctypes.c_int32),
        ("noncausal", ctypes.c_int32),
    )


class BlockReport(ctypes.Structure):
    """mtrain_block_report_t: caller-owned per-head arrays (each may be NULL)."""

    _fields_ = (
        ("head_recall", ctypes.POINTER(ctypes.c_double)),
        ("head_top_k", ctypes.POINTER(ctypes.c_int32)),
        ("head_blocks", ctypes.POINTER(ctypes.c_int64)),
    )


class BalanceOptions(ctypes.Structure):
    """mtrain_balance_options_t."""

    _fields_ = (
        ("patterns", ctypes.POINTER(ctypes.c_void_p)),
        ("num_patterns", ctypes.c_int32),
        ("ranks_per_node", ctypes.c_int32),
    )


# ---- the communicator table (mtrain_comm.h) ----

STATUS = ctypes.c_int
SIZE_T = ctypes.c_size_t
VOIDP = ctypes.c_void_p
RANK_FN = ctypes.CFUNCTYPE(ctypes.c_int, VOIDP)
ISEND_FN = ctypes.CFUNCTYPE(
    STATUS, VOIDP, VOIDP, SIZE_T, ctypes.c_int, ctypes.c_int, ctypes.POINTER(VOIDP)
)
WAIT_FN = ctypes.CFUNCTYPE(STATUS, VOIDP, VOIDP)
ALLREDUCE_FN = ctypes.CFUNCTYPE(STATUS, VOIDP, VOIDP, ctypes.c_int64, ctypes.c_int, ctypes.c_int)
ALLGATHER_FN = ctypes.CFUNCTYPE(STATUS, VOIDP, VOIDP, VOIDP, SIZE_T)
BARRIER_FN = ctypes.CFUNCTYPE(STATUS, VOIDP)
SPLIT_FN = ctypes.CFUNCTYPE(STATUS, VOIDP, ctypes.c_int, ctypes.c_int, ctypes.POINTER(VOIDP))
SET_STREAM_FN = ctypes.CFUNCTYPE(STATUS, VOIDP, VOIDP)
ABORT_FN = ctypes.CFUNCTYPE(None, VOIDP, ctypes.c_int)
DESTROY_FN = ctypes.CFUNCTYPE(None, VOIDP)


class CommOps(ctypes.Structure):
    """mtrain_comm_ops_t."""

    _fields_ = (
        ("api_version", ctypes.c_int32),
        ("name", ctypes.c_char_p),
        ("memory_space", ctypes.c_int),
        ("rank", RANK_FN),
        ("size", RANK_FN),
        ("isend", ISEND_FN),
        ("irecv", ISEND_FN),
        ("wait", WAIT_FN),
        ("allreduce", ALLREDUCE_FN),
        ("allgather", ALLGATHER_FN),
        ("barrier", BARRIER_FN),
        ("split", SPLIT_FN),
        ("set_data_stream", SET_STREAM_FN),
        ("abort", ABORT_FN),
        ("destroy", DESTROY_FN),
        ("allreduce_device", ALLREDUCE_FN),  # optional; the package's gloo table leaves it NULL
    )


class Comm(ctypes.Structure):
    """struct mtrain_comm: a table plus its state."""

    _fields_ = (("ops", ctypes.POINTER(CommOps)), ("state", VOIDP))


# ---- loading ----


def _library_path() -> str:
    env = os.environ.get("MTRAIN_LIBRARY")
    if env:
        return env
    here = Path(__file__).resolve().parent
    for name in ("libmtrain.so", "libmtrain.dylib"):
        if (here / name).exists():
            return str(here / name)
    raise MtrainError(
        ERR_IO,
        "MTRAIN_ERR_IO",
        f"libmtrain was not found in {here} (the package was not installed with pip install ., "
        "or set MTRAIN_LIBRARY to a libmtrain.so)",
    )


P = ctypes.c_void_p
I32 = ctypes.c_int32
I64 = ctypes.c_int64
PP = ctypes.POINTER(ctypes.c_void_p)
TP = ctypes.POINTER(Tensor)


class EstimateTimes(ctypes.Structure):
    """mtrain_estimate_times_t: seconds of the parts of the thread's last estimate."""

    _fields_ = (
        ("scores", ctypes.c_double),
        ("select", ctypes.c_double),
        ("stages", ctypes.c_double),
        ("copies", ctypes.c_double),
        ("reduce", ctypes.c_double),
    )


# name: (restype, argtypes)
_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "mtrain_status_name": (ctypes.c_char_p, (STATUS,)),
    "mtrain_last_error": (ctypes.c_char_p, ()),
    "mtrain_estimate_last_times": (EstimateTimes, ()),
    "mtrain_clear_error": (None, ()),
    "mtrain_error": (STATUS, (STATUS, ctypes.c_char_p, ctypes.c_char_p)),
    "mtrain_backend_list": (ctypes.c_int, (ctypes.POINTER(ctypes.c_char_p), ctypes.c_int)),
    "mtrain_context_create": (STATUS, (ctypes.POINTER(Config), P, PP)),
    "mtrain_context_destroy": (None, (P,)),
    "mtrain_context_set_allocator": (STATUS, (P, ctypes.POINTER(Allocator))),
    "mtrain_context_backend_name": (ctypes.c_char_p, (P,)),
    "mtrain_context_rank": (ctypes.c_int, (P,)),
    "mtrain_context_world": (ctypes.c_int, (P,)),
    "mtrain_pattern_create": (STATUS, (I64, I32, I32, PP)),
    "mtrain_pattern_create_dense": (STATUS, (I64, I32, I32, PP)),
    "mtrain_pattern_create_noncausal": (STATUS, (I64, I32, I32, PP)),
    "mtrain_pattern_is_causal": (ctypes.c_int, (P,)),
    "mtrain_pattern_destroy": (None, (P,)),
    "mtrain_pattern_set_head": (
        STATUS,
        (P, I32, ctypes.POINTER(I32), I32, ctypes.POINTER(I64), I32),
    ),
    "mtrain_pattern_set_block_mask": (STATUS, (P, I32, ctypes.POINTER(ctypes.c_uint8))),
    "mtrain_pattern_seq_len": (I64, (P,)),
    "mtrain_pattern_num_heads": (I32, (P,)),
    "mtrain_pattern_granularity": (I32, (P,)),
    "mtrain_pattern_num_blocks": (I64, (P,)),
    "mtrain_pattern_head_is_block_mask": (ctypes.c_int, (P, I32)),
    "mtrain_pattern_get_head": (
        STATUS,
        (
            P,
            I32,
            ctypes.POINTER(ctypes.POINTER(I32)),
            ctypes.POINTER(I32),
            ctypes.POINTER(ctypes.POINTER(I64)),
            ctypes.POINTER(I32),
        ),
    ),
    "mtrain_pattern_digest": (STATUS, (PP, I32, ctypes.POINTER(ctypes.c_uint64))),
    "mtrain_pattern_allowed": (ctypes.c_int, (P, I32, I64, I64)),
    "mtrain_pattern_count_pairs": (I64, (P, I32)),
    "mtrain_pattern_read_json": (STATUS, (ctypes.c_char_p, PP)),
    "mtrain_pattern_parse_json": (STATUS, (ctypes.c_char_p, ctypes.c_char_p, PP)),
    "mtrain_pattern_write_json": (STATUS, (ctypes.c_char_p, P)),
    "mtrain_plan_create": (STATUS, (P, ctypes.POINTER(Seqs), PP, PP)),
    "mtrain_plan_create_ring": (STATUS, (P, ctypes.POINTER(Seqs), PP, I32, PP, PP)),
    "mtrain_plan_destroy": (None, (P,)),
    "mtrain_plan_local_tokens": (I64, (P,)),
    "mtrain_plan_num_heads": (I32, (P,)),
    "mtrain_plan_num_seqs": (I32, (P,)),
    "mtrain_plan_seq_local_offset": (I64, (P, I32)),
    "mtrain_plan_computed_pairs": (I64, (P,)),
    "mtrain_plan_on_device": (ctypes.c_int, (P,)),
    "mtrain_plan_pattern": (STATUS, (P, I32, PP)),
    "mtrain_plan_create_estimated": (
        STATUS,
        (
            P,
            ctypes.POINTER(Seqs),
            TP,
            TP,
            ctypes.POINTER(HeadBudget),
            ctypes.POINTER(EstimateOptions),
            PP,
        ),
    ),
    "mtrain_budgets_read": (STATUS, (ctypes.c_char_p, PP)),
    "mtrain_budgets_destroy": (None, (P,)),
    "mtrain_budgets_num_layers": (I32, (P,)),
    "mtrain_budgets_num_heads": (I32, (P, I32)),
    "mtrain_budgets_get": (STATUS, (P, I32, I32, ctypes.POINTER(HeadBudget))),
    "mtrain_head_budget_validate": (STATUS, (ctypes.POINTER(HeadBudget),)),
    "mtrain_pattern_estimate": (
        STATUS,
        (P, TP, TP, ctypes.POINTER(HeadBudget), ctypes.POINTER(EstimateOptions), PP),
    ),
    "mtrain_pattern_estimate_batch": (
        STATUS,
        (
            P,
            ctypes.POINTER(Seqs),
            TP,
            TP,
            ctypes.POINTER(HeadBudget),
            ctypes.POINTER(EstimateOptions),
            PP,
        ),
    ),
    "mtrain_pattern_estimate_ring": (
        STATUS,
        (P, P, TP, TP, ctypes.POINTER(HeadBudget), ctypes.POINTER(EstimateOptions), PP),
    ),
    "mtrain_block_method_parse": (STATUS, (ctypes.c_char_p, ctypes.POINTER(ctypes.c_int))),
    "mtrain_pattern_select_blocks": (
        STATUS,
        (P, TP, TP, TP, ctypes.POINTER(BlockOptions), ctypes.POINTER(BlockReport), PP),
    ),
    "mtrain_pattern_select_blocks_ring": (
        STATUS,
        (P, P, TP, TP, TP, ctypes.POINTER(BlockOptions), ctypes.POINTER(BlockReport), PP),
    ),
    "mtrain_block_cache_create": (STATUS, (I32, I32, PP)),
    "mtrain_block_cache_destroy": (None, (P,)),
    "mtrain_block_cache_select": (
        STATUS,
        (
            P,
            I32,
            P,
            TP,
            TP,
            TP,
            ctypes.POINTER(BlockOptions),
            ctypes.POINTER(BlockReport),
            PP,
            ctypes.POINTER(I32),
        ),
    ),
    "mtrain_block_cache_select_ring": (
        STATUS,
        (
            P,
            I32,
            P,
            P,
            TP,
            TP,
            TP,
            ctypes.POINTER(BlockOptions),
            ctypes.POINTER(BlockReport),
            PP,
            ctypes.POINTER(I32),
        ),
    ),
    "mtrain_block_cache_due": (STATUS, (P, I32, ctypes.POINTER(ctypes.c_int))),
    "mtrain_block_cache_invalidate": (STATUS, (P, I32)),
    "mtrain_block_cache_counts": (STATUS, (P, I32, ctypes.POINTER(I64), ctypes.POINTER(I64))),
    "mtrain_pattern_clone": (STATUS, (P, PP)),
    "mtrain_cpu_pattern_recall": (
        STATUS,
        (
            P,
            I32,
            I32,
            ctypes.c_double,
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_double),
        ),
    ),
    "mtrain_attention_forward": (STATUS, (P, P, TP, TP, TP, TP, TP)),
    "mtrain_attention_backward": (STATUS, (P, P, TP, TP, TP, TP, TP, TP, TP, TP, TP)),
    "mtrain_layout_create": (
        STATUS,
        (ctypes.c_int, I64, I32, I32, ctypes.POINTER(BalanceOptions), PP),
    ),
    "mtrain_layout_destroy": (None, (P,)),
    "mtrain_layout_local_tokens": (I64, (P, I32)),
    "mtrain_layout_padded_len": (I64, (P,)),
    "mtrain_layout_rank_token_index": (STATUS, (P, I32, ctypes.POINTER(I64))),
    "mtrain_layout_variant": (ctypes.c_char_p, (P,)),
    "mtrain_cuda_device_count": (ctypes.c_int, ()),
    "mtrain_cuda_set_stream": (STATUS, (P, P)),
    "mtrain_cuda_set_async": (STATUS, (P, ctypes.c_int)),
    "mtrain_context_check_deferred": (STATUS, (P,)),
    "mtrain_comm_split": (STATUS, (P, ctypes.c_int, ctypes.c_int, PP)),
    "mtrain_comm_destroy": (None, (P,)),
    "mtrain_comm_rank": (ctypes.c_int, (P,)),
    "mtrain_comm_size": (ctypes.c_int, (P,)),
}


# entry points of optional parts of the library (the NCCL communicator)
_OPTIONAL_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "mtrain_nccl_unique_id": (STATUS, (P,)),
    "mtrain_comm_create_nccl": (
        STATUS,
        (P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_double, PP),
    ),
}
NCCL_ID_BYTES = 128


class _Lib:
    """The loaded library with typed entry points (attribute access by C name
    without the mtrain_ prefix)."""

    def __init__(self) -> None:
        self.path = _library_path()
        self.dll = ctypes.CDLL(self.path)
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(self.dll, name)
            fn.restype = restype
            fn.argtypes = list(argtypes)
        self.optional: set[str] = set()
        for name, (restype, argtypes) in _OPTIONAL_PROTOTYPES.items():
            fn = getattr(self.dll, name, None)
            if fn is None:
                continue
            fn.restype = restype
            fn.argtypes = list(argtypes)
            self.optional.add(name[len("mtrain_") :])

    def has(self, name: str) -> bool:
        """Whether the optional entry point mtrain_<name> is in this build."""
        return name in self.optional

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self.dll, "mtrain_" + name)


_lib: _Lib | None = None


def lib() -> _Lib:
    """The loaded library (loaded on first use)."""
    global _lib  # noqa: PLW0603 -- one library per process, loaded lazily
    if _lib is None:
        _lib = _Lib()
    return _lib


def status_name(code: int) -> str:
    """mtrain_status_name of a status code."""
    name = lib().status_name(code)
    return name.decode() if name else "unknown"


def check(code: int, what: str = "") -> None:
    """Raises MtrainError (status name and mtrain_last_error) when code fails."""
    if code == SUCCESS:
        return
    msg = lib().last_error()
    text = msg.decode(errors="replace") if msg else ""
    if what:
        text = f"{what}: {text}" if text else what
    raise MtrainError(code, status_name(code), text)


def fail(code: int, message: str) -> MtrainError:
    """An MtrainError for a check done in Python, with the library's status name."""
    return MtrainError(code, status_name(code), message)


def set_error(code: int, message: str) -> int:
    """Sets this thread's mtrain_last_error (for communicator callbacks) and
    returns code."""
    return int(lib().error(code, b"%s", message.encode(errors="replace")))
