"""The template's two tasks, classification and regression, each a class with the contract of
`src/engine/core/task.py` (`count`, `loss`, `sums`, `metrics`), and the check that a model fits
its task.

A task is named by `conf/task/*.yaml` (`_target_`); a fork writes its own, in any importable file.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

from src.engine.core.task import Task
from src.engine.errors import UserError, first_line, instantiated


class Classification:
    """One class per sample (or per pixel, for N×H×W targets): cross-entropy, and accuracy.

    `label_smoothing` (0 to 1) softens the training loss's targets; the evaluated loss stays the
    plain cross-entropy, so runs with and without it compare on one scale.
    """

    modes = {"loss": "min", "acc": "max"}

    def __init__(self, label_smoothing: float = 0.0):
        if not 0 <= label_smoothing < 1:
            raise UserError(
                f"task.label_smoothing={label_smoothing} is not allowed: use 0 (none) up to "
                "below 1, e.g. 0.1."
            )
        self.label_smoothing = label_smoothing

    def count(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        return targets.numel()

    def loss(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        return F.cross_entropy(
            outputs, targets, reduction="sum", label_smoothing=self.label_smoothing
        )

    def sums(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, Any]:
        outputs = outputs.float()
        return {
            "loss": F.cross_entropy(outputs, targets, reduction="none"),
            "correct": outputs.argmax(dim=1) == targets,
        }

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        count = sums["count"]
        return {"loss": sums["loss"] / count, "acc": sums["correct"] / count,
                "correct": int(sums["correct"])}  # fmt: skip

    def check(self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> None:
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
        self, outputs: torch.Tensor, targets: torch.Tensor, class_names: list[str] | None
    ) -> list[tuple[str, bool]] | None:
        """Under each image, the predicted class, and the true one where it is wrong (in red)."""
        if targets.ndim != 1:
            return None
        names = class_names or [str(i) for i in range(outputs.shape[1])]
        shown = []
        for guess, truth in zip(outputs.argmax(dim=1).tolist(), targets.tolist(), strict=True):
            wrong = guess != truth
            shown.append((names[guess] + (f"\n(true: {names[truth]})" if wrong else ""), wrong))
        return shown


class Regression:
    """Real-valued targets of any shape (a reconstruction, a measurement): the mean squared error
    over every target value, and the mean absolute error. `target=input` learns the (normalised)
    input itself: an autoencoder."""

    modes = {"loss": "min", "mae": "min"}

    def __init__(self, target: str = "target"):
        if target not in ("target", "input"):
            raise UserError(f"task.target={target} is not allowed: use target or input.")
        self.target = target

    def _targets(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return inputs if self.target == "input" else targets

    def count(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        return self._targets(inputs, targets).numel()

    def loss(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        return F.mse_loss(outputs, self._targets(inputs, targets), reduction="sum")

    def sums(
        self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> dict[str, Any]:
        error = outputs.float() - self._targets(inputs, targets).float()
        return {"loss": error.square(), "mae": error.abs()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["loss"] / sums["count"], "mae": sums["mae"] / sums["count"]}

    def check(self, outputs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> None:
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


REQUIRED = ("count", "loss", "sums", "metrics")


def build(config: Any) -> Task:
    """The task `config` (the `task:` node) names, checked to have the contract's methods."""
    task = instantiated("task", config)
    if missing := [name for name in REQUIRED if not callable(getattr(task, name, None))]:
        raise UserError(
            f"task={config.get('_target_')} has no {', '.join(missing)}: a task needs count, "
            "loss, sums and metrics (see src/tasks.py)."
        )
    return task


def modes(task: Task | type) -> dict[str, str] | None:
    """The task's (or its class's) metrics, each with `max` or `min` (None: it does not say)."""
    return dict(getattr(task, "modes", None) or {}) or None


# What PyTorch says when a layer does not fit its input: mat1 and mat2 shapes cannot be
# multiplied, expected input[2, 1, 28, 28] to have 3 channels, size mismatch, an embedding's
# index out of range or float indices, a view's shape invalid for the input's size.
MISFIT = re.compile(
    r"shape|size|dimension|channels|expected (\d+D )?input|out of range|scalar type|dtype", re.I
)


def preflight(model: torch.nn.Module, data: Any, task: Task, name: str | None) -> None:
    """Before any training, on two training samples: the model takes the data's samples, and
    the task takes the model's outputs and the data's targets. One sentence where either does
    not, on every rank at once (each checks the same samples), before anything is written."""
    raw, targets = data.sample("train", 2)
    inputs = data.normalise(raw)
    training = model.training
    model.eval()  # no BatchNorm statistics updated, no dropout drawn
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except (RuntimeError, IndexError, ValueError) as err:
        detail = first_line(err)
        if not MISFIT.search(detail):  # a bug in the model: its traceback, the shapes beside it
            err.add_note(f"(a batch of {tuple(inputs.shape)} {inputs.dtype} inputs, model={name})")
            raise
        remedy = (
            "Make the tensors its forward creates in the input's dtype (dtype=x.dtype), or "
            "train in trainer.precision=32"
            if inputs.dtype == torch.float64 and "dtype" in detail
            else "Give the model the data's shape and dtype (in_channels, image_size, "
            "num_classes or input_shape: null takes the data's)"
        )
        raise UserError(
            f"model={name} cannot take the data's samples: a batch of {tuple(inputs.shape)} "
            f"{inputs.dtype} inputs stopped it with: {detail}. {remedy}."
        ) from None
    finally:
        model.train(training)
    if check := getattr(task, "check", None):
        check(outputs, inputs, targets)
    loss = task.loss(outputs, inputs, targets)
    if not (torch.is_tensor(loss) and loss.ndim == 0):
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise UserError(
            f"The task's loss of a batch is {shape}, not a scalar: return the sum over the "
            "batch's terms (reduction='sum'); the engine divides it by the global count."
        )
