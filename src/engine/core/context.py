"""The run's context (`Run`: what every function of a run shares and does not change), and the
named points where the guards and the tools plug into the loop (`Hook`; docs/layout.md has each
one's when). A check (`votes`, then `agreed`) puts every hook's values into one all-reduce, so a
hook that raises stops every rank at once."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn

from src.engine.checkpoint import Checkpointer
from src.engine.config import Settings, Trainer
from src.engine.core.state import Parts, Progress
from src.engine.core.task import Task
from src.engine.data import Data
from src.engine.logger import MetricsLogger
from src.engine.parallel import Process, Strategy


class Hook:
    """A guard or a tool; each point does nothing unless a subclass overrides it."""

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        return nullcontext()

    def epoch_started(self, run: Run, progress: Progress) -> None:
        pass

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        pass

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return []

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        pass

    def epoch_ended(self, run: Run, progress: Progress) -> None:
        pass

    def evaluating(self, run: Run, model: nn.Module, split: str) -> AbstractContextManager:
        return nullcontext()

    def wants_stop(self, run: Run) -> bool:
        return False

    def stop(self, run: Run, progress: Progress) -> NoReturn:
        raise NotImplementedError(f"{type(self).__name__} asked to stop, and has no stop()")


class Hooks(list[Hook]):
    """The run's hooks, called in order at each point."""

    def active(self, run: Run, parts: Parts, progress: Progress) -> ExitStack:
        stack = ExitStack()
        for hook in self:
            stack.enter_context(hook.active(run, parts, progress))
        return stack

    def epoch_started(self, run: Run, progress: Progress) -> None:
        for hook in self:
            hook.epoch_started(run, progress)

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        for hook in self:
            hook.after_step(run, progress, loss)

    def epoch_ended(self, run: Run, progress: Progress) -> None:
        for hook in self:
            hook.epoch_ended(run, progress)

    def evaluating(self, run: Run, model: nn.Module, split: str) -> ExitStack:
        """Around an evaluation of `split`: which weights it evaluates (an average's, say)."""
        stack = ExitStack()
        for hook in self:
            stack.enter_context(hook.evaluating(run, model, split))
        return stack

    def check(
        self, run: Run, progress: Progress, loss: float = 0.0, weights: nn.Module | None = None
    ) -> float:
        """One all-reduce for this rank's `loss` and every hook's votes; each hook then reads the
        ranks' sums of its own. Returns the loss averaged over the ranks."""
        votes = [hook.votes(run, progress, weights) for hook in self]
        sums = run.process.sum_over_ranks([loss, *(v for own in votes for v in own)])
        at = 1
        for hook, own in zip(self, votes, strict=True):
            hook.agreed(run, progress, sums[at : at + len(own)], weights)
            at += len(own)
        return sums[0] / run.process.world_size

    def stopping(self, run: Run) -> bool:
        """Whether a hook asks training to stop after this step."""
        return any(hook.wants_stop(run) for hook in self)

    def stop(self, run: Run, progress: Progress) -> NoReturn:
        """End training as the first hook that asks it to stop does."""
        next(hook for hook in self if hook.wants_stop(run)).stop(run, progress)


@dataclass
class Run:
    """What one run's functions share: where this process stands, the checked settings, the data,
    where results go, and the hooks the loop calls. `logger` is None off the main process."""

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

    @property
    def strategy(self) -> Strategy:
        return self.settings.parallel

    def autocast(self) -> AbstractContextManager:
        """Mixed precision on this process's device for bf16 or 16; nothing for 32 and 64."""
        dtype = self.trainer.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(self.process.device.type, dtype)
