"""Passkey accuracy per answer digit of saved weights at a given length, on the 64 evaluation
sequences of data seed 1 (the study's zero-shot numbers in docs/TRAINING.md):
PYTHONPATH=python:. python docs/cpu-runs/2026-11-27-train-study/digits.py WEIGHTS N [SIZE]"""

import sys

import torch

from examples.train import model as M
from examples.train.evaluate import answer_logits
from examples.train.tasks import Passkey, Vocab, batch


def main(weights: str, n: int, size: str = "tiny") -> list[float]:
    torch.set_num_threads(1)
    v = Vocab(256, 256, 256)
    m = M.build(M.SIZES[size], v.size, n, 1e4, "sdpa", 0)
    m.load_state_dict(torch.load(weights, weights_only=True))
    m.eval()
    t = Passkey(n, 5, 8, v)
    hit = torch.zeros(5)
    with torch.no_grad():
        for s in range(0, 64, 8):
            ids, labels, _, _ = batch([t], 1 + 10**6, s, 8, True)
            logits, target, _ = answer_logits(m, ids, labels)
            hit += (logits.argmax(-1) == target).float().view(-1, 5).sum(0)
    return (hit / 64).tolist()


if __name__ == "__main__":
    print("per-digit accuracy", main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:]))
