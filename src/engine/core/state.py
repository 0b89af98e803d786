"""The training state and the run's context: what the core's functions take instead of long
argument lists.

`Parts` and `Progress` are what training changes and a checkpoint saves; `Run` is what every
function of a run shares and does not change: this process, the settings, the data, and where
results go (the logger, the checkpointer, the run folder), with the hooks the loop calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from src.engine.core.hooks import Hooks  # which imports this module for its annotations only

if TYPE_CHECKING:  # for the annotations only: these modules import this one
    from src.engine.checkpoint import Checkpointer
    from src.engine.core.task import Task
    from src.engine.data import Data
    from src.engine.distributed import Process
    from src.engine.logger import MetricsLogger
    from src.engine.settings import Checkpointing, Settings, Trainer

log = logging.getLogger(__name__)


@dataclass
class Best:
    """The best validation so far by `monitor` (the weights best.pt holds), and how many
    validations since have not improved on it, which early stopping counts."""

    monitor: str  # a metric of the validation split: val/acc or val/loss
    mode: str  # max or min: whether a higher or a lower value is better
    value: float | None = None
    epoch: int | None = None
    stale: int = 0  # validations since the best one

    def update(self, metrics: dict[str, float], epoch: int) -> bool:
        """Count in the validation of `epoch`; True if it is the new best (ties keep the first)."""
        value = metrics[self.monitor]
        if self.value is None or (value > self.value if self.mode == "max" else value < self.value):
            self.value, self.epoch, self.stale = value, epoch, 0
            return True
        self.stale += 1
        return False

    @classmethod
    def resume(cls, monitor: str, mode: str, saved: dict[str, Any] | None) -> Best:
        """The record a checkpoint saved, if it watched the same monitor; else a fresh one."""
        if saved and (saved["monitor"], saved["mode"]) == (monitor, mode):
            return cls(**saved)
        if saved:
            log.warning(
                "The checkpoint picked its best epoch by %s (%s), this run by %s (%s): the best "
                "so far starts afresh.",
                saved["monitor"],
                saved["mode"],
                monitor,
                mode,
            )
        return cls(monitor, mode)


@dataclass
class Progress:
    """Where training stands: what a checkpoint records, and where a resumed run continues."""

    epoch: int = 1  # the epoch training is in, from 1
    epoch_step: int = 0  # its batches done
    step: int = 0  # optimizer steps done in all
    metrics: dict[str, Any] = field(default_factory=dict)  # the last validation's
    best: Best | None = None  # the best validation so far; None without a validation split

    @classmethod
    def start(
        cls,
        policy: Checkpointing,
        validates: bool,
        resumed: dict[str, Any] | None,
        steps_per_epoch: int,
    ) -> Progress:
        """A fresh start, or where the `resumed` checkpoint stood (the next epoch, if it was saved
        at the end of one)."""
        best = Best(policy.monitor, policy.mode) if validates else None
        if not resumed:
            return cls(best=best)
        progress = cls(
            resumed["epoch"], resumed["epoch_step"], resumed["step"], resumed["metrics"], best
        )
        if best:
            progress.best = Best.resume(best.monitor, best.mode, resumed.get("best"))
        if progress.epoch_step >= steps_per_epoch:  # saved at the end of an epoch
            progress.epoch, progress.epoch_step = progress.epoch + 1, 0
        log.info(
            "Resuming at epoch %d, after %d of its batches, step %d",
            progress.epoch,
            progress.epoch_step,
            progress.step,
        )
        return progress

    @property
    def record(self) -> dict[str, int]:
        """What a logged line says of where training stands."""
        return {"step": self.step, "epoch": self.epoch}

    @property
    def about(self) -> str:
        return f"epoch {self.epoch}, step {self.step}"

    @property
    def ended_in(self) -> int:
        """The last epoch trained in: this one if it has begun, else the one before."""
        return self.epoch if self.epoch_step else self.epoch - 1


class Parts(NamedTuple):
    """What training changes, and a checkpoint saves and restores."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # float16's loss scale; disabled (a no-op) for other precisions


@dataclass
class Run:
    """What the functions of one run share: where this process stands, the checked settings, the
    data, and where results go. `logger` is None on every process but the main one."""

    process: Process
    settings: Settings
    data: Data
    logger: MetricsLogger | None = None
    checkpointer: Checkpointer | None = None
    hooks: Hooks = field(default_factory=Hooks)
    run_dir: Path | None = None

    @property
    def trainer(self) -> Trainer:
        return self.settings.trainer

    @property
    def task(self) -> Task:
        return self.settings.task
