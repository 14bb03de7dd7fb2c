# ruff: noqa: N803, N806, E501  (N, G, H, R: the names of docs/SPEC.md; tables of arguments)
"""peers_minference.py: the MTraining/MInference authors' vertical-slash kernel as a peer (issue 21).

The `minference` package (PyPI 0.1.6.0; only a source distribution, carried as
.whl/minference-0.1.6.0.tar.gz) has its forward `vertical_slash_sparse_attention(q, k, v,
v_idx, s_idx)` in minference/ops/pit_sparse_flash_attention_v2.py: a CUDA extension
(`minference.cuda.convert_vertical_slash_indexes`, one .cu file) turns token verticals and token
slashes into, per 64-row block, the start of each 64x64 key tile (block_offset, block_count) and
the single key columns (column_index, column_count); a Triton kernel
(`_triton_mixed_sparse_attention`) computes the tiles with the causal mask and the columns
without it. Forward only, no GQA (k/v repeated to Hq heads), head_dim <= 128.

Two ways to feed it the same pattern as ours (docs/SPEC.md section 1, block diagonals at
granularity G plus verticals):

- exact_indexes(): our pairs in its tile format (what its index conversion produces), given to
  its Triton kernel: a block diagonal's G x G blocks as 64-key tiles (tiles wholly above the
  causal diagonal left out), the verticals outside those blocks as columns. The pairs it then
  computes equal ours exactly (index_pairs() counts them, no pair twice);
- api_indexes(): its public function's inputs, v_idx = our verticals, s_idx = the token slashes
  whose 64x64 tiles cover each block diagonal (t*G + 64u, |u| < G/64): a superset of our
  pairs (its tiles are anchored on each row block's last row), counted the same way from what
  its own conversion returns.

load() builds the extension from the sdist with torch.utils.cpp_extension (only sm of the
running GPU) and imports the ops module; when the package's __init__ fails to import (it
imports transformers model code), the ops module is loaded alone from the same sources.
"""

from __future__ import annotations

import importlib
import os
import sys
import tarfile
import types
from typing import Any

import torch
from peers_common import CannotRun, reason

BLOCK = 64  # block_size_M = block_size_N = 64: the only size its index kernel takes


def _blocks(pattern: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head and query block, the key blocks computed whole (full) and the diagonal block
    (causal), [H, nb, nb] each, from a bench_cuda_peers.Pattern."""
    full, partial = pattern.blocks()
    nb = pattern.nb
    t = torch.arange(nb)[:, None] - torch.arange(nb)[None, :]
    diag = partial.cpu() & (t == 0)
    return full.cpu(), diag


def exact_indexes(pattern: Any) -> tuple[torch.Tensor, ...]:
    """(block_count, block_offset, column_count, column_index), int32, shapes [1, H, R],
    [1, H, R, S], [1, H, R], [1, H, R, V] with R = N / 64: exactly our pairs."""
    G, N, H = pattern.G, pattern.N, pattern.H
    if G % BLOCK or N % BLOCK:
        raise CannotRun(f"granularity {G} and N={N} must be multiples of {BLOCK} for its tiles")
    full, diag = _blocks(pattern)
    vert = pattern.vert.cpu()
    is_bm = pattern.is_bm.cpu()
    R, per = N // BLOCK, G // BLOCK
    offs: list[list[list[int]]] = []
    cols: list[list[list[int]]] = []
    for h in range(H):
        vpos = (
            torch.nonzero(vert[h]).flatten()
            if not bool(is_bm[h])
            else torch.zeros(0, dtype=torch.long)
        )
        vblk = vpos // G
        ho, hc = [], []
        for m in range(R):
            qb, first_row = (m * BLOCK) // G, m * BLOCK
            kbs = torch.nonzero(full[h, qb] | diag[h, qb]).flatten().tolist()
            tiles = [kb * G + BLOCK * u for kb in kbs for u in range(per)]
            ho.append([o for o in tiles if o <= first_row + BLOCK - 1])  # not wholly masked
            keep = (vblk < qb) & ~full[h, qb, vblk.clamp(max=pattern.nb - 1)]
            hc.append(vpos[keep].tolist())
        offs.append(ho)
        cols.append(hc)
    return _pack_pair(offs, cols)


def _pack(rows: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    H, R = len(rows), len(rows[0])
    width = max(1, *(len(r) for hr in rows for r in hr))
    count = torch.zeros(1, H, R, dtype=torch.int32)
    idx = torch.zeros(1, H, R, width, dtype=torch.int32)
    for h, hr in enumerate(rows):
        for m, r in enumerate(hr):
            count[0, h, m] = len(r)
            if r:
                idx[0, h, m, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return count, idx


def _pack_pair(offs: Any, cols: Any) -> tuple[torch.Tensor, ...]:
    bc, bo = _pack(offs)
    cc, ci = _pack(cols)
    return bc, bo, cc, ci


def api_indexes(pattern: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_idx [1, H, V], s_idx [1, H, S]) int32 for vertical_slash_sparse_attention: our
    verticals and the token slashes covering our block diagonals; the rows of different
    lengths padded with N, which its conversion skips (slashes >= a row block's end are
    skipped, verticals past the last tile range are dropped)."""
    G, N, H = pattern.G, pattern.N, pattern.H
    if G % BLOCK:
        raise CannotRun(f"granularity {G} is not a multiple of {BLOCK}")
    if bool(pattern.is_bm.any()):
        raise CannotRun("block-mask heads have no vertical-slash form")
    per = G // BLOCK
    vs, ss = [], []
    for h in range(H):
        vs.append(torch.nonzero(pattern.vert[h].cpu()).flatten().tolist())
        diags = torch.nonzero(pattern.diag[h].cpu()).flatten().tolist()
        s = sorted({t * G + BLOCK * u for t in diags for u in range(-per + 1, per)})
        ss.append([x for x in s if 0 <= x < N])

    def pad(rows: list[list[int]]) -> torch.Tensor:
        width = max(1, *(len(r) for r in rows))
        return torch.tensor([r + [N] * (width - len(r)) for r in rows], dtype=torch.int32)[None]

    return pad(vs), pad(ss)


# f(a) = sum_{x=0}^{63} clamp(min(a + x, 63) + 1, 0, 64): the causal pairs of a 64-row block
# starting a rows after its 64-key tile starts (a in [-64, 64]).
def _tile_table() -> torch.Tensor:
    a = torch.arange(-BLOCK, BLOCK + 1)[:, None]
    x = torch.arange(BLOCK)[None, :]
    return (torch.minimum(a + x, torch.tensor(BLOCK - 1)) + 1).clamp(0, BLOCK).sum(1).double()


_TABLE = _tile_table()


def index_pairs(bc: Any, bo: Any, cc: Any, ci: Any, N: int) -> tuple[int, bool]:
    """(pairs its Triton kernel computes from these indexes, columns all causal): tiles with
    the causal mask, columns without it (a column at or after its row block's first row would
    be computed for rows before it: False)."""
    bc, bo, cc, ci = (x.cpu().long() for x in (bc, bo, cc, ci))
    R = bc.shape[-1]
    first = (torch.arange(R) * BLOCK)[None, None, :]
    valid = torch.arange(bo.shape[-1])[None, None, None, :] < bc[..., None]
    a = (first[..., None] - bo).clamp(-BLOCK, BLOCK) + BLOCK
    tiles = (_TABLE[a] * valid).sum()
    cvalid = torch.arange(ci.shape[-1])[None, None, None, :] < cc[..., None]
    causal = bool(((ci < first[..., None]) | ~cvalid).all())
    rows = torch.clamp(N - first, max=BLOCK)
    cols = (cc * rows).sum()
    return int(tiles.item() + cols.item()), causal


# ---- loading the package on the GPU machine ---------------------------------------------------


def find_sdist(folder: str) -> str:
    names = sorted(
        f for f in os.listdir(folder) if f.startswith("minference-") and f.endswith(".tar.gz")
    )
    if not names:
        raise CannotRun(f"no minference-*.tar.gz in {folder} (pip download minference)")
    return os.path.join(folder, names[-1])


def load(sdist: str, workdir: str) -> tuple[Any, str]:
    """(the module pit_sparse_flash_attention_v2, a note saying what was loaded and how)."""
    os.makedirs(workdir, exist_ok=True)
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        src = os.path.join(workdir, top)
        if not os.path.isdir(src):
            tar.extractall(workdir)
    from torch.utils.cpp_extension import load as load_ext

    if torch.cuda.is_available() and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    build = os.path.join(workdir, "build")
    os.makedirs(build, exist_ok=True)
    try:
        ext = load_ext(
            name="minference_cuda",
            sources=[
                os.path.join(src, "csrc", "kernels.cpp"),
                os.path.join(src, "csrc", "vertical_slash_index.cu"),
            ],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            build_directory=build,
            verbose=False,
        )
    except Exception as e:
        raise CannotRun(
            f"building minference.cuda from {os.path.basename(sdist)} failed: {reason(e)}"
        ) from e
    sys.modules["minference.cuda"] = ext
    sys.path.insert(0, src)
    how = "package imported"
    try:
        importlib.import_module("minference")
        mod = importlib.import_module("minference.ops.pit_sparse_flash_attention_v2")
    except Exception as e:
        for name in [
            n for n in sys.modules if n.startswith("minference") and n != "minference.cuda"
        ]:
            del sys.modules[name]
        for name, sub in (("minference", "minference"), ("minference.ops", "minference/ops")):
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(src, sub)]
            sys.modules[name] = pkg
        try:
            mod = importlib.import_module("minference.ops.pit_sparse_flash_attention_v2")
        except Exception as e2:
            raise CannotRun(f"importing minference's ops module failed: {reason(e2)}") from e2
        how = f"its ops module loaded alone (import minference failed: {reason(e)})"
    path = (
        "Triton kernel"
        if getattr(mod, "sparse_attn_func", None) is None
        else "sgl/vllm sparse_attn_func"
    )
    return mod, f"{top}, {how}, {path}"


def exact_peer(mod: Any, pattern: Any, device: Any) -> tuple[Any, int, str]:
    """(attn(q, k, v), pairs computed, note): its Triton kernel on exact_indexes()."""
    bc, bo, cc, ci = exact_indexes(pattern)
    pairs, causal = index_pairs(bc, bo, cc, ci, pattern.N)
    if not causal:
        raise CannotRun(
            "a column index lies at or after its row block (the kernel would not mask it)"
        )
    bc, bo, cc, ci = (x.to(device) for x in (bc, bo, cc, ci))
    seqlens = torch.tensor([pattern.N], dtype=torch.int32, device=device)

    def attn(q: Any, k: Any, v: Any) -> Any:
        return mod._triton_mixed_sparse_attention(
            q, k, v, seqlens, bc, bo, cc, ci, q.shape[-1] ** -0.5, BLOCK, BLOCK
        )

    return attn, pairs, "its Triton kernel on our exact tiles"


def api_peer(mod: Any, pattern: Any, device: Any) -> tuple[Any, int]:
    """(attn(q, k, v), pairs its own conversion makes it compute) for
    vertical_slash_sparse_attention on api_indexes()."""
    v_idx, s_idx = (x.to(device) for x in api_indexes(pattern))
    conv = sys.modules["minference.cuda"].convert_vertical_slash_indexes
    seqlens = torch.tensor([pattern.N], dtype=torch.int32, device=device)
    vs = v_idx.sort(dim=-1)[0]
    ss = s_idx.sort(dim=-1, descending=True)[0]
    bc, bo, cc, ci = conv(seqlens, vs, ss, pattern.N, BLOCK, BLOCK)
    pairs, _ = index_pairs(bc, bo, cc, ci, pattern.N)

    def attn(q: Any, k: Any, v: Any) -> Any:
        return mod.vertical_slash_sparse_attention(q, k, v, v_idx, s_idx)

    return attn, pairs


if (
    __name__ == "__main__"
):  # the device script's build step: python3 tools/peers_minference.py WHEELS WORKDIR
    import time

    t0 = time.time()
    try:
        _, note = load(find_sdist(sys.argv[1]), os.path.join(sys.argv[2], "minference"))
        print(f"minference ready in {time.time() - t0:.0f} s: {note}")
    except Exception as e:
        print(f"minference: cannot run: {reason(e)} ({time.time() - t0:.0f} s)")
        sys.exit(1)
