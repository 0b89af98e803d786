"""Checkpoints: plain dicts of tensors and Python values, written atomically by the main process.

A checkpoint holds the unwrapped model's `state_dict` (no `module.` prefix), so it loads into any
parallel mode, and nothing but tensors and plain Python types, so `torch.load(weights_only=True)`
reads it.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.distributed import Process, unwrap


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy, torch CPU and CUDA), as plain lists."""
    numpy_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available()
        else [],
    }


def save(
    path: Path,
    proc: Process,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    step: int,
    cfg: DictConfig,
    metrics: dict[str, Any],
    wandb_id: str | None,
) -> None:
    """Write a checkpoint to `path` from the main process, atomically; every rank waits for it.

    Each rank's random state is kept (dropout differs per rank), gathered to the main process.
    The file is written beside its final name and renamed over it, so a kill during the write
    leaves the previous checkpoint whole.
    """
    rng = proc.all_gather_object(rng_state())
    if proc.is_main:
        state = {
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step": step,
            "rng": rng,
            "config": OmegaConf.to_container(cfg, resolve=True),
            "wandb_id": wandb_id,
            "metrics": metrics,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        torch.save(state, partial)
        os.replace(partial, path)
    proc.barrier()


def copy(source: Path, target: Path, proc: Process) -> None:
    """Copy a checkpoint file from the main process, atomically (e.g. last.pt to best.pt)."""
    if proc.is_main:
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
