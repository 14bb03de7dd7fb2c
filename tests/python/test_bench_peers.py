"""The peers of tools/bench_cuda_peers.py on the CPU (issue 21): minference's index formats
against a direct computation of the pattern's pairs, cuDNN's packed block mask, and the
"cannot run" lines (one line each, in the table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import bench_cuda_peers as bench  # noqa: E402
import peers_common  # noqa: E402
import peers_cudnn  # noqa: E402
import peers_minference as pm  # noqa: E402


def vs_doc(n: int, g: int, heads: int, seed: int) -> dict:
    """A random vertical-slash pattern JSON (SPEC.md section 8)."""
    gen = torch.Generator().manual_seed(seed)
    nb = n // g
    out = []
    for _ in range(heads):
        diags = sorted(set(torch.randint(1, nb, (3,), generator=gen).tolist()) | {0})
        verts = sorted(set(torch.randint(0, n, (9,), generator=gen).tolist()) | {0, 1})
        out.append({"diagonals": diags, "verticals": verts})
    return {"granularity": g, "seq_len": n, "heads": out}


def allowed(doc: dict) -> torch.Tensor:
    """allowed(h, i, j) of SPEC.md section 1, directly: [H, N, N]."""
    g, n = doc["granularity"], doc["seq_len"]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    t = i // g - j // g
    masks = []
    for e in doc["heads"]:
        if "block_mask" in e:
            m = torch.zeros(n // g, n // g, dtype=torch.bool)
            for qb, kb in e["block_mask"]:
                m[qb, kb] = True
            m |= torch.eye(n // g, dtype=torch.bool)
            blk = m[i // g, j // g]
        else:
            d = torch.zeros(n // g + 1, dtype=torch.bool)
            d[torch.tensor(e["diagonals"])] = True
            d[0] = True
            v = torch.zeros(n, dtype=torch.bool)
            v[torch.tensor(e["verticals"], dtype=torch.long)] = True
            blk = (d[t.clamp(0, n // g)] & (t >= 0)) | (v[j].expand(n, n) & (t > 0))
        masks.append(blk & (j <= i))
    return torch.stack(masks)


def tile_cover(bc, bo, cc, ci, n: int) -> torch.Tensor:
    """How many times minference's Triton kernel computes each (h, i, j): [H, N, N]."""
    b = pm.BLOCK
    heads = bc.shape[1]
    cover = torch.zeros(heads, n, n, dtype=torch.int32)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    for h in range(heads):
        for m in range(bc.shape[2]):
            rows = (i >= m * b) & (i < m * b + b)
            for o in bo[0, h, m, : bc[0, h, m]].tolist():
                cover[h] += (rows & (j >= o) & (j < o + b) & (j <= i)).int()
            for c in ci[0, h, m, : cc[0, h, m]].tolist():
                cover[h] += (rows & (j == c)).int()
    return cover


@pytest.mark.parametrize("g", [64, 128])
def test_minference_exact_indexes_are_our_pairs(g: int) -> None:
    doc = vs_doc(1024, g, 3, seed=g)
    p = bench.Pattern(doc, torch.device("cpu"))
    bc, bo, cc, ci = pm.exact_indexes(p)
    want = allowed(doc)
    cover = tile_cover(bc, bo, cc, ci, 1024)
    assert int(cover.max()) == 1, "a pair computed twice"
    assert torch.equal(cover.bool(), want)
    pairs, causal = pm.index_pairs(bc, bo, cc, ci, 1024)
    assert causal
    assert pairs == int(want.sum()) == p.pairs()


def test_minference_exact_indexes_block_mask_heads() -> None:
    nb, g = 8, 128
    doc = {"granularity": g, "seq_len": nb * g,
           "heads": [{"block_mask": [[3, 1], [5, 0], [7, 2], [7, 6]]},
                     {"diagonals": [0, 2], "verticals": [5, 300]}]}  # fmt: skip
    p = bench.Pattern(doc, torch.device("cpu"))
    bc, bo, cc, ci = pm.exact_indexes(p)
    cover = tile_cover(bc, bo, cc, ci, nb * g)
    assert int(cover.max()) == 1
    assert torch.equal(cover.bool(), allowed(doc))
    assert pm.index_pairs(bc, bo, cc, ci, nb * g)[0] == p.pairs()


def reference_conversion(v_idx, s_idx, n: int):
    """minference's convert_vertical_slash_indexes (csrc/vertical_slash_index.cu), restated in
    Python for the test: per 64-row block, merged slash ranges as 64-key tiles, and the
    verticals outside them as columns."""
    b = pm.BLOCK
    heads, rows = v_idx.shape[1], n // b
    offs, cols = [], []
    for h in range(heads):
        vs = sorted(v_idx[0, h].tolist())
        ss = sorted(s_idx[0, h].tolist(), reverse=True)
        ho, hc = [], []
        for m in range(rows):
            end = m * b + b
            ranges = []
            for s in ss:
                if s >= end:
                    continue
                e = max(end - s, b)
                if ranges and e <= ranges[-1][1]:
                    continue
                if ranges and e <= ranges[-1][1] + b:
                    ranges[-1][1] += b
                else:
                    ranges.append([e - b, e])
            ho.append([o for lo, hi in ranges for o in range(lo, hi, b)])
            last = ranges[-1][1] if ranges else 0
            hc.append([v for v in vs if v < last and not any(lo <= v < hi for lo, hi in ranges)])
        offs.append(ho)
        cols.append(hc)
    return pm._pack_pair(offs, cols)


def test_minference_api_indexes_cover_our_pairs() -> None:
    doc = vs_doc(1024, 128, 2, seed=7)
    p = bench.Pattern(doc, torch.device("cpu"))
    v_idx, s_idx = pm.api_indexes(p)
    assert v_idx.shape[:2] == s_idx.shape[:2] == (1, 2)
    bc, bo, cc, ci = reference_conversion(v_idx, s_idx, 1024)
    cover = tile_cover(bc, bo, cc, ci, 1024)
    want = allowed(doc)
    assert bool((cover.bool() | ~want).all()), "the public function's tiles miss a pair of ours"
    pairs, _ = pm.index_pairs(bc, bo, cc, ci, 1024)
    assert pairs == int((cover > 0).sum()) and pairs > p.pairs()  # a superset


def test_cudnn_block_mask_packing() -> None:
    mask = torch.zeros(2, 3, 11, dtype=torch.bool)
    mask[0, 1, 0] = mask[0, 1, 9] = mask[1, 2, 10] = True
    packed = peers_cudnn.pack_block_mask(mask, lsb_first=True)
    assert packed.shape == (1, 2, 3, 2) and packed.dtype == torch.uint8
    assert packed[0, 0, 1].tolist() == [1, 2] and packed[0, 1, 2].tolist() == [0, 4]
    assert int(packed.sum()) == 7
    msb = peers_cudnn.pack_block_mask(mask, lsb_first=False)
    assert msb[0, 0, 1].tolist() == [128, 64]


class FakeGraphs:
    """peers_cudnn.Graphs without cuDNN: run() unpacks the block mask in one bit order and
    writes the masked reference, after checking every tensor is on q's device (the run of
    2026-11-29 failed there: random_mask's mask on the CPU, the indices on the GPU)."""

    lsb_first = True

    def __init__(self, cudnn, q, k) -> None:
        self.device = q.device

    def forward(self, stats, block_mask=None):
        return block_mask

    def run(self, g, pack) -> None:
        assert all(t.device == self.device for t in pack.values())
        packed = pack[5][0]
        shifts = torch.arange(8, device=packed.device)
        if not self.lsb_first:
            shifts = 7 - shifts
        bits = (packed.int()[..., None] >> shifts) & 1
        mask = bits.flatten(-2)[..., : packed.shape[1]].bool()
        pack[3].copy_(peers_cudnn.reference(pack[0], pack[1], pack[2], mask))


@pytest.mark.parametrize("lsb_first", [True, False])
def test_cudnn_check_block_mask_finds_the_bit_order(monkeypatch, lsb_first: bool) -> None:
    mask = torch.zeros(4, 4, 4, dtype=torch.bool)
    mask[:, torch.arange(4), torch.arange(4)] = True
    mask[0, 3, 1] = mask[1, 2, 0] = mask[3, 3, 0] = True
    monkeypatch.setattr(FakeGraphs, "lsb_first", lsb_first)
    monkeypatch.setattr(peers_cudnn, "Graphs", FakeGraphs)
    lsb, note = peers_cudnn.check_block_mask(None, mask, 4, 2, 32, device="cpu")
    assert lsb == lsb_first and ("LSB" if lsb_first else "MSB") in note


def test_cannot_run_reason_is_one_line() -> None:
    try:
        raise ImportError("No module named 'cudnn'\nsecond line")
    except ImportError as e:
        assert peers_common.reason(e) == "ImportError: No module named 'cudnn'"
    assert "\n" not in peers_common.flashinfer_reason()
    with (
        pytest.raises(peers_common.CannotRun, match="time limit"),
        peers_common.time_limit(0.2, "slow"),
    ):
        while True:
            pass


def test_dry_run_reports_every_peer(tmp_path) -> None:
    doc = vs_doc(2048, 128, 4, seed=3)
    path = tmp_path / "pattern.json"
    path.write_text(json.dumps(doc))
    out = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "bench_cuda_peers.py"), "--dry-run", "--device", "cpu",
         "--pattern", str(path), "--heads", "4", "--kv-heads", "2", "--block-keep", "4",
         "--peers", bench.ALL_PEERS],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "minference vertical-slash: pairs" in text and "-> ok" in text
    for peer in ("flashinfer", "flash-attn", "cudnn-fe"):
        assert f"{peer} " in text
    table = text[text.index("== peers table") :]
    assert "cannot run:" in table  # flashinfer at least
    assert all(len(line) < 2000 for line in text.splitlines())
