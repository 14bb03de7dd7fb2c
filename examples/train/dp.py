"""Data parallel with balancing for the training program (docs/TRAINING.md, "Data parallel
with balancing"): each step's global batch is a long-tail mix of documents (MQAR or passkey
samples of many lengths), dealt to the W ranks by mtrain.balance_batch (predicted cost or token
count) or round-robin; each rank trains on its documents packed into one varlen sequence
(cu_seqlens), and the gradients are summed so the update is the single-process one.
``python -m examples.train.dp RESULTS.json ...`` prints such runs side by side."""

from __future__ import annotations

import functools
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mtrain

from .tasks import IGNORE, Task, make_task

MIXES = ("none", "long-tail")
BALANCES = ("off", "tokens", "cost")
# the position model's placement (docs/BALANCE.md, "Position model"), or "measured": the heads
# priced by the pairs their estimated patterns computed on the tuner's curve document (needs
# --balance-tune; tune.py)
SPREADS = ("even", "local", "measured")
# the arms whose computed pattern the predictor can describe by a budget file; the others are
# predicted as dense (an upper bound): mtrain-topp (caps of N, as docs/BALANCE.md counts top-p)
# and mtrain-block (no budget: its blocks are chosen from q and k every step)
DENSE_ARMS = ("dense", "mtrain-full", "mtrain-topp", "mtrain-block")
REFUSED = {
    "window": "its pattern is built for one sequence length, and a packed batch holds documents "
    "of many lengths",
}
# the unit tables that price one term of the predictor alone (Dealer.features): the pairs
# (pair_s 1; linear_flops so large that F / linear_flops, under 1e-280, vanishes when added to
# the pairs, which are >= 1), the rows (row_s 1, likewise), the linear FLOPs (linear_flops 1:
# the predictor adds F / linear_flops) and the documents (seq_s 1: one per document and layer).
# The predictor accepts 0 for pair_s, row_s and seq_s, and any finite linear_flops > 0.
UNIT_TABLES = (
    {"pair_s": 1.0, "row_s": 0.0, "seq_s": 0.0, "linear_flops": 1e300},
    {"pair_s": 0.0, "row_s": 1.0, "seq_s": 0.0, "linear_flops": 1e300},
    {"pair_s": 0.0, "row_s": 0.0, "seq_s": 0.0, "linear_flops": 1.0},
    {"pair_s": 0.0, "row_s": 0.0, "seq_s": 1.0, "linear_flops": 1e300},
)
DOC_STRIDE = 2**20  # document j of step s is sample s * DOC_STRIDE + j of its task


@dataclass(frozen=True)
class LongTail:
    """The documents' length distribution, scaled to the run's longest length N (--seq-len):
    a document is long with probability p_long, its length log-uniform in [N/4, N]; else short,
    log-uniform in [N/32, N/8]; both ranges floored at min_len (the tasks' shortest sensible
    document). Documents are drawn until the batch holds at least `tokens` tokens. With
    p_long 0.1 about half of the tokens are in long documents (expected long length 0.54 N,
    short 0.068 N), the shape of docs/BALANCE.md's long-tail mix at the training program's
    scale."""

    max_len: int
    tokens: int
    min_len: int
    p_long: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_long <= 1.0:
            raise ValueError(f"--mix-long-prob {self.p_long}: a probability in [0, 1]")
        if self.tokens < 1:
            raise ValueError(f"--mix tokens per step {self.tokens}: must be >= 1")
        if self.max_len // 4 < self.min_len:
            raise ValueError(
                f"--seq-len {self.max_len} too short for --mix long-tail: documents need at least "
                f"{self.min_len} tokens (the task settings), so --seq-len must be >= "
                f"{4 * self.min_len}"
            )

    def ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        n, m = self.max_len, self.min_len
        short = (max(m, n // 32), max(m, n // 8))
        return short, (max(m, n // 4), n)

    def draw(self, seed: int, step: int) -> list[int]:
        """The lengths of step `step`'s documents (a function of seed and step only)."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 104_729 + 777) % 2**62)
        short, long = self.ranges()
        out: list[int] = []
        total = 0
        while total < self.tokens:
            lo, hi = long if float(torch.rand((), generator=g)) < self.p_long else short
            u = float(torch.rand((), generator=g))
            n = min(
                hi, max(lo, int(math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo)))))
            )
            out.append(n)
            total += n
        if len(out) >= DOC_STRIDE:
            raise ValueError(f"{len(out)} documents in one step: at most {DOC_STRIDE - 1}")
        return out

    def describe(self) -> dict[str, Any]:
        short, long = self.ranges()
        return {
            "kind": "long-tail",
            "p_long": self.p_long,
            "long_range": list(long),
            "short_range": list(short),
            "tokens_per_step_at_least": self.tokens,
            "min_len": self.min_len,
        }


def min_doc_len(num_pairs: int, num_queries: int, digits: int, buckets: int) -> int:
    """The shortest document the mix draws: twice what MQAR needs (so its queries always find
    free slots), at least what passkey needs."""
    mqar = 2 * (2 * num_pairs + 2 * num_queries + 2)
    passkey = 2 * digits + 3 + buckets + 2
    return max(mqar, passkey, 16)


@dataclass
class Doc:
    ids: torch.Tensor
    labels: torch.Tensor

    @property
    def answers(self) -> int:
        return int((self.labels[1:] != IGNORE).sum())


def documents(
    names: list[str],
    lengths: list[int],
    indices: list[int],
    step: int,
    seed: int,
    kw: dict[str, int],
) -> list[Doc]:
    """The documents `indices` of a step (document j: task names[j % len], length lengths[j])."""
    out = []
    for j in indices:
        task: Task = _task(names[j % len(names)], lengths[j], tuple(sorted(kw.items())))
        s = task.sample(seed, step * DOC_STRIDE + j)
        out.append(Doc(s.ids, s.labels))
    return out


@functools.lru_cache(maxsize=4096)
def _task(name: str, n: int, kw: tuple[tuple[str, int], ...]) -> Task:
    from .tasks import Vocab

    d = dict(kw)
    vocab = Vocab(d.pop("num_keys"), d.pop("num_values"), d.pop("num_filler"))
    return make_task(name, n, vocab, **d)


def pack(docs: list[Doc]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One varlen sequence of the documents: ids [1, T], labels [1, T], position_ids [1, T]
    (restarting at every document) and cu_seqlens [len + 1] (CPU int64)."""
    lens = [int(d.ids.numel()) for d in docs]
    cu = torch.zeros(len(docs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    ids = torch.cat([d.ids for d in docs])[None]
    labels = torch.cat([d.labels for d in docs])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, labels, pos, cu


def packed_loss_sum(
    model: Any, ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The sum of the answer-token cross entropies of a packed batch and their count. The
    next-token shift runs over the whole pack: the last token of a document "predicts" the next
    document's first token, whose label is -100 (BOS), so no answer crosses a boundary."""
    hidden = model.model(
        input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu
    ).last_hidden_state
    target = labels[:, 1:]
    mask = target != IGNORE
    logits = model.lm_head(hidden[:, :-1][mask])
    if logits.dtype != torch.float64:  # float32 losses (bfloat16 logits under autocast)
        logits = logits.float()
    return F.cross_entropy(logits, target[mask], reduction="sum"), int(mask.sum())


def budget_file(
    arm: str, heads: int, layers: int, seq_len: int, v: int, s: int, path: Path
) -> Path:
    """The MInference budget file that describes the arm's pattern to the cost predictor, every
    layer and head alike: mtrain-static's TopK(v, s) (in a packed batch the same budget, the
    one at --seq-len, applies to every document; the predictor caps it at each document's
    length as the estimate does), and for the other arms the dense pattern (v = s = N)."""
    if arm in REFUSED:
        raise ValueError(f"--mix: the {arm} arm is not supported: {REFUSED[arm]}")
    if arm in DENSE_ARMS:
        v, s = seq_len, seq_len
    entry = ["vertical_and_slash", int(v), int(s), 1.0]
    path.write_text(json.dumps([{str(h): entry for h in range(heads)} for _ in range(layers)]))
    return path


def calibration_of(path: str, device: torch.device) -> tuple[str, dict[str, float]]:
    """The calibration table (data/calibration/): `path`, or by device: cpu-2core.json on the
    CPU (fitted on the 2-core CI VM), h200-derived.json on a GPU (derived from two H200
    anchors). seq_s (a constant per sequence and layer) is set to 0: a rank makes one attention
    call per layer for all its packed documents, so that constant is paid once per rank, the
    same on every rank, and cannot change which rank is the slowest."""
    root = Path(__file__).resolve().parents[2] / "data" / "calibration"
    if not path:
        path = str(root / ("h200-derived.json" if device.type == "cuda" else "cpu-2core.json"))
    if not Path(path).exists():
        raise ValueError(f"--balance-calibration {path}: no such file")
    table = json.loads(Path(path).read_text())
    cal = {k: float(table[k]) for k in ("pair_s", "row_s", "seq_s", "linear_flops")}
    cal["seq_s"] = 0.0
    return path, cal


@dataclass
class Dealer:
    """Deals each step's documents to the ranks (every rank computes the same deal from the same
    lengths: balance_batch is deterministic) and predicts each rank's seconds with the cost
    predictor, whatever the method, so every run records the same predicted figure."""

    method: str
    world: int
    budgets: Path
    calibration: dict[str, float]
    granularity: int
    model: dict[str, int]
    num_sinks: int
    window: int
    spread: str = "even"

    def __post_init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._features: dict[int, tuple[float, ...]] = {}
        self.row_pairs: Any = None  # spread "measured": [heads, levels], set by the tuner
        if self.method not in BALANCES:
            raise ValueError(f"--balance {self.method!r}: one of {', '.join(BALANCES)}")
        if self.spread not in SPREADS:
            raise ValueError(f"--balance-spread {self.spread!r}: one of {', '.join(SPREADS)}")
        if self.world < 1:
            raise ValueError(f"world {self.world}: at least one rank")

    def _kw(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "tune": False,
            "granularity": self.granularity,
            "model": self.model,
            "num_sinks": self.num_sinks,
            "window": self.window,
            "spread": self.spread,
        }
        if self.spread == "measured":
            if self.row_pairs is None:
                raise ValueError("--balance-spread measured: no measured pairs yet (the tuner's)")
            kw.update(spread="even", row_pairs=self.row_pairs)  # the placement is then unused
        return kw

    def set_row_pairs(self, row_pairs: Any) -> None:
        """The measured pairs per query row [heads over all layers, levels] (spread
        "measured"); the cached per-length seconds are dropped."""
        self.row_pairs = row_pairs
        self._seconds = {}
        self._features = {}

    def set_calibration(self, calibration: dict[str, float]) -> None:
        """A new calibration table (--balance-fit: a fitted one) for the next deals and
        predictions; the cached per-length seconds are dropped."""
        self.calibration = dict(calibration)
        self._seconds = {}

    def deal(self, lengths: list[int]) -> tuple[list[int], dict[str, float]]:
        """Each document's rank, and balance_batch's report (empty for "off": round-robin by
        document index, what a plain distributed sampler does)."""
        if self.method == "off":
            return [j % self.world for j in range(len(lengths))], {}
        r = mtrain.balance_batch(
            lengths,
            self.world,
            str(self.budgets),
            self.calibration,
            method=self.method,
            **self._kw(),
        )
        return list(r.rank_of), dict(r.report)

    def deal_tuned(
        self, lengths: list[int], mass: Any, bounds: tuple[float, float] | None
    ) -> tuple[list[int], dict[str, float], Any, list[float]]:
        """The cost deal (bitwise deal()'s: tuning never moves a document) and the tuner's
        budget scale per (rank, head over all layers, layer-major), from the heads' mass curves
        [layers x heads, levels]; also the report and each rank's predicted seconds after
        tuning."""
        if self.method != "cost":
            raise ValueError(f"tuning follows the cost deal, not --balance {self.method}")
        kw = self._kw()
        kw["tune"] = True
        r = mtrain.balance_batch(
            lengths, self.world, str(self.budgets), self.calibration, method="cost", mass=mass,
            bounds=bounds, **kw,
        )  # fmt: skip
        return (
            list(r.rank_of),
            dict(r.report),
            r.head_scales,
            [float(x) for x in r.rank_seconds_after],
        )

    def seconds(self, n: int) -> float:
        """The predicted seconds of one document of n tokens (forward + backward, all layers)."""
        if n not in self._seconds:
            r = mtrain.balance_batch([n], 1, str(self.budgets), self.calibration, **self._kw())
            self._seconds[n] = float(r.rank_seconds_before[0])
        return self._seconds[n]

    def features(self, n: int) -> tuple[float, ...]:
        """The predictor's terms of one document of n tokens (--balance-fit): its attention
        pairs P, its rows R (query rows x heads, as the predictor counts them), its
        linear-layer FLOPs F and its per-sequence count D (the layers), each priced alone by a
        unit table (UNIT_TABLES), so that seconds(n) = pair_s P + row_s R + F / linear_flops +
        seq_s D with the real table."""
        if n not in self._features:
            out = []
            for unit in UNIT_TABLES:
                r = mtrain.balance_batch([n], 1, str(self.budgets), unit, **self._kw())
                out.append(float(r.rank_seconds_before[0]))
            self._features[n] = tuple(out)
        return self._features[n]

    def rank_features(self, lengths: list[int], rank_of: list[int]) -> list[list[float]]:
        """Each rank's summed [P, R, F, D] over its documents (features())."""
        out = [[0.0] * len(UNIT_TABLES) for _ in range(self.world)]
        for n, r in zip(lengths, rank_of, strict=True):
            for k, v in enumerate(self.features(n)):
                out[r][k] += v
        return out

    def predicted(self, lengths: list[int], rank_of: list[int]) -> list[float]:
        out = [0.0] * self.world
        for n, r in zip(lengths, rank_of, strict=True):
            out[r] += self.seconds(n)
        return out


def max_over_mean(xs: list[float]) -> float | None:
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean > 0 else None


def scratch() -> tempfile.TemporaryDirectory[str]:
    """A folder for this process's budget file, removed when the object is."""
    return tempfile.TemporaryDirectory(prefix="mtrain-dp-")


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """A Markdown table of --mix runs (name, results JSON) side by side: the measured and the
    predicted balance, tokens/s and accuracy."""
    head = ["run", "arm", "ranks", "balance", "steps counted", "tokens/step", "tokens/s",
            "slowest step s", "measured compute max/mean", "attention max/mean",
            "predicted max/mean", "tuned: predicted max/mean, mass kept before -> after",
            "fitted: tables, last R^2, steps; compute, predicted max/mean",
            "tokens max/mean", "final loss", "accuracy"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs:
        d = r.get("dp")
        if not d:
            lines.append(f"| {name} | not a --mix run |" + " |" * (len(head) - 2))
            continue
        acc = ", ".join(f"{k} {v['overall']:.3f}" for k, v in (r.get("eval") or {}).items())
        cells = [
            name, r["arm"]["arm"], str(d["world_size"]), d["balance"], str(d["counted_steps"]),
            _f(d.get("tokens_per_step_mean"), ".0f"), _f(d.get("tokens_per_s"), ".0f"),
            _f(d.get("step_s_max_mean"), ".3f"), _f(d.get("compute_max_over_mean"), ".3f"),
            _f(d.get("attention_max_over_mean"), ".3f"),
            _f(d.get("predicted_max_over_mean"), ".3f"), _tuned(d.get("tuned")), _fitted(d),
            _f(d.get("tokens_max_over_mean"), ".3f"), _f(r.get("final_loss"), ".4f"), acc or "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tuned(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    return (
        f"{t['predicted_tuned_max_over_mean']:.3f}, {t['recall_before']:.3f} -> "
        f"{t['recall_after']:.3f}"
    )


def _fitted(d: dict[str, Any]) -> str:
    """--balance-fit: the fitted tables made (of the fits), the last fit's R^2, and the counted
    steps priced by a fitted table with their measured and predicted max/mean."""
    fit = d.get("fit")
    if not fit:
        return "-"
    fits = fit["fits"]
    made = sum(f["table"] is not None for f in fits)
    last = [f["r2"] for f in fits if f["table"] is not None]
    s = d.get("fitted") or {}
    return (
        f"{made} of {len(fits)}, {_f(last[-1] if last else None, '.3f')}, "
        f"{s.get('steps_priced_by_fit', 0)}; {_f(s.get('compute_max_over_mean'), '.3f')}, "
        f"{_f(s.get('predicted_max_over_mean'), '.3f')}"
    )


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


if __name__ == "__main__":
    import sys

    paths = [Path(p) for p in sys.argv[1:]]
    if not paths:
        sys.exit("usage: python -m examples.train.dp RESULTS.json ... (prints the --mix table)")
    print(table([(p.stem, json.loads(p.read_text())) for p in paths]))
