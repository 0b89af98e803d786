"""debug=overfit's verdict: one small batch trained on again and again must be learnt by heart, its
loss near zero, or the model, the loss or the data pipeline is broken (Karpathy's first check)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from hydra.errors import CompactHydraException

from src.engine.core.context import Hook, Parts, Progress, Run

log = logging.getLogger(__name__)


class NotOverfit(CompactHydraException):
    """The batch was not learnt (Hydra prints the message, exit 1)."""


class Overfit(Hook):
    """After training: passed, the training loss below `below`, or failed (exit 1)."""

    def __init__(self, below: float):
        self.below, self.loss = below, None

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    @contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        yield
        if self.loss is None:  # nothing trained (a resume at its end)
            return
        process = run.process  # the mean over the ranks, as train/loss is logged
        loss = process.sum_over_ranks([self.loss.item()])[0] / process.world_size
        trained = f"after {progress.step} steps on {run.data.size('train')} samples"
        if not loss < self.below:
            raise NotOverfit(
                f"debug=overfit failed: the training loss is {loss:.4g} {trained}, not below "
                f"{self.below} (debug.overfit_below). A model that cannot learn one batch by "
                "heart is broken: check that the targets belong to their inputs, that the "
                "model's output is what the task's loss takes, and optimizer.lr."
            )
        log.info(
            f"debug=overfit passed: the training loss fell to {loss:.4g} {trained}, below "
            f"{self.below} (debug.overfit_below)."
        )
