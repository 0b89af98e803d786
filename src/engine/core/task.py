"""The task contract: what a run learns (the loss, the metrics), apart from the engine.

A task is a small object named by `conf/task/*.yaml` (`_target_`); a fork writes its own, in
any importable file. The engine (order, ranks, precision, checkpoints) asks it four things:

    count(inputs, targets) -> int | Tensor
        how many terms the loss sums over in this batch: samples, pixels, unmasked tokens. From
        the batch alone, before the forward, so every rank knows the global batch's count.
    loss(outputs, inputs, targets) -> Tensor
        the sum of those terms, a scalar. The engine divides it by the global batch's count
        (summed over the micro-batches and the ranks), so the gradient is the mean over the
        whole global batch under DDP, FSDP and accumulation, also when the ranks' counts differ.
    sums(outputs, inputs, targets) -> dict[str, Tensor | number]
        evaluation's additive quantities for one batch (a loss sum, the correct predictions).
        The engine sums each one's elements in float64 over the split's batches and the ranks,
        and adds `count`: every sample is counted exactly once, whatever the world size.
    metrics(sums) -> dict[str, float]
        the numbers a split reports (`loss`, `acc`), from those sums; `<split>/` is put before
        each name. Called once per evaluation on every rank, so a metric that is not a sum
        (AUROC, F1 over the whole split) can be a torchmetrics object updated in `sums` and
        computed (over the ranks, by torchmetrics itself) and reset here.

and, where it has them, `modes` (a class attribute: each metric's name, and whether a higher
(`max`) or a lower (`min`) value is better; checked against `checkpoint.monitor` before training,
it sets `checkpoint.mode` where that is null), `check(outputs, inputs, targets)` (a sentence
for targets the task cannot take) and `captions(outputs, targets, class_names)` (what
`predictions.png` writes under each input image; a task without it draws no predictions).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Task(Protocol):
    """The contract above, as a type: what the engine calls on `settings.task`."""

    modes: dict[str, str]

    def count(self, inputs: torch.Tensor, targets: torch.Tensor) -> int | torch.Tensor: ...

    def loss(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor: ...

    def sums(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, Any]: ...

    def metrics(self, sums: dict[str, float]) -> dict[str, float]: ...
