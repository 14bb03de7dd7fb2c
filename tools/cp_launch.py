"""cp_launch.py: the process group of the torchrun tools (cp_check.py, bench_cp_torch.py): NCCL
with one GPU per rank (cuda:LOCAL_RANK) or gloo on the CPU; one process without a launcher runs as
a group of one."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist


def die(prog: str, msg: str, code: int = 2) -> None:
    """Prints `prog: [rank r] error: msg` (no traceback) and exits with `code`."""
    rank = os.environ.get("RANK")
    where = f"[rank {rank}] " if rank is not None else ""
    print(f"{prog}: {where}error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def init_group(prog: str, want: str, timeout_min: float) -> tuple[int, int, torch.device, Any]:
    """init_process_group from torchrun's environment; `want` is auto, cuda or cpu. Returns rank,
    world size, this rank's device and the group (WORLD). On the CPU each rank takes its share of
    the cores (torch and MTRAIN_NUM_THREADS)."""
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        die(prog, "--device cuda: no CUDA device is visible")
    if not dist.is_available():
        die(prog, "torch.distributed is not available in this torch")
    if "RANK" not in os.environ:  # one process without a launcher: a group of one
        os.environ.update(
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        )
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(minutes=timeout_min)
    if want == "cuda":
        if local >= torch.cuda.device_count():
            die(prog, f"LOCAL_RANK {local} but {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        lw = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, lw)))
        os.environ.setdefault("MTRAIN_NUM_THREADS", str(torch.get_num_threads()))
        dist.init_process_group("gloo", timeout=timeout)
    return rank, world, device, dist.group.WORLD
