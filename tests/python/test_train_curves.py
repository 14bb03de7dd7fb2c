"""Recall against density on a model's attention (examples/train/curves.py): on a random tiny
model's captured q and k, every point of the table is a density and a recall in [0, 1]; the
precise search from the dense LSE keeps at least its top-p share of the mass (SPEC.md section
9.4: recall >= p by construction), more budget never keeps less, and the full budgets are dense
with recall 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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
