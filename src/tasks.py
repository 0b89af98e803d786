"""The template's two tasks, classification and regression, each with the contract of
`src/engine/core/task.py`; a fork names its own by `_target_` in `conf/task/*.yaml`."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from src.engine.errors import UserError, refuse


class Classification:
    """One class per sample (or per pixel, for N×H×W targets): cross-entropy, and accuracy.
    `label_smoothing` (0 to 1) softens the training loss's targets only; the evaluated loss stays
    the plain cross-entropy, so runs with and without it compare on one scale."""

    modes = {"loss": "min", "acc": "max"}
    bounds = {"loss": (0, None), "acc": (0, 1)}  # a value outside: the sums broke the contract
    takes = "a tensor of logits (N, classes), or (N, classes, H, W) for N×H×W targets"

    def __init__(self, label_smoothing: float = 0.0):
        if not 0 <= label_smoothing < 1:
            refuse("task.label_smoothing", label_smoothing, "0 (none) up to below 1, e.g. 0.1")
        self.label_smoothing = label_smoothing

    def count(self, inputs: Tensor, targets: Tensor) -> int:
        return targets.numel()

    def loss(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        smoothing = self.label_smoothing
        return F.cross_entropy(outputs, targets, reduction="sum", label_smoothing=smoothing)

    def sums(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> dict[str, Any]:
        outputs = outputs.float()
        loss = F.cross_entropy(outputs, targets, reduction="none")
        return {"loss": loss, "correct": outputs.argmax(dim=1) == targets}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        correct, count = sums["correct"], sums["count"]
        return {"loss": sums["loss"] / count, "acc": correct / count, "correct": int(correct)}

    def check(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> None:
        if targets.is_floating_point() or targets.dtype == torch.bool:
            raise UserError(
                f"task=classification takes class numbers as targets, and the data's are "
                f"{targets.dtype}: for real-valued targets use task=regression (or your own)."
            )
        shape, want = tuple(outputs.shape), (targets.shape[0], "classes", *targets.shape[1:])
        if len(shape) != len(want) or shape[:1] + shape[2:] != want[:1] + want[2:]:
            raise UserError(
                f"task=classification takes one score per class for each target, the classes "
                f"in dimension 1 (as cross_entropy): the model's output is {shape} for targets "
                f"of {tuple(targets.shape)}, so it should be {want}."
            )

    def captions(
        self, outputs: Tensor, targets: Tensor, class_names: list[str] | None
    ) -> list[tuple[str, bool]] | None:
        """Under each image, the predicted class, and the true one where it is wrong (in red)."""
        if targets.ndim != 1:
            return None
        names = class_names or [str(i) for i in range(outputs.shape[1])]
        pairs = zip(outputs.argmax(dim=1).tolist(), targets.tolist(), strict=True)
        return [(names[p] + (f"\n(true: {names[t]})" if p != t else ""), p != t) for p, t in pairs]


class Regression:
    """Real-valued targets of any shape: the mean squared error over every target value, and the
    mean absolute error. `target=input` learns the (normalised) input itself: an autoencoder."""

    modes = {"loss": "min", "mae": "min"}
    bounds = {"loss": (0, None), "mae": (0, None)}
    takes = "a tensor of the targets' shape (the inputs' with task.target=input)"

    def __init__(self, target: str = "target"):
        if target not in ("target", "input"):
            refuse("task.target", target, "target or input")
        self.target = target

    def _targets(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return inputs if self.target == "input" else targets

    def count(self, inputs: Tensor, targets: Tensor) -> int:
        return self._targets(inputs, targets).numel()

    def loss(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        return F.mse_loss(outputs, self._targets(inputs, targets), reduction="sum")

    def sums(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> dict[str, Any]:
        error = outputs.float() - self._targets(inputs, targets).float()
        return {"loss": error.square(), "mae": error.abs()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss"] / sums["count"], "mae": sums["mae"] / sums["count"]}

    def check(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> None:
        targets = self._targets(inputs, targets)
        if not targets.is_floating_point():
            raise UserError(
                f"task=regression learns real values, and the data's targets are "
                f"{targets.dtype}: for class numbers use task=classification, or "
                "task.target=input to learn the inputs themselves."
            )
        if outputs.shape != targets.shape:
            raise UserError(
                f"task=regression compares the model's output with the targets value by value: "
                f"the output is {tuple(outputs.shape)} and the targets {tuple(targets.shape)}."
            )
