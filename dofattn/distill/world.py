"""The processes of a run: torchrun's environment, or one process."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size): torchrun's environment, or (0, 1)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def join(device: str) -> str:
    """Join torchrun's process group where WORLD_SIZE > 1; the device of this process (its own GPU on CUDA)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(hours=4))
    if device.startswith("cuda") and world()[1] > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)     # FSDP's device mesh takes each process's current device
    return device


def all_mean(tensors: list[torch.Tensor]) -> None:
    """Each tensor, in place, the mean of its values over the processes."""
    size = world()[1]
    if size > 1:
        for t in tensors:
            dist.all_reduce(t)
            t /= size


def all_max(tensors: list[torch.Tensor]) -> None:
    """Each tensor, in place, its largest value over the processes, element by element."""
    if world()[1] > 1:
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)


def rank0_decides(flag: bool, device) -> bool:
    """Rank 0's `flag`, on every process."""
    if world()[1] == 1:
        return flag
    t = torch.tensor([float(flag)], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, 0)
    return bool(t.item())
