"""mtrain for PyTorch: distributed dynamic sparse attention (MTraining) as
torch ops over libmtrain. docs/PYTORCH.md describes the API.

    import mtrain
    o = mtrain.attention(q, k, v, budgets="data/budgets/...json", layer=3)
"""

from __future__ import annotations

from . import _lib
from ._core import (
    Pattern,
    TopK,
    TopP,
    block_mask_pattern,
    dense_pattern,
    load_pattern,
    parse_pattern,
    reset,
    synchronize,
    vertical_slash_pattern,
)
from .api import (
    BlockReport,
    SparsePlan,
    attention,
    estimate_pattern,
    last_estimate_times,
    select_blocks,
)
from .balance import DEFAULT_LEVELS, BalanceResult, balance_batch, mass_curve
from .block_cache import BlockPatternCache, RecallCheck
from .dispatch import Dispatched, DispatchInfo, dispatch, undispatch
from .errors import MtrainError
from .fallback import dense_fallback_counts
from .hf import register_transformers

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_LEVELS",
    "BalanceResult",
    "BlockPatternCache",
    "BlockReport",
    "DispatchInfo",
    "Dispatched",
    "MtrainError",
    "Pattern",
    "RecallCheck",
    "SparsePlan",
    "TopK",
    "TopP",
    "__version__",
    "attention",
    "backends",
    "balance_batch",
    "block_mask_pattern",
    "dense_fallback_counts",
    "dense_pattern",
    "dispatch",
    "estimate_pattern",
    "last_estimate_times",
    "library_path",
    "load_pattern",
    "mass_curve",
    "parse_pattern",
    "register_transformers",
    "reset",
    "select_blocks",
    "synchronize",
    "undispatch",
    "vertical_slash_pattern",
]


def backends() -> list[str]:
    """The backends compiled into the loaded libmtrain ("cpu-ref", "cpu", "cuda")."""
    import ctypes

    names = (ctypes.c_char_p * 16)()
    n = _lib.lib().backend_list(names, 16)
    return [names[i].decode() for i in range(min(n, 16)) if names[i]]


def library_path() -> str:
    """The libmtrain.so this package loaded."""
    return _lib.lib().path
