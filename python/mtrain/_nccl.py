"""libmtrain's NCCL communicator over a torch.distributed process group.

For CUDA tensors under ``group=``: torch does not expose a group's
``ncclComm_t`` publicly, so mtrain bootstraps its own NCCL communicator
through the group: rank 0 of the group makes an NCCL unique id
(``mtrain_nccl_unique_id``), the group broadcasts it, and every rank creates
its NCCL rank on its current CUDA device (``mtrain_comm_create_nccl``,
collective). The group itself is used only for that broadcast and for the
Python layer's comparison of what the ranks ask for.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.distributed as dist

from . import _lib as L


class NcclComm:
    """An mtrain_comm_t of the NCCL communicator, one per (group, device)."""

    def __init__(self, group: Any, name: str, device: torch.device, timeout: float) -> None:
        if not L.lib().has("comm_create_nccl"):
            raise L.fail(
                L.ERR_NOT_SUPPORTED,
                "context parallel with CUDA tensors needs libmtrain's NCCL communicator, and this "
                f"build has none ({L.lib().path}: built without MTRAIN_WITH_NCCL; install "
                "nccl where the package is built)",
            )
        self.group = group
        self.name = name
        self.device = device
        self.size = int(dist.get_world_size(group))
        self.rank = int(dist.get_rank(group))
        index = device.index if device.index is not None else torch.cuda.current_device()
        uid = (ctypes.c_uint8 * L.NCCL_ID_BYTES)()
        if self.rank == 0:
            L.check(L.lib().nccl_unique_id(ctypes.cast(uid, ctypes.c_void_p)), "NCCL unique id")
        # the id travels through the group (a CUDA tensor: NCCL groups move device memory)
        t = torch.tensor(list(uid), dtype=torch.uint8, device=device)
        dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
        got = bytes(t.cpu().tolist())
        uid = (ctypes.c_uint8 * L.NCCL_ID_BYTES).from_buffer_copy(got)
        out = ctypes.c_void_p()
        with torch.cuda.device(index):
            L.check(
                L.lib().comm_create_nccl(
                    ctypes.cast(uid, ctypes.c_void_p),
                    self.size,
                    self.rank,
                    index,
                    timeout,
                    ctypes.byref(out),
                ),
                f"NCCL communicator of process group {name!r} on cuda:{index}",
            )
        self.ptr = out

    def handle(self) -> ctypes.c_void_p:
        """The mtrain_comm_t * the library takes."""
        return self.ptr

    def agree_context(self, digest: bytes, cached: bool) -> tuple[bool, bool]:
        """Collective over the group: whether every rank asks for the same
        context (digest) and whether every rank has it already."""
        mine = torch.tensor([*digest, 1 if cached else 0], dtype=torch.uint8)
        mine = mine.to(self.device)
        rows = torch.empty(self.size, mine.numel(), dtype=torch.uint8, device=self.device)
        dist.all_gather_into_tensor(rows, mine, group=self.group)
        rows = rows.cpu()
        same = bool((rows[:, :-1] == rows[self.rank, :-1]).all())
        return same, bool((rows[:, -1] == 1).all())

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", None)
        if ptr is not None and ptr.value and L._lib is not None:
            L.lib().comm_destroy(ptr)
            self.ptr = None
