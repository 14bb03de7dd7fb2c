"""Recall against density on a model's attention (examples/train/curves.py): on a random tiny
model's captured q and k, every point of the table is a density and a recall in [0, 1]; the
precise search from the dense LSE keeps at least its top-p share of the mass (SPEC.md section
9.4: recall >= p by construction), more budget never keeps less, and the full budgets are dense
with recall 1. recalls() (all patterns in one pass of the dense probabilities, query rows in
chunks) equals a direct computation of each pattern's recall over the whole matrix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mtrain
from examples.train import curves as C
from examples.train import model as M
from examples.train.tasks import Vocab


def test_curves_on_a_random_model(tmp_path: Path) -> None:
    vocab = Vocab(256, 256, 256)
    model = M.build(M.SIZES["tiny"], vocab.size, 512, 10000.0, "sdpa", 3)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    out = C.main(
        ["--init-from", str(tmp_path / "w.pt"), "--seq-len", "512", "--granularity", "32",
         "--sequences", "1", "--out", str(tmp_path / "c.json")]
    )  # fmt: skip
    rows = out["rows"]
    assert len(rows) == len(C.budgets(512)) and (tmp_path / "c.json").exists()
    for r in rows:
        assert 0.0 < r["density"] <= 1.0 + 1e-12 and 0.0 < r["recall"] <= 1.0 + 1e-12, r
    by = {(r["method"], r["budget"]): r for r in rows}
    for p in C.TOP_P:
        r = by[("precise", f"top-p {p:.2f}")]
        assert r["recall"] >= p - 1e-6, r
    for m in ("precise", "antidiag"):
        dens = [by[(m, f"top-p {p:.2f}")]["density"] for p in C.TOP_P]
        assert dens == sorted(dens), (m, dens)
    for m in ("precise", "antidiag", "meanpool"):
        rec = [by[(m, f"top-k {t}")]["recall"] for t in C.TOP_K]
        assert rec == sorted(rec), (m, rec)
    # 16 blocks of 32: top-k 8 plus the forced blocks is not all, top-p 0.99 nearly all
    assert by[("precise", "top-k 1")]["density"] < by[("precise", "top-k 8")]["density"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        C.main(["--init-from", "x.pt", "--seq-len", "500", "--granularity", "64"])
    with pytest.raises(FileNotFoundError):
        C.main(["--init-from", str(tmp_path / "missing.pt"), "--seq-len", "256"])


def _recall_direct(
    q: torch.Tensor, k: torch.Tensor, pattern: mtrain.Pattern, scale: float
) -> float:
    """The recall from the pattern's dense mask, the whole [N, N] matrix of each head at once."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    mask = pattern.mask()  # [Hq, N, N] bool: the computed pairs
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    total = 0.0
    for h in range(hq):
        s = (q[:, h].double() @ k[:, h // group].double().T) * scale
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        total += float((p * (mask[h] & causal)).sum(-1).mean())
    return total / hq


@pytest.mark.parametrize("rows", [0, 7, 64])
def test_recalls_equal_the_direct_computation(rows: int) -> None:
    seed = 20261129
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d, gran = 200, 4, 2, 16, 32
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    heads = [([0, 2], [0, 5, 77]), ([0], []), ([0, 1, 3], [150]), ([0, 6], [1, 2, 3])]
    vs = mtrain.vertical_slash_pattern(n, heads, gran)
    blocks = mtrain.select_blocks(
        q, k, granularity=gran, softmax_scale=d**-0.5, method="antidiag", top_k=2
    )[0]
    dense = mtrain.dense_pattern(n, hq, gran)
    pats = [vs, blocks, dense]
    got = C.recalls(q, k, pats, d**-0.5, rows=rows)
    want = [_recall_direct(q, k, p, d**-0.5) for p in pats]
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= 1e-12, (j, a, b)
    assert abs(got[2] - 1.0) <= 1e-12 and got[0] < 1.0 and got[1] < 1.0
    assert C.recall(q, k, vs, d**-0.5) == pytest.approx(want[0], abs=1e-12)
    with pytest.raises(ValueError, match="granularity and length"):
        C.recalls(q, k, [vs, mtrain.dense_pattern(n, hq, 64)], d**-0.5)
