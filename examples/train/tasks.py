"""Synthetic long-context tasks generated on the fly (docs/TRAINING.md, "The
tasks"): multi-query associative recall (MQAR, after Zoology) and passkey
retrieval. Every sequence is a function of (task, length, seed, index): the
same arguments give the same tokens. Labels are -100 except on answer tokens,
so the loss is on answers only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass(frozen=True)
class Vocab:
    """Token ids: specials, 10 digits, then keys, values and filler, disjoint."""

    num_keys: int = 256
    num_values: int = 256
    num_filler: int = 256

    PAD = 0
    BOS = 1
    NEEDLE = 2  # opens and closes the passkey in the haystack
    ASK = 3  # asks for the passkey at the end
    DIGIT0 = 4  # digits 0..9 are DIGIT0 .. DIGIT0 + 9

    @property
    def key0(self) -> int:
        return self.DIGIT0 + 10

    @property
    def value0(self) -> int:
        return self.key0 + self.num_keys

    @property
    def filler0(self) -> int:
        return self.value0 + self.num_values

    @property
    def size(self) -> int:
        return self.filler0 + self.num_filler


@dataclass(frozen=True)
class Sample:
    """One sequence: input ids [N], labels [N] (the token itself at answer
    positions, else -100), and for each answer token its bucket (an index
    into the task's bucket list), -1 elsewhere. MQAR also gives `nearest`: for
    each answer token the bucket (into Mqar.nearest_buckets) of the distance
    to the nearest earlier copy of its key, the context pair or an earlier
    query of the same key, -1 elsewhere (None for the other tasks)."""

    ids: torch.Tensor
    labels: torch.Tensor
    bucket: torch.Tensor
    nearest: torch.Tensor | None = None


def _gen(seed: int, index: int) -> torch.Generator:
    # one stream per (seed, sequence): sequences do not depend on batch size or order
    return torch.Generator().manual_seed((seed * 1_000_003 + index * 7919 + 12345) % 2**62)


def _filler(vocab: Vocab, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(vocab.filler0, vocab.filler0 + vocab.num_filler, (n,), generator=g)


# ---------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mqar:
    """Multi-query associative recall at length seq_len.

    Layout: BOS, then num_pairs (key, value) pairs at positions 1..2P (key i at
    1 + 2i, its value at 2 + 2i; keys distinct, values drawn with replacement),
    then filler up to the end, in which num_queries queries are written: a
    query is a key of the context at position p followed by its value at
    p + 1, the answer (labelled). The distance of a query is p minus the
    position of the key in the context. Distances are drawn log-uniformly in
    [2P, N - 3] (a power law p(d) ~ 1/d, as in Zoology: short distances are
    the most frequent, and every log2 bucket is about equally likely); the
    pair is drawn among those whose key lands p in [2P + 1, N - 2] on a free
    slot (queries never overlap). Buckets: log2 of the distance,
    [2^b, 2^(b+1)). A second bucketing, `nearest`, takes the distance to the
    nearest earlier copy of the key instead (an earlier query of the same key
    when there is one, else the context pair): what a model that copies from
    the nearest copy has to reach (see distinct below); buckets [2^b,
    2^(b+1)) from b = 1 (two queries can be adjacent).

    distinct (issue 19): each pair is queried at most once (Q <= P, refused
    otherwise), so a queried key occurs twice in the sequence, in the context
    and at its query, and the distance is that to the only earlier copy of
    the key; by default (False) a key may be queried several times, and a
    later query can copy its value from an earlier query, nearer than the
    context. The default draws exactly the sequences it drew before."""

    seq_len: int
    num_pairs: int = 16
    num_queries: int = 16
    vocab: Vocab = Vocab()
    distinct: bool = False

    def __post_init__(self) -> None:
        if self.distinct and self.num_queries > self.num_pairs:
            raise ValueError(
                f"MQAR with distinct keys queries each of its {self.num_pairs} pairs at most "
                f"once: {self.num_queries} queries need --mqar-queries <= --mqar-pairs"
            )
        if self.num_pairs > self.vocab.num_keys:
            raise ValueError(f"{self.num_pairs} pairs need as many keys ({self.vocab.num_keys})")
        if 2 * self.num_pairs + 2 * self.num_queries + 2 > self.seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} too short for {self.num_pairs} pairs and "
                f"{self.num_queries} queries"
            )

    @property
    def buckets(self) -> list[str]:
        lo = int(math.log2(self.min_distance))
        hi = int(math.log2(self.max_distance))
        return [f"{2**b}-{2 ** (b + 1) - 1}" for b in range(lo, hi + 1)]

    @property
    def min_distance(self) -> int:
        return 2 * self.num_pairs

    @property
    def max_distance(self) -> int:
        return self.seq_len - 3

    def bucket_of(self, distance: int) -> int:
        return int(math.log2(distance)) - int(math.log2(self.min_distance))

    @property
    def nearest_buckets(self) -> list[str]:
        """The buckets of the distance to the nearest earlier copy of a key (>= 2)."""
        return [
            f"{2**b}-{2 ** (b + 1) - 1}" for b in range(1, int(math.log2(self.max_distance)) + 1)
        ]

    def nearest_bucket_of(self, distance: int) -> int:
        return int(math.log2(distance)) - 1

    def sample(self, seed: int, index: int) -> Sample:
        g = _gen(seed, index)
        v, n, p = self.vocab, self.seq_len, self.num_pairs
        ids = _filler(v, n, g)
        labels = torch.full((n,), IGNORE, dtype=torch.long)
        bucket = torch.full((n,), -1, dtype=torch.long)
        ids[0] = v.BOS
        keys = v.key0 + torch.randperm(v.num_keys, generator=g)[:p]
        values = torch.randint(v.value0, v.value0 + v.num_values, (p,), generator=g)
        ids[1 : 2 * p + 1 : 2] = keys
        ids[2 : 2 * p + 2 : 2] = values
        # the placement loop runs on Python ints (tensor ops per query made the generator the
        # slowest part of a GPU step); it draws the same random numbers as before
        used = bytearray(n)
        used[: 2 * p + 1] = b"\x01" * (2 * p + 1)
        key_pos = [1 + 2 * i for i in range(p)]
        key_list, value_list = keys.tolist(), values.tolist()
        lo, hi = math.log(self.min_distance), math.log(self.max_distance + 1)
        q_first, q_last = 2 * p + 1, n - 2
        at: list[int] = []
        token: list[int] = []
        answer_at: list[int] = []
        answer: list[int] = []
        answer_bucket: list[int] = []
        queried: list[tuple[int, int]] = []  # (query position, pair)
        placed = 0
        # distinct: the pairs not queried yet (the default never reads it, so it draws as before)
        free = [True] * p
        for _ in range(self.num_queries * 200):
            if placed == self.num_queries:
                break
            u = float(torch.rand((), generator=g))
            d = min(int(math.exp(lo + u * (hi - lo))), self.max_distance)
            cand = [
                i
                for i, k in enumerate(key_pos)
                if q_first <= k + d <= q_last
                and not used[k + d]
                and not used[k + d + 1]
                and (not self.distinct or free[i])
            ]
            if not cand:
                continue
            i = cand[int(torch.randint(len(cand), (1,), generator=g))]
            pos = key_pos[i] + d
            at += [pos, pos + 1]
            token += [key_list[i], value_list[i]]
            answer_at.append(pos + 1)
            answer.append(value_list[i])
            answer_bucket.append(self.bucket_of(d))
            queried.append((pos, i))
            used[pos] = used[pos + 1] = 1
            free[i] = False
            placed += 1
        if at:
            ids[at] = torch.tensor(token)
            labels[answer_at] = torch.tensor(answer)
            bucket[answer_at] = torch.tensor(answer_bucket)
        if placed < self.num_queries:
            raise RuntimeError(f"could not place {self.num_queries} queries in {n} tokens")
        # the distance to the nearest earlier copy of each query's key, in position order
        # (no random draw: the sequences are those drawn before this existed)
        nearest = torch.full((n,), -1, dtype=torch.long)
        last = list(key_pos)
        for pos, i in sorted(queried):
            nearest[pos + 1] = self.nearest_bucket_of(pos - last[i])
            last[i] = pos
        return Sample(ids, labels, bucket, nearest)

    def eval_sample(self, seed: int, index: int) -> Sample:
        return self.sample(seed, index)


# ---------------------------------------------------------------------------
# Passkey
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Passkey:
    """Passkey (needle) retrieval at length seq_len.

    Layout: BOS, filler, the needle NEEDLE d1..dL NEEDLE (L random digits) at
    start position s, filler, and at the very end ASK d1..dL; the L digits
    after ASK are the answers (labelled). The needle's depth is
    (s - 1) / (s_max - 1), s in [1, s_max] with s_max = N - 2L - 3, and its
    bucket is floor(depth * num_buckets) (the last bucket includes depth 1).
    Training draws s uniformly; evaluation draws bucket index % num_buckets,
    then s uniformly inside that bucket, so every depth bucket is covered
    equally."""

    seq_len: int
    digits: int = 5
    num_buckets: int = 8
    vocab: Vocab = Vocab()

    def __post_init__(self) -> None:
        if self.max_start - 1 < self.num_buckets:
            raise ValueError(f"seq_len {self.seq_len} too short for {self.num_buckets} buckets")

    @property
    def buckets(self) -> list[str]:
        b = self.num_buckets
        return [f"{100 * i // b}-{100 * (i + 1) // b}%" for i in range(b)]

    @property
    def max_start(self) -> int:
        return self.seq_len - 2 * self.digits - 3

    def bucket_of(self, start: int) -> int:
        depth = (start - 1) / (self.max_start - 1)
        return min(int(depth * self.num_buckets), self.num_buckets - 1)

    def bucket_range(self, b: int) -> tuple[int, int]:
        """The start positions [lo, hi] whose bucket is b."""
        span, nb = self.max_start - 1, self.num_buckets
        lo = 1 + math.ceil(b * span / nb)
        hi = self.max_start if b == nb - 1 else math.ceil((b + 1) * span / nb)
        return lo, hi

    def _build(self, g: torch.Generator, start: int) -> Sample:
        v, n, ell = self.vocab, self.seq_len, self.digits
        ids = _filler(v, n, g)
        labels = torch.full((n,), IGNORE, dtype=torch.long)
        bucket = torch.full((n,), -1, dtype=torch.long)
        key = v.DIGIT0 + torch.randint(0, 10, (ell,), generator=g)
        ids[0] = v.BOS
        ids[start] = v.NEEDLE
        ids[start + 1 : start + 1 + ell] = key
        ids[start + 1 + ell] = v.NEEDLE
        ids[n - ell - 1] = v.ASK
        ids[n - ell :] = key
        labels[n - ell :] = key
        bucket[n - ell :] = self.bucket_of(start)
        return Sample(ids, labels, bucket)

    def sample(self, seed: int, index: int) -> Sample:
        g = _gen(seed, index)
        start = int(torch.randint(1, self.max_start + 1, (1,), generator=g))
        return self._build(g, start)

    def eval_sample(self, seed: int, index: int) -> Sample:
        g = _gen(seed, index)
        lo, hi = self.bucket_range(index % self.num_buckets)
        start = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return self._build(g, start)


Task = Mqar | Passkey


def make_task(name: str, seq_len: int, vocab: Vocab, **kw: int) -> Task:
    """The task ``name`` at ``seq_len``; kw: num_pairs, num_queries, distinct (MQAR), digits,
    num_buckets (passkey); the others' keys are ignored."""
    if name == "mqar":
        return Mqar(
            seq_len, kw.get("num_pairs", 16), kw.get("num_queries", 16), vocab,
            bool(kw.get("distinct", 0)),
        )  # fmt: skip
    if name == "passkey":
        return Passkey(seq_len, kw.get("digits", 5), kw.get("num_buckets", 8), vocab)
    raise ValueError(f"unknown task {name!r} (mqar, passkey)")


def batch(
    tasks: list[Task], seed: int, start: int, size: int, evaluation: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences start .. start + size - 1, sequence i of task tasks[i % len]:
    ids [B, N], labels [B, N], bucket [B, N], task index [B]."""
    out = []
    for i in range(start, start + size):
        t = tasks[i % len(tasks)]
        s = t.eval_sample(seed, i) if evaluation else t.sample(seed, i)
        out.append(s)
    which = torch.tensor([i % len(tasks) for i in range(start, start + size)])
    return (
        torch.stack([s.ids for s in out]),
        torch.stack([s.labels for s in out]),
        torch.stack([s.bucket for s in out]),
        which,
    )
