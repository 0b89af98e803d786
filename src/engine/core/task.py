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

import re
from typing import Any, Protocol

import torch
from torch import Tensor

from src.engine.errors import UserError, first_line

CONTRACT = ("count", "loss", "sums", "metrics")  # what every task has (below); build_task checks


class Task(Protocol):
    """The contract above, as a type: what the engine calls on `settings.task`."""

    modes: dict[str, str]

    def count(self, inputs: Tensor, targets: Tensor) -> int | Tensor: ...

    def loss(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> Tensor: ...

    def sums(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> dict[str, Any]: ...

    def metrics(self, sums: dict[str, float]) -> dict[str, float]: ...


# What PyTorch says when a layer does not fit its input (mat1 and mat2 shapes cannot be multiplied,
# expected input[2, 1, 28, 28] to have 3 channels, an embedding's index out of range, ...).
MISFIT = re.compile(
    r"shape|size|dimension|channels|expected (\d+D )?input|out of range|scalar type|dtype", re.I
)


def preflight(model: torch.nn.Module, data: Any, task: Task, name: str | None) -> None:
    """Before any training, on two training samples: the model takes the data's samples, and
    the task takes the model's outputs and the data's targets. One sentence where either does
    not, on every rank at once (each checks the same samples), before anything is written."""
    if empty := {n: tuple(p.shape) for n, p in model.named_parameters() if not p.numel()}:
        first = next(iter(empty))
        raise UserError(
            f"model={name} has a layer of size 0 ({first}: {empty[first]}), which learns "
            "nothing: give its size key (hidden, code, ...) a value of 1 or more.",
            every_rank=True,
        )
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
    try:
        if check := getattr(task, "check", None):
            check(outputs, inputs, targets)
        loss = task.loss(outputs, inputs, targets)
    except (AttributeError, TypeError) as err:
        if torch.is_tensor(outputs):  # a bug in the task: its traceback
            raise
        raise UserError(  # the task's own error kept as the cause (HYDRA_FULL_ERROR=1 shows it)
            f"model={name} returns {described(outputs)}, and the task ({type(task).__name__}) "
            f"takes {getattr(task, 'takes', 'one tensor')}: return that alone from the model's "
            "forward, or use a task that takes its output.",
            every_rank=True,
        ) from err
    if not (torch.is_tensor(loss) and loss.ndim == 0):
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise UserError(
            f"The task's loss of a batch is {shape}, not a scalar: return the sum over the "
            "batch's terms (reduction='sum'); the engine divides it by the global count."
        )
    if torch.is_tensor(outputs):
        check_sums(task, outputs, inputs, targets, float(loss))
    check_metrics(task, outputs, inputs, targets)


def described(outputs: Any) -> str:
    """A model's output in words: a tuple's, a list's or a dict's items, each tensor's shape."""

    def one(value: Any) -> str:
        return f"tensor {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__

    if isinstance(outputs, dict):
        return f"a dict ({', '.join(f'{key}: {one(v)}' for key, v in outputs.items())})"
    if isinstance(outputs, (tuple, list)):
        return f"a {type(outputs).__name__} ({', '.join(map(one, outputs))})"
    return "None" if outputs is None else f"a {type(outputs).__name__}"


def place(task: Task, device: torch.device) -> None:
    """The task's own modules (a torchmetrics metric's state) on the model's device."""
    for value in vars(task).values():
        if isinstance(value, torch.nn.Module):
            value.to(device)


def check_sums(task: Task, outputs: Tensor, inputs: Tensor, targets: Tensor, loss: float) -> None:
    """`count` and `loss` add up over samples, as the engine divides the summed loss by the global
    count: two samples' are each one's added (the loss to float32's rounding; a mean is halved)."""
    one = [(outputs[i : i + 1], inputs[i : i + 1], targets[i : i + 1]) for i in (0, 1)]
    counts = [int(task.count(inputs, targets)), *(int(task.count(x, y)) for _, x, y in one)]
    if counts[0] != counts[1] + counts[2]:
        raise UserError(
            f"The task's count(inputs, targets) is {counts[0]} for two training samples and "
            f"{counts[1]} and {counts[2]} for each alone: it must add up, counting the terms the "
            "loss sums over (samples, pixels, unmasked tokens), as the engine divides the summed "
            "loss by the global count (the task contract, src/engine/core/task.py).",
            every_rank=True,
        )
    alone = [float(task.loss(*parts)) for parts in one]
    if abs(loss - sum(alone)) > 1e-3 * sum(map(abs, alone)):
        raise UserError(
            f"The task's loss(outputs, inputs, targets) is {loss:.6g} for two training samples "
            f"and {alone[0]:.6g} and {alone[1]:.6g} for each alone: it must be the sum over the "
            "batch's terms (reduction='sum'), not their mean, as the engine divides it by the "
            "global count (the task contract, src/engine/core/task.py).",
            every_rank=True,
        )


def check_metrics(task: Task, outputs: Tensor, inputs: Tensor, targets: Tensor) -> None:
    """`sums` and `metrics` of two samples, as an evaluation calls them: one sentence for a metric
    object on another device than the model's outputs, or a metric outside the task's `bounds`."""
    try:
        batch = {"count": task.count(inputs, targets), **task.sums(outputs, inputs, targets)}
    except RuntimeError as err:
        if "device" not in str(err):
            raise
        raise UserError(
            f"The task's sums() stopped with: {first_line(err)} The model's outputs are on "
            f"{getattr(outputs, 'device', 'its device')}: make a metric object (torchmetrics) "
            "in the task's __init__, and the engine keeps it on the model's device, or move it "
            "in sums() with .to(outputs.device).",
            every_rank=True,
        ) from None
    sums = {key: float64_sum(value) for key, value in batch.items()}
    bounds = getattr(task, "bounds", None) or {}
    for name, value in task.metrics(sums).items():
        low, high = bounds.get(name, (None, None))
        if low is not None and value < low or high is not None and value > high:
            within = f"{'-∞' if low is None else low} to {'∞' if high is None else high}"
            raise UserError(
                f"The task's metrics(sums) give {name}={value:.6g} for two training samples, "
                f"outside its bounds ({within}): sums() must return each batch's terms summed "
                "over what count() counts, and metrics() divide those sums by sums['count'] (the "
                "task contract, src/engine/core/task.py).",
                every_rank=True,
            )


def float64_sum(value: torch.Tensor | float) -> float:
    """A batch's sum of `value`'s elements, in float64 on the CPU (MPS has no float64)."""
    if not torch.is_tensor(value):
        return float(value)
    return value.detach().cpu().double().sum().item()
