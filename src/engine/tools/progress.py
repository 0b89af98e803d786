"""The progress bar of each epoch's training steps, on a terminal (the main process only)."""

from __future__ import annotations

import sys
import threading

import torch
from tqdm import tqdm

from src.engine.core.context import Hook, Run
from src.engine.core.state import Progress

# One process draws: a thread lock will do (tqdm's multiprocessing lock leaks in a DDP worker).
tqdm.set_lock(threading.RLock())


class ProgressBar(Hook):
    """tqdm's bar over the epoch's steps, from where a resumed epoch stands."""

    def epoch_started(self, run: Run, progress: Progress) -> None:
        step, steps = progress.epoch_step, run.data.steps_per_epoch
        hidden = not (run.process.is_main and sys.stdout.isatty())
        self.bar = tqdm(
            initial=step, total=steps, desc=f"epoch {progress.epoch}", leave=False, disable=hidden
        )

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.bar.update()

    def epoch_ended(self, run: Run, progress: Progress) -> None:
        self.bar.close()
