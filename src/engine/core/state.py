"""The training state: what training changes and a checkpoint saves, each part with its own
`state_dict` and `load_state_dict` (the schedule, the progress; the model, the optimizer and the
scaler are torch's own, or adapted in src/engine/checkpoint.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from src.engine.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Best:
    """The best validation so far by `monitor`: the weights best.pt holds."""

    monitor: str  # a metric of the validation split: val/acc or val/loss
    mode: str  # max or min: whether a higher or a lower value is better
    value: float | None = None
    epoch: int | None = None
    stale: int = 0  # validations since the best one, which early stopping counts

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
            log.warning("The checkpoint picked its best epoch by %s (%s), this run by %s (%s): "
                        "the best so far starts afresh.", saved["monitor"], saved["mode"], monitor,
                        mode)  # fmt: skip
        return cls(monitor, mode)


@dataclass
class Progress:
    """Where training stands: the part of the checkpoint a resumed run continues from."""

    epoch: int = 1  # the epoch training is in, from 1
    epoch_step: int = 0  # its batches done
    step: int = 0  # optimizer steps done in all
    metrics: dict[str, Any] = field(default_factory=dict)  # the last validation's
    best: Best | None = None  # the best validation so far; None without a validation split
    batch_size: int = 1  # the global batch epoch_step counts (data.batch_size)
    stopped: str = ""  # why a callback stopped training, which ends it for a resumed run too
    # Not saved: the images of an epoch (the data's).
    train_size: int = field(default=0, metadata={"saved": False})

    def state_dict(self) -> dict[str, Any]:
        """Every field (a field added is saved and loaded too), `best` as a plain dict."""
        saved = [f.name for f in dataclasses.fields(self) if f.metadata.get("saved", True)]
        state = {name: getattr(self, name) for name in saved}
        return state | {"best": self.best and dataclasses.asdict(self.best)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the checkpoint stood: at the same image of its epoch (under any batch
        size that divides the images done), in the next epoch if it was saved at an epoch's end."""
        saved, batches = state.get("batch_size") or self.batch_size, state["epoch_step"]
        for name, value in state.items():  # the batch size and the best: this run's, below
            if name not in ("batch_size", "best") and hasattr(self, name):
                setattr(self, name, value)
        self.epoch_step = self.rebatched(batches, saved)
        if self.best:
            self.best = Best.resume(self.best.monitor, self.best.mode, state.get("best"))
        if self.epoch_step >= math.ceil(self.train_size / self.batch_size):  # an epoch's end
            self.epoch, self.epoch_step = self.epoch + 1, 0
        log.info("Resuming at epoch %d, after %d of its batches, step %d",
                 self.epoch, self.epoch_step, self.step)  # fmt: skip

    def rebatched(self, batches: int, saved: int) -> int:
        """The checkpoint's `batches` of `saved` images into the epoch, in this run's batches:
        refused where they do not end on one of them."""
        if saved == self.batch_size:
            return batches
        done = min(batches * saved, self.train_size)
        if done == self.train_size:  # saved at the end of an epoch
            return math.ceil(self.train_size / self.batch_size)
        if done % self.batch_size:
            sizes = [d for d in range(1, done + 1) if done % d == 0]
            near = sorted(sorted(sizes, key=lambda d: (abs(d - self.batch_size), d))[:3])
            raise UserError(
                f"The checkpoint stands {done} images into epoch {self.epoch} ({batches} "
                f"batches of {saved}), which data.batch_size={self.batch_size} does not divide: "
                f"resume with one that does ({', '.join(map(str, near))}), or from a checkpoint "
                "at the end of an epoch."
            )
        log.info("The checkpoint's %d batches of %d into epoch %d are %d batches of %d",
                 batches, saved, self.epoch, done // self.batch_size, self.batch_size)  # fmt: skip
        return done // self.batch_size

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


class Schedule:
    """The learning-rate scheduler, stepped after each optimizer step or epoch; checkpointed."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, every_step: bool = False):
        self.scheduler, self.every_step = scheduler, every_step

    def after_step(self) -> None:
        if self.every_step:
            self.scheduler.step()

    def after_epoch(self) -> None:
        if not self.every_step:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This config's plan (its epochs, max_steps, batch size) stepped as far as the checkpoint's
        had been: a fresh run's rate there (the checkpoint's own, where the plan is the same)."""
        steps = state["last_epoch"]
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR cannot step past it
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(min(steps, total) if total else steps):
                self.scheduler.step()


class Parts(NamedTuple):
    """What training changes, and a checkpoint saves and restores."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler  # float16's loss scale; disabled (a no-op) for other precisions
