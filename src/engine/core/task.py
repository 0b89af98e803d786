"""The task contract: what a run learns (the loss, the metrics), apart from the engine.

A task is a small object named by `conf/task/*.yaml` (`_target_`); a fork writes its own, in
any importable file. The engine (order, ranks, precision, checkpoints) asks it four things:

    count(inputs, targets) -> int | Tensor
        how many terms the loss sums over in this batch (samples, pixels, unmasked tokens), from
        the batch alone, before the forward, so every rank knows the global batch's count.
    loss(outputs, inputs, targets) -> Tensor
        the sum of those terms, a scalar. The engine divides it by the global batch's count
        (over the micro-batches and the ranks): the gradient is the whole global batch's mean
        under DDP, FSDP and accumulation, also when the ranks' counts differ.
    sums(outputs, inputs, targets) -> dict[str, Tensor | number]
        evaluation's additive quantities for one batch (a loss sum, the correct predictions).
        The engine sums each one's elements in float64 over the split's batches and the ranks,
        and adds `count`: every sample is counted exactly once, whatever the world size.
    metrics(sums) -> dict[str, float]
        the numbers a split reports (`loss`, `acc`), from those sums; `<split>/` is put before
        each name. Called once per evaluation on every rank, so a metric that is not a sum
        (AUROC, F1 over the whole split) can be a torchmetrics object made in `__init__` (the
        engine moves it to the model's device), updated in `sums`, computed (over the ranks, by
        torchmetrics itself) and reset here.

and, where it has them: `modes` (a class attribute: each metric's name, and whether a higher
(`max`) or a lower (`min`) value is better; checked against `checkpoint.monitor` before training,
it sets `checkpoint.mode` where that is null), `bounds` (a class attribute: each metric's lowest
and highest value, None for no bound; two samples' metrics are checked against them before
training, so that an accuracy above 1 shows a broken contract), `takes` (a class attribute: what
the model's forward must return for it, in words, said to a model that returns a tuple or a dict
the task cannot take; "one tensor" without it), `check(outputs, inputs, targets)`
(a sentence for targets the task cannot take) and `captions(outputs, targets, class_names)`
(what `predictions.png` writes under each input image; a task without it draws no predictions)."""

from typing import Any, Protocol

import torch
from torch import Tensor

CONTRACT = ("count", "loss", "sums", "metrics")  # what every task has (below); build_task checks


class Task(Protocol):
    """The contract above, as a type: what the engine calls on `settings.task`."""

    modes: dict[str, str]

    def count(self, inputs: Tensor, targets: Tensor) -> int | Tensor: ...

    def loss(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> Tensor: ...

    def sums(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> dict[str, Any]: ...

    def metrics(self, sums: dict[str, float]) -> dict[str, float]: ...


def place(task: Task, device: torch.device) -> None:
    """The task's own modules (a torchmetrics metric's state) on the model's device."""
    for value in vars(task).values():
        if isinstance(value, torch.nn.Module):
            value.to(device)


def float64_sum(value: torch.Tensor | float) -> float:
    """A batch's sum of `value`'s elements, in float64 on the CPU (MPS has no float64)."""
    if not torch.is_tensor(value):
        return float(value)
    return value.detach().cpu().double().sum().item()
