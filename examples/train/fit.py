"""--balance-fit K (docs/TRAINING.md, "Pricing fitted from the measured times"): the cost
predictor's calibration table refitted every K steps from the ranks' measured compute seconds.
Each rank's seconds are modelled as c = a + x P + y R + z F + w D (P: the predictor's attention
pairs of the rank's documents, R: its query rows x heads, F: its linear-layer FLOPs, D: its
documents counted as the predictor's per-sequence term does, one per document and layer; a: a
free intercept), fitted by non-negative least squares on (x, y, z, w). D is there because the
first GPU measurement found a cost per document (2.0 ms per document and step on 3 H100s,
docs/TRAINING.md "On GPUs: three H100s") that the given tables leave at 0. The fit is plain
Python float64 (math.fsum dot products, a fixed order of operations, no numpy or torch), so every
rank computes bitwise the same table from the same all-reduced seconds and deals the same
documents."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

# the features' names, in the order of the coefficients (x, y, z, w)
FEATURES = ("pairs", "rows", "flops", "documents")
# the samples a window needs: one per unknown (the intercept and every column; the rows are
# found collinear with the FLOPs only once there are enough samples to tell)
MIN_SAMPLES = 1 + len(FEATURES)
# linear_flops of a table whose z is 0 (no linear term): finite, as the predictor requires
HUGE_FLOPS = 1e300
# a column whose part not explained by the columns kept before it is below this share of its
# norm is collinear with them and dropped (the rows and the FLOPs of a document are both
# proportional to its tokens: one of the two is always dropped)
COLLINEAR = 1e-9
# the order in which the columns are tested for collinearity (the intercept first: a column
# constant over the samples is dropped; then the pairs, the FLOPs, the rows, the documents: of
# the rows and the FLOPs, both proportional to the tokens, the FLOPs are kept)
ORDER = (0, 2, 1, 3)


@dataclass
class Fit:
    """One fit: the intercept a and (x, y, z) (0 for a dropped column), the residual sum of
    squares, R^2 (None when the seconds do not vary), the samples used, the columns dropped (name
    and why), and `degenerate`: why no table came of it (None when one did)."""

    intercept: float
    coefficients: tuple[float, ...]
    rss: float
    r2: float | None
    samples: int
    dropped: dict[str, str] = field(default_factory=dict)
    degenerate: str | None = None

    def table(self) -> dict[str, float]:
        """The calibration table of the fit: pair_s x, row_s y, seq_s w, linear_flops 1/z
        (HUGE_FLOPS when z is 0, or so small that 1/z would pass it)."""
        x, y, z, w = self.coefficients
        return {
            "pair_s": x,
            "row_s": y,
            "seq_s": w,
            "linear_flops": 1.0 / z if z > 1.0 / HUGE_FLOPS else HUGE_FLOPS,
        }


def _dot(u: list[float], v: list[float]) -> float:
    return math.fsum(a * b for a, b in zip(u, v, strict=True))


def _least_squares(cols: list[list[float]], y: list[float]) -> list[float] | None:
    """The least-squares coefficients of y on the columns (modified Gram-Schmidt QR of the
    columns, then back substitution); None when a column is (numerically) dependent on the
    ones before it."""
    q: list[list[float]] = []
    r = [[0.0] * len(cols) for _ in cols]
    for j, c in enumerate(cols):
        v = list(c)
        norm0 = math.sqrt(_dot(v, v))
        for i, qi in enumerate(q):
            r[i][j] = _dot(qi, v)
            v = [a - r[i][j] * b for a, b in zip(v, qi, strict=True)]
        norm = math.sqrt(_dot(v, v))
        if norm0 == 0.0 or norm <= COLLINEAR * norm0:
            return None
        r[j][j] = norm
        q.append([a / norm for a in v])
    rhs = list(y)
    qty = []
    for qi in q:  # modified Gram-Schmidt on the right-hand side as well
        t = _dot(qi, rhs)
        qty.append(t)
        rhs = [a - t * b for a, b in zip(rhs, qi, strict=True)]
    beta = [0.0] * len(cols)
    for j in reversed(range(len(cols))):
        s = qty[j] - math.fsum(r[j][k] * beta[k] for k in range(j + 1, len(cols)))
        beta[j] = s / r[j][j]
    return beta


def fit(features: list[list[float]], seconds: list[float]) -> Fit:
    """Non-negative least squares of seconds = a + x P + y R + z F + w D over the samples (one
    row [P, R, F, D] of features per sample), a free. Columns all zero are dropped, then columns
    collinear with the intercept and the columns kept before them (ORDER); with fewer samples
    than 1 + the nonzero columns the fit is degenerate. Among the subsets of the kept columns
    (all 2^k, each solved by least squares with the intercept on the columns scaled to a largest
    magnitude of 1) the feasible ones (every coefficient >= 0) are compared and the one of the
    least residual sum of squares kept (the NNLS solution: it is the least-squares solution on
    its support); ties go to the subset listed first (fewer columns, then the columns' order).
    All coefficients 0 is degenerate too: such a table would price every document at 0."""
    n = len(seconds)
    if len(features) != n or any(len(f) != len(FEATURES) for f in features):
        raise ValueError(f"fit: {len(features)} feature rows of {len(FEATURES)} for {n} seconds")
    if not all(math.isfinite(v) for row in features for v in row) or not all(
        math.isfinite(s) for s in seconds
    ):
        raise ValueError("fit: the features and the seconds must be finite")
    cols = [[float(row[j]) for row in features] for j in range(len(FEATURES))]
    y = [float(s) for s in seconds]
    mean = math.fsum(y) / n if n else 0.0
    tss = math.fsum((s - mean) ** 2 for s in y)
    dropped: dict[str, str] = {}
    scale = [max((abs(v) for v in c), default=0.0) for c in cols]
    for j in range(len(FEATURES)):
        if scale[j] == 0.0:
            dropped[FEATURES[j]] = "all zero"
    nonzero = [j for j in range(len(FEATURES)) if scale[j] > 0.0]

    def none(why: str) -> Fit:
        return Fit(mean, (0.0,) * len(FEATURES), tss, None, n, dropped, why)

    if n < 1 + len(nonzero):
        return none(f"{n} samples for {1 + len(nonzero)} unknowns")
    ones = [1.0] * n
    scaled = {j: [v / scale[j] for v in cols[j]] for j in nonzero}
    kept: list[int] = []
    for j in ORDER:
        if j not in scaled:
            continue
        if _least_squares([ones, *(scaled[k] for k in kept), scaled[j]], y) is None:
            dropped[FEATURES[j]] = "collinear with " + ", ".join(
                ["the intercept", *(FEATURES[k] for k in kept)]
            )
        else:
            kept.append(j)
    kept.sort()
    best: tuple[float, float, list[float], tuple[int, ...]] | None = None
    for size in range(len(kept) + 1):
        for subset in itertools.combinations(kept, size):
            beta = _least_squares([ones, *(scaled[j] for j in subset)], y)
            if beta is None or any(b < 0.0 for b in beta[1:]):
                continue
            pred = [
                beta[0] + math.fsum(b * scaled[j][i] for b, j in zip(beta[1:], subset, strict=True))
                for i in range(n)
            ]
            rss = math.fsum((a - b) ** 2 for a, b in zip(y, pred, strict=True))
            if best is None or rss < best[0]:
                best = (rss, beta[0], beta[1:], subset)
    assert best is not None  # the intercept alone is always feasible
    rss, a, beta, subset = best
    coef = [0.0] * len(FEATURES)
    for b, j in zip(beta, subset, strict=True):
        coef[j] = b / scale[j]
    r2 = 1.0 - rss / tss if tss > 0.0 else None
    out = Fit(a, tuple(coef), rss, r2, n, dropped)
    if not any(c > 0.0 for c in coef):
        out.degenerate = "every coefficient is 0"
    return out


@dataclass
class Refit:
    """The fitted pricing of a run: tables[0] is the given table; after every `every` steps
    (observe() of the last step of a window) a fit of that window's samples (every rank with a
    document in every step; ranks dealt none are left out: their seconds hold no forward and no
    intercept) and, unless degenerate, a new table (the next index). `fits` holds every fit's
    record for the results JSON."""

    every: int
    given: dict[str, float]
    tables: list[dict[str, float]] = field(default_factory=list)
    fits: list[dict[str, Any]] = field(default_factory=list)
    window: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"--balance-fit {self.every}: refit every K >= 1 steps")
        self.tables = [dict(self.given)]

    @property
    def index(self) -> int:
        """The index of the table that prices the next step."""
        return len(self.tables) - 1

    @property
    def table(self) -> dict[str, float]:
        return self.tables[-1]

    def observe(
        self,
        step: int,
        rank_features: list[list[float]],
        compute_s: list[float],
        predicted_s: list[float],
    ) -> dict[str, Any] | None:
        """Records one step (each rank's [P, R, F, D], measured compute seconds, predicted
        seconds); after the last step of a window returns the fit's record (its table, when not
        degenerate, is then self.table), else None."""
        self.window.append(
            {"step": step, "features": rank_features, "compute_s": compute_s,
             "predicted_s": predicted_s, "table": self.index}
        )  # fmt: skip
        if (step + 1) % self.every:
            return None
        window, self.window = self.window, []
        feats, secs = [], []
        for s in window:
            for f, c in zip(s["features"], s["compute_s"], strict=True):
                if any(v > 0 for v in f):  # a rank dealt no document: left out
                    feats.append([float(v) for v in f])
                    secs.append(float(c))
        result = fit(feats, secs)
        rec: dict[str, Any] = {
            "step": step + 1,  # the first step priced by this fit
            "steps": [s["step"] for s in window],
            "intercept_s": result.intercept,
            "coefficients": dict(zip(FEATURES, result.coefficients, strict=True)),
            "rss": result.rss,
            "r2": result.r2,
            "samples": result.samples,
            "dropped": result.dropped,
            "degenerate": result.degenerate,
            "priced_by": sorted({s["table"] for s in window}),
            "predicted_max_over_mean": _mean_ratio([s["predicted_s"] for s in window]),
            "measured_max_over_mean": _mean_ratio([s["compute_s"] for s in window]),
            "predicted_mean_s": _mean_mean([s["predicted_s"] for s in window]),
            "measured_mean_s": _mean_mean([s["compute_s"] for s in window]),
        }
        if result.degenerate is None:
            c = result.coefficients
            fitted = [
                [result.intercept + math.fsum(a * b for a, b in zip(c, f, strict=True))
                 if any(f) else 0.0 for f in s["features"]]
                for s in window
            ]  # fmt: skip
            rec["fitted_max_over_mean"] = _mean_ratio(fitted)
            self.tables.append(result.table())
            rec["table"] = self.table
            rec["index"] = self.index
        else:
            rec["table"] = None
            rec["index"] = self.index  # the table kept
        self.fits.append(rec)
        return rec


def _ratio(xs: list[float]) -> float | None:
    mean = math.fsum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean > 0 else None


def _mean_ratio(rows: list[list[float]]) -> float | None:
    vals = [r for r in (_ratio(x) for x in rows) if r is not None]
    return math.fsum(vals) / len(vals) if vals else None


def _mean_mean(rows: list[list[float]]) -> float | None:
    vals = [math.fsum(x) / len(x) for x in rows if x]
    return math.fsum(vals) / len(vals) if vals else None
