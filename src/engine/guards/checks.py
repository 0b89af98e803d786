"""The checks that stop every rank at once, before anything bad is validated or saved: a NaN or
infinite loss or weight, and metrics.jsonl refused by the storage. The losses stay on the device
until a check (each logging step, evaluation or save), where one all-reduce tells every rank."""

import torch
from hydra.errors import CompactHydraException
from torch import nn

from src.engine.core.context import Hook, Run
from src.engine.core.loop import global_count, nothing_counted
from src.engine.core.state import Progress


class NonFiniteLoss(CompactHydraException):
    """The training loss became NaN or infinite; nothing after it was saved."""


class NonFinite(Hook):
    """Stop every rank at a NaN or infinite loss, or weight before an evaluation or save."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, torch.Tensor]] = []  # (step, loss) since the last check
        self.first_bad: int | None = None  # this rank's first step with a bad loss

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.losses.append((progress.step, loss))

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        steps, losses = zip(*self.losses, strict=True) if self.losses else ((), ())
        bad = (~torch.isfinite(torch.stack(losses))).nonzero() if losses else []
        self.first_bad = steps[bad[0].item()] if len(bad) else None
        self.losses = []
        tensors = run.strategy.unwrap(weights).state_dict().values() if weights is not None else []
        checks = [run.strategy.local(t).isfinite().all() for t in tensors if t.is_floating_point()]
        return [self.first_bad is not None, bool(checks) and not torch.stack(checks).all().item()]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        if not any(sums):  # no rank saw a bad loss (sums[0]) or bad weights (sums[1])
            return
        what = f"the weights were not finite after step {progress.step}"
        if sums[0]:
            first = min(s for s in run.process.all_gather_object(self.first_bad) if s is not None)
            what = f"the training loss was not finite at step {first}"
        tries = ["a lower optimizer.lr", "a lower gradient_clip_val"]
        if run.trainer.gradient_clip_val is None:
            tries[1] = "trainer.gradient_clip_val=1.0"
        if run.trainer.precision != "32":
            tries.append("trainer.precision=32")
        raise NonFiniteLoss(
            f"Stopped: {what} (NaN or infinite), and nothing after it was saved ({intact(run)}). "
            f"Try {', '.join(tries[:-1])} or {tries[-1]}."
        )


class UnwrittenMetrics(Hook):
    """Stop every rank, the last checkpoint intact, when metrics.jsonl could not be written."""

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return [bool(run.logger and run.logger.fault)]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        if sums[0]:
            fault = run.process.broadcast_object(run.logger and run.logger.fault)
            raise run.checkpointer.stopped(fault, progress.step)


def intact(run: Run) -> str:
    """What is saved from before a stop: the checkpoint written last, if any."""
    kept = run.checkpointer.kept
    return f"{kept[0]} holds step {kept[1]}, before it" if kept else "no checkpoint before it"


def check_count(run: Run) -> None:
    """Before training: the task counts loss terms in the first global batch (every target masked
    would make each step's mean 0 / 0; a later batch with none stops at the next check)."""
    inputs, targets, _ = next(run.data.train_batches(1))
    count = global_count([run.task.count(inputs, targets)], run.process)  # one process: 0 refused
    if int(count) == 0:
        raise nothing_counted("the first training batch")
