"""Context parallel for the training program (docs/TRAINING.md, "Context parallel"): under
torchrun (WORLD_SIZE > 1) or --cp on, every rank holds the whole model and builds the same global
batch, keeps its slots of each sequence (mtrain.dispatch: RoPE positions from the layout, labels
shifted in global order before the dispatch), and every attention layer runs mtrain's ring over
the process group (gloo on the CPU, NCCL on GPUs). The answer-token loss sums and the gradients
are all-reduced, so every rank applies the update of the single-process step."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import mtrain

from .tasks import IGNORE

MODES = ("auto", "on", "off")
LAYOUTS = ("striped", "zigzag", "balanced", "contiguous")
# arms that cannot run on the ring, with the reason (none today: dense runs mtrain's dense
# pattern over the group, window its given pattern, the mtrain arms estimate on the ring)
REFUSED: dict[str, str] = {}


def env_world() -> int:
    """The world size a launcher (torchrun) gave this process; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1") or "1")


def wanted(mode: str, world: int) -> bool:
    """Whether the run is context parallel: --cp on, or auto with WORLD_SIZE > 1."""
    if mode not in MODES:
        raise ValueError(f"--cp {mode!r}: one of {', '.join(MODES)}")
    if mode == "off" and world > 1:
        raise ValueError(
            f"--cp off under a launcher with WORLD_SIZE={world}: every rank would train the same "
            "single-process run and write the same files; use --cp auto (or launch one process)"
        )
    return mode == "on" or (mode == "auto" and world > 1)


def check(
    arm: str, seq_len: int, granularity: int, layout: str, world: int, eval_len: int = 0
) -> None:
    """Refuses, before any process group exists (so every rank fails alike and none waits), what
    cannot run on `world` ranks: a refused arm, an unknown layout, and a sequence so short for
    the layout that some rank would hold only padding slots."""
    if arm in REFUSED:
        raise ValueError(f"arm {arm!r} cannot run under context parallel: {REFUSED[arm]}")
    if layout not in LAYOUTS:
        raise ValueError(f"--cp-layout {layout!r}: one of {', '.join(LAYOUTS)}")
    for n in {seq_len, eval_len or seq_len}:
        x = torch.zeros(1, n)
        for r in range(world):
            info = mtrain.dispatch(
                x, layout=layout, seq_dim=1, granularity=granularity, world=world, rank=r
            ).info
            if int((info.rows >= 0).sum()) == 0:
                blocks = -(-n // granularity)
                raise ValueError(
                    f"--seq-len {n} over {world} ranks ({layout} layout, {blocks} blocks of "
                    f"{granularity} tokens): rank {r} would hold no token of the sequence; use "
                    "a longer sequence, a smaller --granularity, fewer ranks or another layout"
                )


@dataclass
class Shard:
    """This rank's part of a batch: input ids and next-token targets ([B, N_local], -100 where
    no answer is predicted and on padding slots), an optional per-slot extra (buckets), and the
    keyword arguments the model's forward needs (position_ids, mtrain_dispatch)."""

    ids: torch.Tensor
    targets: torch.Tensor
    extra: torch.Tensor | None
    kwargs: dict[str, Any] = field(default_factory=dict)


def shifted(labels: torch.Tensor, fill: int = IGNORE) -> torch.Tensor:
    """Next-token targets in global order: targets[:, i] = labels[:, i + 1], `fill` at the end."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), fill)], dim=1)


@dataclass
class Cp:
    """The run's context-parallel state; world 1 without a group is the single-process run."""

    group: Any = None
    world: int = 1
    rank: int = 0
    local_rank: int = 0
    layout: str = "striped"
    backend: str = ""
    owns_group: bool = False

    @property
    def on(self) -> bool:
        return self.group is not None

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs and writes files."""
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "layout": self.layout if self.on else None,
            "backend": self.backend or None,
        }

    # -- data ----------------------------------------------------------------
    def shard(
        self,
        ids: torch.Tensor,
        labels: torch.Tensor,
        granularity: int,
        device: torch.device,
        extra: torch.Tensor | None = None,
    ) -> Shard:
        """This rank's slots of the global batch (ids, labels, extra [B, N] on the CPU).
        `extra` (the answer buckets) is shifted like the labels and padded with -1."""
        targets = shifted(labels)
        ext = shifted(extra, -1) if extra is not None else None
        if not self.on:
            return Shard(ids.to(device), targets.to(device), ext)
        ids_l, pos, info = mtrain.dispatch(
            ids.to(device), self.group, layout=self.layout, seq_dim=1, granularity=granularity
        )
        t_l = mtrain.dispatch(targets.to(device), info=info, pad_value=IGNORE).local
        e_l = mtrain.dispatch(ext, info=info, pad_value=-1).local if ext is not None else None
        return Shard(ids_l, t_l, e_l, {"position_ids": pos, "mtrain_dispatch": info})

    # -- collectives -----------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or `op`) over the ranks, in place; identity on one rank."""
        if self.on:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when it is true on one (the time limit: all ranks stop together)."""
        if not self.on:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self.all_reduce(t, dist.ReduceOp.MAX).item() > 0)

    def barrier(self) -> None:
        if self.on:
            dist.barrier(group=self.group)

    def sync_gradients(self, params: list[torch.nn.Parameter], extra: torch.Tensor) -> torch.Tensor:
        """All-reduces (sums) the parameters' gradients and `extra` (the step's loss sum and
        answer count) in one flat buffer; returns the summed extra. A parameter without a
        gradient on this rank contributes zeros."""
        if not self.on:
            return extra
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [extra.to(grads[0].dtype).reshape(-1)])
        self.all_reduce(flat)
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p)
            off += n
        return flat[off:]

    def replica_diff(self, model: torch.nn.Module) -> float:
        """The largest difference of any weight between this rank and rank 0, the maximum over
        the ranks (0.0: every rank holds the same model, as it must)."""
        if not self.on:
            return 0.0
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            ref = flat.clone()
            dist.broadcast(ref, src=dist.get_global_rank(self.group, 0), group=self.group)
            diff = (flat - ref).abs().max().reshape(1)
            return float(self.all_reduce(diff, dist.ReduceOp.MAX).item())


def start(mode: str, device: str, layout: str, timeout_s: float = 1800.0) -> Cp:
    """The run's Cp: single-process (no group) unless context parallel is wanted (wanted());
    then the process group from torchrun's environment (env://: MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, LOCAL_RANK), NCCL with one GPU per rank (cuda:LOCAL_RANK) or gloo on the CPU. An
    existing default group is used as it is."""
    world = env_world()
    if not wanted(mode, world):
        return Cp()
    if not dist.is_available():
        raise RuntimeError("context parallel needs torch.distributed, which this torch lacks")
    local = int(os.environ.get("LOCAL_RANK", "0") or "0")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device} under context parallel: no CUDA device")
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local} but {torch.cuda.device_count()} CUDA devices: one GPU per "
                "rank (torchrun --nproc_per_node at most the GPU count)"
            )
        torch.cuda.set_device(local)
    owns = not dist.is_initialized()
    if owns:
        kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if cuda:
            kw["device_id"] = torch.device("cuda", local)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # --cp on without a launcher: a group of one process (the same code path)
            kw.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        dist.init_process_group("nccl" if cuda else "gloo", **kw)
    group = dist.group.WORLD
    return Cp(
        group=group,
        world=int(dist.get_world_size(group)),
        rank=int(dist.get_rank(group)),
        local_rank=local,
        layout=layout,
        backend=str(dist.get_backend(group)),
        owns_group=owns,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def teardown(cp: Cp) -> None:
    """The end of a context-parallel run (docs/PYTORCH.md, "Context parallel"): a barrier (rank
    0 has written its files), mtrain.reset() (it releases the group's communicators), then the
    process group destroyed. The caller then leaves with os._exit (a gloo thread destroyed at
    interpreter exit aborted processes now and then)."""
    if not cp.on:
        return
    try:
        cp.barrier()
    finally:
        mtrain.reset()
        if cp.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def finish(cp: Cp, rc: int) -> NoReturn:
    """Leaves the process with status `rc`: teardown() first when the run succeeded (a failed
    rank skips the barrier its peers may never reach), the streams flushed, then os._exit (no
    interpreter teardown: see teardown())."""
    try:
        if rc == 0:
            teardown(cp)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
