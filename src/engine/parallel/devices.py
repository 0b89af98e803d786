"""Which device a process trains on: the one `device` names, or the best this machine has."""

import os
from typing import Any

import torch

from src.engine.errors import UserError


def pick_device(requested: str, allow_mps: bool = True) -> torch.device:
    """`auto` is the first of cuda, mps, cpu that this machine has; anything else is checked."""
    if requested == "auto":
        mps = allow_mps and torch.backends.mps.is_available()
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(
            f"device={requested} is not a device. Use auto, cpu, cuda, cuda:N or mps."
        ) from None
    absent = {"cuda": "no CUDA GPU is visible", "mps": "MPS is not available"}.get(device.type)
    backend = torch.cuda if device.type == "cuda" else torch.backends.mps
    if absent and not backend.is_available():
        raise UserError(f"device={requested}, but {absent}. Use device=auto or device=cpu.")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise UserError(
            f"device={requested}, but this machine shows {count} GPU(s), cuda:0 to "
            f"cuda:{count - 1}. Pick one of them, or device=auto."
        )
    return device


def one_device(requested: str, trainer: Any, mode: str) -> torch.device:
    """The device of a mode that trains in one process (none, dp), refused under torchrun."""
    if (world_size := int(os.environ.get("WORLD_SIZE", 1))) > 1:
        raise UserError(
            f"torchrun started {world_size} processes, but parallel={mode} trains in one. Add "
            f"parallel=ddp (or fsdp), or run python train.py parallel={mode} without torchrun."
        )
    device = pick_device(requested)
    if device.type == "mps" and trainer.precision == "64":
        raise UserError(
            "trainer.precision=64, but mps has no float64: use device=cpu, or trainer.precision=32."
        )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # else the CUDA context and pinned-memory thread use GPU 0
    return device


def rank_gpu(local_rank: int, count: int, visible: str | None) -> int:
    """`local_rank`'s GPU of the `count` visible: its own, or the one a cluster shows each rank."""
    if local_rank < count:
        return local_rank
    if count == 1 and visible is not None and "," not in visible:
        return 0
    raise UserError(
        f"torchrun started more processes on this machine than the {count} GPUs it sees "
        f"(local rank {local_rank}). Use --nproc_per_node={count} or fewer."
    )
