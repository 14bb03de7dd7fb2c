# The workload of tools/balance_measure.py: the document lengths (mtrain-balance batch's
# long-tail generator reproduced bit for bit, a file of lengths) and their scaling.

from __future__ import annotations

import math

_M64 = (1 << 64) - 1


def _mix64(state: int) -> tuple[int, int]:
    """tools/balance_batch.c's mix64 (splitmix64): the new state and the output."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def long_tail(world: int, tokens_per_rank: int, long_prob: float, seed: int) -> list[int]:
    """`mtrain-balance batch --long-tail`'s lengths, drawn exactly as tools/balance_batch.c does:
    long with probability long_prob, log-uniform in [131072, 524288], else in [1024, 16384],
    rounded up to a multiple of 128, until the batch holds tokens_per_rank * world tokens."""
    total = float(tokens_per_rank) * world
    s, out, acc = seed & _M64, [], 0.0
    while acc < total:
        s, z = _mix64(s)
        is_long = (z >> 11) * 2.0**-53 < long_prob
        lo, hi = (131072.0, 524288.0) if is_long else (1024.0, 16384.0)
        s, z = _mix64(s)
        x = lo * math.exp((z >> 11) * 2.0**-53 * math.log(hi / lo))
        v = (math.ceil(x) + 127) // 128 * 128
        out.append(v)
        acc += float(v)
    return out


def read_lengths(path: str) -> list[int]:
    """One length >= 1 per line; '#' starts a comment (as mtrain-balance batch --lengths)."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            if not text.isdigit() or int(text) < 1:
                raise SystemExit(f"balance_measure: {path}: line {no}: expected one length >= 1")
            out.append(int(text))
    if not out:
        raise SystemExit(f"balance_measure: {path}: no lengths")
    return out


def scale_length(n: int, scale: int, granularity: int) -> int:
    """n / scale rounded up to a multiple of the granularity."""
    return -(-n // (scale * granularity)) * granularity
