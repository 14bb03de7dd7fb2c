# The objectives of --fit-calibration's non-negative least squares (tools/balance_measure.py):
# what a fitted coefficient vector c of seconds ~ x @ c minimises over the measured calls.

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OBJECTIVES = ("relative", "log", "seconds", "share")
"""relative: sum (x c / y - 1)^2 (every call weighs the same; biased low: at the optimum the
mean relative error is minus the mean squared one); log: sum log(x c / y)^2 (symmetric in over-
and under-prediction); seconds: sum (x c - y)^2 (the longest calls dominate); share: the relative
error weighted by each call's share of the workload's time, sum w (x c / y - 1)^2 with w = the
call's seconds times the workload's tokens nearest its length (in log N) over its tokens."""


def shares(points: Sequence[int], seconds: Sequence[float], workload: Sequence[int]) -> np.ndarray:
    """Each fit point's share of the workload's time (the objective share's weights, summing to
    1): its seconds times the tokens of the workload's documents nearest its length in log N,
    over its own length (the documents it stands for, counted in its tokens)."""
    logs = np.log(np.asarray(points, dtype=np.float64))
    tokens = np.zeros(len(points))
    for n in workload:  # its nearest length; every point (layer) of that length counts it
        nearest = points[int(np.argmin(np.abs(logs - np.log(n))))]
        tokens[np.asarray(points) == nearest] += n
    w = np.asarray(seconds, dtype=np.float64) * tokens / np.asarray(points, dtype=np.float64)
    return w / w.sum()


def loss(x: np.ndarray, y: np.ndarray, coef: np.ndarray, objective: str, w: np.ndarray) -> float:
    """The objective's value at coef (w: the share weights, used by share alone)."""
    p = x @ coef
    if objective == "log":
        return float(np.sum(np.log(np.maximum(p, 1e-300) / y) ** 2))
    if objective == "seconds":
        return float(np.sum((p - y) ** 2))
    return float(np.sum((w if objective == "share" else 1.0) * (p / y - 1) ** 2))


def _weighted(x: np.ndarray, y: np.ndarray, row: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(x * row[:, None], y * row, rcond=None)
    return coef


def _log_fit(x: np.ndarray, y: np.ndarray, start: np.ndarray) -> np.ndarray | None:
    """Gauss-Newton on log(x c) - log(y) from start (the relative fit), step halved until the
    loss falls; None when it leaves x c > 0."""
    coef = start
    cur = loss(x, y, coef, "log", np.ones_like(y))
    for _ in range(100):
        p = x @ coef
        if (p <= 0).any():
            return None
        step, *_ = np.linalg.lstsq(x / p[:, None], -np.log(p / y), rcond=None)
        t = 1.0
        while t > 1e-8:
            new = coef + t * step
            if (x @ new > 0).all() and (val := loss(x, y, new, "log", np.ones_like(y))) < cur:
                break
            t /= 2
        else:
            break
        done = cur - val <= 1e-15 * max(cur, 1e-300)
        coef, cur = new, val
        if done:
            break
    return coef


def nonneg_lstsq(
    x: np.ndarray,
    y: np.ndarray,
    subsets: list[list[int]],
    objective: str = "relative",
    w: np.ndarray | None = None,
) -> np.ndarray:
    """Coefficients c >= 0 of y ~ x @ c minimising the objective (OBJECTIVES), the best of the
    given column subsets whose unconstrained optimum is non-negative (the others' coefficients
    0). Give at least one single-column subset: its coefficient is positive for positive data,
    so some subset always fits. w: the share objective's weights (shares)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"fit objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    weights = np.ones_like(y) if w is None else np.asarray(w, dtype=float)
    best: tuple[float, np.ndarray] | None = None
    for cols in subsets:
        xs = x[:, cols]
        if objective == "seconds":
            coef = _weighted(xs, y, np.ones_like(y))
        elif objective == "share":
            coef = _weighted(xs, y, np.sqrt(weights) / y)
        else:
            coef = _weighted(xs, y, 1 / y)
            if objective == "log":
                got = _log_fit(xs, y, coef if (xs @ coef > 0).all() else np.abs(coef))
                if got is None:
                    continue
                coef = got
        if (coef < 0).any():
            continue
        full = np.zeros(x.shape[1])
        full[cols] = coef
        res = loss(x, y, full, objective, weights)
        if best is None or res < best[0]:
            best = (res, full)
    assert best is not None  # a single positive column always fits
    return best[1]
