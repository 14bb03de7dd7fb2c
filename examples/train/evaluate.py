"""The loss on answer tokens and the evaluation: accuracy of the greedy
prediction of every answer token, per task and per bucket (MQAR: distance
buckets, and the same answers again by the distance to the nearest earlier
copy of their key, `nearest`; passkey: depth buckets). Under context parallel (cp.py) each rank
computes its slots' answers, under data parallel (dp.py) its share of the
evaluation batches; the counts are summed over the ranks."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from .cp import Cp, Shard
from .tasks import IGNORE, Mqar, Task

# MQAR's two bucketings travel through the context-parallel dispatch as one
# extra value per slot: (bucket + 1) * _PACK + nearest + 1 (both -1 off the answers)
_PACK = 1 << 16


def answer_logits(
    model: Any, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at the positions that predict an answer token (only there: the
    LM head on every position of a 32K sequence would cost as much memory as
    the rest), their targets, and the mask over labels[:, 1:]."""
    hidden = model.model(input_ids=ids).last_hidden_state
    target = labels[:, 1:]
    mask = target != IGNORE
    logits = model.lm_head(hidden[:, :-1][mask])
    return logits.float(), target[mask], mask


def answer_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits, target, _ = answer_logits(model, ids, labels)
    return F.cross_entropy(logits, target)


def shard_logits(model: Any, s: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """answer_logits on this rank's slots (context parallel): the targets are already shifted
    (in global order, before the dispatch), so every slot predicts its own target."""
    hidden = model.model(input_ids=s.ids, **s.kwargs).last_hidden_state
    mask = s.targets != IGNORE
    logits = model.lm_head(hidden[mask])
    return logits.float(), s.targets[mask], mask


def shard_loss_sum(model: Any, s: Shard) -> tuple[torch.Tensor, int]:
    """The sum of this rank's answer-token losses (0, still part of the graph, when it holds
    no answer) and their count."""
    logits, target, _ = shard_logits(model, s)
    return F.cross_entropy(logits, target, reduction="sum"), int(target.numel())


def chance(task: Task) -> float:
    """Accuracy of guessing: MQAR a value among the context's pairs, passkey a digit."""
    return 1.0 / task.num_pairs if isinstance(task, Mqar) else 0.1


@torch.no_grad()
def evaluate(
    model: Any,
    tasks: list[Task],
    names: list[str],
    seed: int,
    seqs: int,
    batch_size: int,
    device: torch.device,
    autocast: AbstractContextManager[Any],
    cp: Cp | None = None,
    granularity: int = 0,
    dp: Cp | None = None,
) -> dict[str, Any]:
    """Accuracy per task and bucket; with a context-parallel ``cp`` (all ranks call it) the
    sequences are dispatched with ``granularity`` and the counts summed over the ranks; with a
    data-parallel ``dp`` rank r evaluates the batches b with b mod W = r, and the counts are
    summed (the same figures as one process: each sequence is computed alone)."""
    was = model.training
    model.eval()
    out: dict[str, Any] = {}
    for t, name in zip(tasks, names, strict=True):
        nb = len(t.buckets)
        near = isinstance(t, Mqar)
        nn = len(t.nearest_buckets) if isinstance(t, Mqar) else 0  # nearest-copy buckets
        correct = torch.zeros(nb, dtype=torch.long)
        count = torch.zeros(nb, dtype=torch.long)
        ncorrect = torch.zeros(nn, dtype=torch.long)
        ncount = torch.zeros(nn, dtype=torch.long)
        for b_index, s in enumerate(range(0, seqs, batch_size)):
            if dp is not None and dp.on and b_index % dp.world != dp.rank:
                continue
            samples = [t.eval_sample(seed, i) for i in range(s, min(seqs, s + batch_size))]
            ids = torch.stack([x.ids for x in samples])
            labels = torch.stack([x.labels for x in samples])
            bucket = torch.stack([x.bucket for x in samples])
            if near:
                nearest = torch.stack([x.nearest for x in samples])  # MQAR samples carry it
                packed = (bucket + 1) * _PACK + nearest + 1
            else:
                packed = (bucket + 1) * _PACK
            if cp is not None and cp.on:
                sh = cp.shard(ids, labels, granularity, device, extra=packed)
                with autocast:
                    logits, target, mask = shard_logits(model, sh)
                assert sh.extra is not None
                pk = sh.extra[mask.cpu()]
            else:
                with autocast:
                    logits, target, mask = answer_logits(model, ids.to(device), labels.to(device))
                pk = packed[:, 1:][mask.cpu()]
            b, near_b = pk // _PACK - 1, pk % _PACK - 1
            hit = (logits.argmax(-1) == target).cpu().long()
            correct += torch.bincount(b, weights=hit, minlength=nb).long()
            count += torch.bincount(b, minlength=nb)
            if near:
                ncorrect += torch.bincount(near_b, weights=hit, minlength=nn).long()
                ncount += torch.bincount(near_b, minlength=nn)
        summed = cp if cp is not None and cp.on else dp if dp is not None and dp.on else None
        if summed is not None:
            both = summed.all_reduce(torch.cat([correct, count, ncorrect, ncount]).to(device)).cpu()
            correct, count = both[:nb], both[nb : 2 * nb]
            ncorrect, ncount = both[2 * nb : 2 * nb + nn], both[2 * nb + nn :]
        acc = [float(c) / float(n) if n else None for c, n in zip(correct, count, strict=True)]
        out[name] = {
            "buckets": t.buckets,
            "accuracy": acc,
            "count": count.tolist(),
            "overall": float(correct.sum()) / max(1, int(count.sum())),
            "chance": chance(t),
        }
        if isinstance(t, Mqar):
            out[name]["nearest"] = {
                "buckets": t.nearest_buckets,
                "accuracy": [
                    float(c) / float(n) if n else None
                    for c, n in zip(ncorrect, ncount, strict=True)
                ],
                "count": ncount.tolist(),
            }
    model.train(was)
    return out
