# ruff: noqa: N818  (CannotRun: a reason to print, not an error)
"""peers_common.py: what the peers of tools/bench_cuda_peers.py share (issue 21).

- CannotRun: a peer that cannot run here; its message is the one line the bench prints and the
  table shows ("cannot run: <reason>"): the import error's text, the unsupported feature, the
  version;
- reason(e): that line for any exception (its type and the first line of its text);
- time_limit(s): a per-peer limit (SIGALRM in the main thread; a call stuck inside C code is
  ended by the device script's `timeout` instead);
- flash_attn_peer(): FlashAttention's flash_attn_func (dense causal, GQA native), where the
  machine has the package (PyPI carries only its source: see docs/PERFORMANCE.md);
- flashinfer_reason(): why FlashInfer's block-sparse wrapper is not run here.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any


class CannotRun(Exception):
    """A peer that cannot run here; str(e) says exactly why."""


def reason(e: BaseException) -> str:
    """One line naming the exception and the first line of its text."""
    if isinstance(e, CannotRun):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raises CannotRun when the block runs past seconds (0: no limit)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise CannotRun(f"{what}: past its time limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def module_version(mod: Any) -> str:
    return str(getattr(mod, "__version__", "version unknown"))


def flash_attn_peer() -> tuple[Callable, str]:
    """flash_attn_func(q, k, v, causal=True) on [1, H, N, d] inputs (it takes [B, N, H, d]:
    the transposes are inside the timed call, as in any caller with this layout)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func
    except Exception as e:  # ImportError, or a .so built for another torch
        raise CannotRun(
            f"import flash_attn failed ({reason(e)}); PyPI has only its source distribution, "
            "whose CUDA build takes far longer than the 2 minutes allowed"
        ) from e

    def attn(q: Any, k: Any, v: Any) -> Any:
        o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return o.transpose(1, 2)

    return attn, f"flash_attn {module_version(flash_attn)}"


FLASHINFER_NOT_CARRIED = (
    "not carried: flashinfer-python 0.7.4 (the newest wheel, py3-none-any) is 96.6 MiB, over "
    "the 25 MiB of wheels the device call carries; older wheels (0.5-0.6, 6.6-17.5 MiB) need "
    "apache-tvm-ffi, cuda-python and nvidia-cutlass-dsl besides, and its block-sparse wrapper "
    "JIT-compiles the batch prefill kernels with nvcc on first use (several .cu files, minutes)"
)


def flashinfer_reason() -> str:
    """Why FlashInfer is not run: its import error here, or that it imports but is not
    exercised (the JIT compile of its prefill kernels does not fit the call's time)."""
    try:
        import flashinfer
    except Exception as e:
        return f"import flashinfer failed ({reason(e)}); {FLASHINFER_NOT_CARRIED}"
    return (
        f"flashinfer {module_version(flashinfer)} imports, but its BlockSparseAttentionWrapper "
        "JIT-compiles the batch prefill kernels with nvcc on first use, which does not fit the "
        "call's 90 s per-peer budget"
    )
