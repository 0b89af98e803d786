"""The progress bar of each epoch's training steps, on a terminal (the main process only)."""

from __future__ import annotations

import sys
import threading

import torch
from tqdm import tqdm

from src.engine.core.context import Hook, Run
from src.engine.core.state import Progress

# One process draws the bar. tqdm's default lock is a multiprocessing one, for bars of several
# processes on one terminal; in a spawned DDP worker, which ends without the interpreter's
# teardown (launch.exit_worker), it would be reported as a leaked semaphore.
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
