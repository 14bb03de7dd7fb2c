"""Context parallel data movement: mtrain.dispatch puts a global batch into
this rank's slots of a layout (docs/SPEC.md section 3: contiguous, zigzag,
striped, balanced), with the local position ids for RoPE; mtrain.undispatch
puts local rows back at their global positions (and gathers the ranks'
rows). Both are differentiable torch code (index_select / index_copy, and
torch.distributed.nn's all-gather)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import _core as C
from . import _lib as L

__all__ = ["DispatchInfo", "Dispatched", "dispatch", "undispatch"]


@dataclass(frozen=True)
class DispatchInfo:
    """Where this rank's local slots come from.

    Attributes:
        group: the process group (None: one rank, or world/rank given by hand).
        rank, world: this rank and the world size.
        layout, granularity: the layout kind and block size.
        seq_lens: the global length of each sequence.
        cu_seqlens: global FlashAttention offsets (CPU int64), for mtrain.attention.
        batched: True when the batch is [B, N, ...] (seq_dim 1).
        rows: for each local slot the global packed row, -1 for padding (CPU int64).
        position_ids: for each local slot its position in its sequence (CPU int64;
            padding slots continue past the sequence's end).
    """

    group: Any
    rank: int
    world: int
    layout: str
    granularity: int
    seq_lens: tuple[int, ...]
    cu_seqlens: torch.Tensor
    batched: bool
    rows: torch.Tensor
    position_ids: torch.Tensor

    @property
    def local_tokens(self) -> int:
        """Slots of this rank over the batch (padding included)."""
        return int(self.rows.numel())

    def attention_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of mtrain.attention / estimate_pattern for the
        dispatched tensors (group, layout, granularity, global offsets)."""
        kw: dict[str, Any] = {
            "group": self.group,
            "layout": self.layout,
            "granularity": self.granularity,
        }
        if self.batched:
            kw["seq_len"] = self.seq_lens[0]
        else:
            kw["cu_seqlens"] = self.cu_seqlens
        return kw


class Dispatched(NamedTuple):
    """What mtrain.dispatch returns."""

    local: torch.Tensor
    position_ids: torch.Tensor
    info: DispatchInfo


def _rows(
    kind: str, seq_lens: list[int], granularity: int, world: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, pos = [], []
    off = 0
    for n in seq_lens:
        if world == 1:
            idx = torch.arange(n, dtype=torch.int64)
        else:
            idx = C.layout(kind, n, granularity, world).token_index(rank)
        pos.append(idx)
        rows.append(torch.where(idx < n, idx + off, torch.full_like(idx, -1)))
        off += n
    return torch.cat(rows), torch.cat(pos)


def _world_rank(group: Any, world: int | None, rank: int | None) -> tuple[int, int]:
    if group is not None:
        import torch.distributed as dist

        return int(dist.get_world_size(group)), int(dist.get_rank(group))
    if world is None:
        return 1, 0
    if rank is None or not 0 <= rank < world:
        raise L.fail(L.ERR_INVALID_ARGUMENT, f"rank {rank} out of range for world {world}")
    return int(world), int(rank)


def dispatch(
    x: torch.Tensor,
    group: Any = None,
    *,
    layout: str = "striped",
    cu_seqlens: torch.Tensor | None = None,
    seq_dim: int = 0,
    granularity: int = 128,
    info: DispatchInfo | None = None,
    pad_value: float = 0,
    world: int | None = None,
    rank: int | None = None,
) -> Dispatched:
    """This rank's slots of a global batch.

    Args:
        x: the global batch, packed [T, ...] (seq_dim 0; sequences by cu_seqlens)
            or batched [B, N, ...] (seq_dim 1: B sequences of N tokens). Every rank
            passes the same global batch.
        group: the process group (its rank and size); or give world= and rank=.
        layout: "striped" (MTraining's), "zigzag", "contiguous" or "balanced".
        cu_seqlens: global offsets of packed sequences (CPU).
        granularity: the block size G of the layout (the attention's).
        info: the DispatchInfo of an earlier call: dispatch another tensor of the
            same batch (labels, position ids) the same way.
        pad_value: the value of padding slots (e.g. -100 for labels).

    Returns:
        (local [T_local, ...] or [B, N_local, ...], position_ids of the same
        leading shape, info).
    """
    if info is None:
        w, r = _world_rank(group, world, rank)
        if layout not in L.LAYOUT_KINDS:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT,
                f"layout {layout!r} is not one of {', '.join(L.LAYOUT_KINDS)}",
            )
        if seq_dim == 1:
            if cu_seqlens is not None:
                raise L.fail(L.ERR_INVALID_ARGUMENT, "cu_seqlens is for packed batches (seq_dim 0)")
            b, n = int(x.shape[0]), int(x.shape[1])
            seq_lens = [n] * b
        elif seq_dim == 0:
            seq_lens = C.seq_lens_of(cu_seqlens, int(x.shape[0]), 1)
        else:
            raise L.fail(L.ERR_INVALID_ARGUMENT, f"seq_dim {seq_dim}: 0 (packed) or 1 (batched)")
        rows, pos = _rows(layout, seq_lens, granularity, w, r)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.int64).cumsum(0)
        info = DispatchInfo(
            group, r, w, layout, granularity, tuple(seq_lens), cu, seq_dim == 1, rows, pos
        )
    total = sum(info.seq_lens)
    flat = x.reshape(total, *x.shape[2:]) if info.batched else x
    if flat.shape[0] != total:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"x has {flat.shape[0]} tokens but the batch has {total} ({list(info.seq_lens)})",
        )
    valid = info.rows >= 0
    idx = info.rows.clamp(min=0).to(flat.device)
    local = flat.index_select(0, idx)
    if not bool(valid.all()):
        mask = valid.to(flat.device).view(-1, *([1] * (flat.ndim - 1)))
        local = torch.where(mask, local, torch.full_like(local, pad_value))
    pos = info.position_ids
    if info.batched:
        b = len(info.seq_lens)
        local = local.reshape(b, -1, *flat.shape[1:])
        pos = pos.reshape(b, -1)
    return Dispatched(local, pos.to(x.device), info)


class _AllGather(torch.autograd.Function):
    """All-gather with the gradient summed over ranks and sliced back (by
    all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, group: Any, world: int, rank: int
    ) -> tuple[torch.Tensor, ...]:
        import torch.distributed as dist

        ctx.group, ctx.rank = group, rank
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        import torch.distributed as dist

        g = torch.stack([x.contiguous() for x in grads])
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank], None, None, None


def undispatch(local: torch.Tensor, info: DispatchInfo, gather: bool = True) -> torch.Tensor:
    """The global batch from local slots (the inverse of dispatch).

    gather=True: all ranks' slots are gathered over info.group (collective; the
    gradient flows back to each rank's slots) and every rank gets the whole
    batch. gather=False: only this rank's rows are filled, the others are zero.
    Padding slots are dropped."""
    b = len(info.seq_lens)
    flat = local.reshape(-1, *local.shape[2:]) if info.batched else local
    if flat.shape[0] != info.local_tokens:
        raise L.fail(
            L.ERR_SHAPE_MISMATCH,
            f"local has {flat.shape[0]} slots but this rank holds {info.local_tokens}",
        )
    total = sum(info.seq_lens)
    out = flat.new_zeros((total, *flat.shape[1:]))
    parts: list[tuple[torch.Tensor, torch.Tensor]]
    if gather and info.world > 1:
        if info.group is None:
            raise L.fail(L.ERR_INVALID_ARGUMENT, "undispatch(gather=True) needs the info's group")
        gathered = _AllGather.apply(flat.contiguous(), info.group, info.world, info.rank)
        parts = [
            (
                _rows(info.layout, list(info.seq_lens), info.granularity, info.world, r)[0],
                gathered[r],
            )
            for r in range(info.world)
        ]
    else:
        parts = [(info.rows, flat)]
    for rows, t in parts:
        keep = rows >= 0
        sel = keep.nonzero().squeeze(1).to(t.device)
        out = out.index_copy(0, rows[keep].to(t.device), t.index_select(0, sel))
    if info.batched:
        out = out.reshape(b, -1, *flat.shape[1:])
    return out
