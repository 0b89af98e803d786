"""Which device a process trains on: the one `device` names, or the best this machine has."""

from __future__ import annotations

import os
from typing import Any

import torch

from src.engine.errors import UserError


def pick_device(requested: str, allow_mps: bool = True) -> torch.device:
    """`auto` is the first of cuda, mps, cpu that this machine has; anything else is checked."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if allow_mps and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(
            f"device={requested} is not a device. Use auto, cpu, cuda, cuda:N or mps."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device={requested}, but no CUDA GPU is visible. Use device=auto or device=cpu."
        )
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise UserError(
            f"device={requested}, but this machine shows {count} GPU(s), cuda:0 to "
            f"cuda:{count - 1}. Pick one of them, or device=auto."
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(
            f"device={requested}, but MPS is not available. Use device=auto or device=cpu."
        )
    return device


def one_device(requested: str, trainer: Any, mode: str) -> torch.device:
    """The device of a mode that trains in one process (none, dp), refused under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        raise UserError(
            f"torchrun started {world_size} processes, but parallel={mode} trains in one. "
            f"Add parallel=ddp (or fsdp), or run python train.py parallel={mode} without "
            "torchrun."
        )
    device = pick_device(requested)
    if device.type == "mps" and trainer.precision == "64":
        raise UserError(
            "trainer.precision=64 on mps: Apple's GPUs have no float64. Use device=cpu for "
            "float64, or trainer.precision=32."
        )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # else the CUDA context and pinned-memory thread use GPU 0
    return device


def rank_gpu(local_rank: int, count: int, visible: str | None) -> int:
    """The GPU of the rank `local_rank` among the `count` this process sees: its own index, or
    the one GPU a cluster shows each rank (CUDA_VISIBLE_DEVICES naming a single GPU)."""
    if local_rank < count:
        return local_rank
    if count == 1 and visible is not None and "," not in visible:
        return 0
    raise UserError(
        f"torchrun started more processes on this machine than the {count} GPUs it sees "
        f"(local rank {local_rank}). Use --nproc_per_node={count} or fewer."
    )
