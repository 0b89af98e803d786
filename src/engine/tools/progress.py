"""The progress bar of each epoch's training steps, on a terminal (the main process only)."""

from __future__ import annotations

import sys
import threading

import torch
from tqdm import tqdm

from src.engine.core.context import Hook, Run
from src.engine.core.state import Progress

# One process draws the bar: a thread lock will do. tqdm's default multiprocessing lock is reported
# as a leaked semaphore by a DDP worker, which ends without teardown (launch.exit_worker).
tqdm.set_lock(threading.RLock())


class ProgressBar(Hook):
    """tqdm's bar over the epoch's steps, from where a resumed epoch stands."""

    def epoch_started(self, run: Run, progress: Progress) -> None:
        self.bar = tqdm(
            initial=progress.epoch_step,
            total=run.data.steps_per_epoch,
            leave=False,
            desc=f"epoch {progress.epoch}",
            disable=not (run.process.is_main and sys.stdout.isatty()),
        )

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.bar.update()

    def epoch_ended(self, run: Run, progress: Progress) -> None:
        self.bar.close()
