"""What stops a run before it goes wrong, each plugged into the loop as a hook where it watches
training.

The checks stop every rank at once, before anything bad is validated or saved: a NaN or infinite
loss or weight, and metrics.jsonl refused by the storage; before training, the task contract's
(src/engine/core/task.py) on two samples (`preflight`). The losses stay on the device until a
check (each logging step, evaluation or save), where one all-reduce tells every rank.

The drift guard: DDP's ranks train one model, checked (one collective each) rather than assumed.
A model built differently on one rank, other checkpoint or data files on one machine, or a weight
changed outside the optimizer step would make each rank train its own model, unnoticed.

Signals: during training the loop stops at a step on SIGTERM and Ctrl-C (src/engine/core/loop.py);
outside it they interrupt, telling what is kept (`Interrupts`)."""

from __future__ import annotations

import copy
import hashlib
import re
import signal
import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

import torch
from hydra.errors import CompactHydraException
from torch import Tensor, nn

from src.engine.core.context import Hook, Parts, Progress, Run
from src.engine.core.loop import global_count, handling, interrupted, nothing_counted
from src.engine.core.task import Task, float64_sum
from src.engine.data import Data, labels_of
from src.engine.errors import UserError, first_line
from src.engine.parallel import Process, local, unwrap


class NonFiniteLoss(CompactHydraException):
    """The training loss became NaN or infinite; nothing after it was saved."""


@dataclass(eq=False)
class NonFinite(Hook):
    """Stop every rank at a NaN or infinite loss, or weight before an evaluation or save."""

    # (step, loss) since the last check
    losses: list[tuple[int, Tensor]] = field(default_factory=list)
    first_bad: int | None = None  # this rank's first step with a bad loss

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: Tensor) -> None:
        self.losses.append((progress.step, loss))

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        steps, losses = zip(*self.losses, strict=True) if self.losses else ((), ())
        bad = (~torch.isfinite(torch.stack(losses))).nonzero() if losses else []
        self.first_bad = steps[bad[0].item()] if len(bad) else None
        self.losses = []
        tensors = unwrap(weights).state_dict().values() if weights is not None else []
        checks = [local(t).isfinite().all() for t in tensors if t.is_floating_point()]
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
    check_contract(task, outputs, inputs, targets, float(loss))


def described(outputs: Any) -> str:
    """A model's output in words: a tuple's, a list's or a dict's items, each tensor's shape."""

    def one(value: Any) -> str:
        return f"tensor {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__

    if isinstance(outputs, dict):
        return f"a dict ({', '.join(f'{key}: {one(v)}' for key, v in outputs.items())})"
    if isinstance(outputs, (tuple, list)):
        return f"a {type(outputs).__name__} ({', '.join(map(one, outputs))})"
    return "None" if outputs is None else f"a {type(outputs).__name__}"


def check_contract(task: Task, outputs: Any, inputs: Tensor, targets: Tensor, loss: float) -> None:
    """`count` and `loss` add up over samples (where the model's output is one tensor), as the
    engine divides the summed loss by the global count: two samples' are each one's added (the
    loss to float32's rounding; a mean is halved). Then `sums` and `metrics` of two samples, as an
    evaluation calls them: one sentence for a metric object on another device than the model's
    outputs, or a metric outside the task's `bounds`."""
    if torch.is_tensor(outputs):
        one = [(outputs[i : i + 1], inputs[i : i + 1], targets[i : i + 1]) for i in (0, 1)]
        counts = [int(task.count(inputs, targets)), *(int(task.count(x, y)) for _, x, y in one)]
        if counts[0] != counts[1] + counts[2]:
            raise UserError(
                f"The task's count(inputs, targets) is {counts[0]} for two training samples "
                f"and {counts[1]} and {counts[2]} for each alone: it must add up, counting the "
                "terms the loss sums over (samples, pixels, unmasked tokens), as the engine "
                "divides the summed loss by the global count (the task contract, "
                "src/engine/core/task.py).",
                every_rank=True,
            )
        alone = [float(task.loss(*parts)) for parts in one]
        if abs(loss - sum(alone)) > 1e-3 * sum(map(abs, alone)):
            raise UserError(
                f"The task's loss(outputs, inputs, targets) is {loss:.6g} for two training "
                f"samples and {alone[0]:.6g} and {alone[1]:.6g} for each alone: it must be the "
                "sum over the batch's terms (reduction='sum'), not their mean, as the engine "
                "divides it by the global count (the task contract, src/engine/core/task.py).",
                every_rank=True,
            )
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


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size


class Drifted(CompactHydraException):
    """The DDP ranks' parameters stopped being equal during training."""


def fingerprint(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bits summed as int64 where it lives: exact anywhere, changed by any change."""
    real = (torch.view_as_real(t) if t.is_complex() else t for t in tensors)
    return [t.detach().view(BITS[t.element_size()]).sum(dtype=torch.int64) for t in real]


def digest(tensor: torch.Tensor) -> str:
    """A hash of dtype, shape and elements: unlike `fingerprint`, it tells another order apart."""
    bits = tensor.detach().cpu().contiguous()
    head = f"{bits.dtype} {list(bits.shape)}".encode()
    return hashlib.sha256(head + bits.flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def differing(process: Process, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Each name in `named` whose tensor differs from rank 0's somewhere: the first rank it does."""
    if not process.in_group or not named:
        return {}
    ranks = torch.stack(process.all_gather(torch.stack(fingerprint(t for _, t in named))))
    first = (ranks != ranks[0]).int().argmax(dim=0).tolist()  # per tensor; 0: the same everywhere
    return {name: rank for (name, _), rank in zip(named, first, strict=True) if rank}


def check_start(model: nn.Module, process: Process) -> None:
    """Every rank's state dict is rank 0's, before DDP copies rank 0's over it (hiding drift)."""
    if not process.in_group:
        return
    state = model.state_dict()
    shapes = [f"{name} {list(tensor.shape)}" for name, tensor in state.items()]
    sums = torch.stack(fingerprint(state.values())).tolist() if state else []
    (first_shapes, first_sums), *others = process.all_gather_object((shapes, sums))
    for rank, (their_shapes, their_sums) in enumerate(others, start=1):
        if their_shapes != first_shapes:
            pairs = zip_longest(first_shapes, their_shapes, fillvalue="nothing")
            ours, theirs = next((a, b) for a, b in pairs if a != b)
            raise UserError(
                f"DDP rank {rank} built another model than rank 0 (it has {theirs} where rank 0 "
                f"has {ours}): nothing in the model may depend on the rank or the machine."
            )
        if their_sums != first_sums:
            name = next(n for n, a, b in zip(state, first_sums, their_sums, strict=True) if a != b)
            raise UserError(
                f"DDP rank {rank} starts from other weights than rank 0 ({name} differs). DDP "
                "would copy rank 0's over them and hide whatever made them differ: a seed that "
                "depends on the rank, or a checkpoint (init_from, resume) that differs between "
                "machines. Build the model alike on every rank, from the same checkpoint file."
            )


def check_first_batch(data: Data, process: Process, task: Task) -> None:
    """Before training, epoch 1's first batch: the task counts loss terms in it (every target masked
    would make each step's mean 0 / 0; a later batch with none stops at the next check); in a
    process group, the ranks' shares are disjoint, make it up, read the same targets."""
    inputs, targets, _ = next(data.train_batches(1))
    count = global_count([task.count(inputs, targets)], process)  # one process: 0 refused
    if int(count) == 0:
        raise nothing_counted("the first training batch")
    if not process.in_group:
        return
    sampler = copy.copy(data.sampler)
    sampler.set_epoch(1)
    batch, share = sampler.permutation()[: data.batch_size], next(sampler.index_batches())
    labels = labels_of(data.train)  # None for a dataset that reads them sample by sample only
    read = None if labels is None else digest(labels[batch.to(labels.device)])
    everyone = process.all_gather_object((data.size("train"), share.tolist(), read))
    sizes, shares, reads = zip(*everyone, strict=True)
    if len(set(sizes)) > 1:
        raise UserError(
            f"The DDP ranks hold different training splits ({list(sizes)} images, in rank order): "
            "every machine needs the same data files in data.root."
        )
    taken = [index for indices in shares for index in indices]
    if sorted(taken) != sorted(batch.tolist()):
        twice = sorted({i for i in taken if taken.count(i) > 1})
        missing = sorted(set(batch.tolist()) - set(taken))
        raise UserError(
            f"The DDP ranks' shares of the first global batch overlap (images {twice[:5]} are in "
            f"two shares) or leave images out ({missing[:5]}): each rank must take its own part "
            "of every batch. Check changes to GlobalBatchSampler in src/engine/data.py."
        )
    if rank := next((r for r, theirs in enumerate(reads) if theirs != reads[0]), 0):
        raise UserError(
            f"DDP rank {rank} reads other labels for the first batch than rank 0 does: give every "
            "machine the same data files in data.root."
        )


@dataclass(eq=False)
class DriftGuard(Hook):
    """Stop every rank when a parameter differs from rank 0's: at each check, and every N steps."""

    every: int | str

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: Tensor) -> None:
        if isinstance(self.every, int) and progress.step % self.every == 0:
            self.agreed(run, progress, [], parts.model)

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        named = list(unwrap(weights).named_parameters()) if weights is not None else []
        if drifted := differing(run.process, named):
            name, rank = next(iter(drifted.items()))
            raise Drifted(
                f"Stopped at step {progress.step}: DDP rank {rank}'s {name} differs from rank 0's, "
                "so the ranks no longer train one model, and nothing after it was saved "
                f"({intact(run)}). Some code changes weights outside the optimizer step, on some "
                "ranks only: run python train.py debug=equivalence with this run's overrides to "
                "find it."
            )


@dataclass
class Interrupts(AbstractContextManager):
    """Outside training, SIGTERM interrupts as Ctrl-C does (Python's main thread only gets them),
    and either ends the run with a sentence of where it was (`when`) and what is kept."""

    process: Process
    when: str

    def __enter__(self) -> Interrupts:
        self.handling = nullcontext()
        if threading.current_thread() is threading.main_thread():
            self.handling = handling(signal.default_int_handler, signal.SIGTERM)
        self.handling.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.handling.__exit__(None, None, None)
        if exc_type is KeyboardInterrupt:
            raise interrupted(self.process, self.when) from None
