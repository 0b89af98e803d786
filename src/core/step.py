"""One optimizer step: the loop a PyTorch user knows (zero the gradients, forward, loss,
backward, step), on this rank's share of a global batch, its loss a mean over the whole of it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from src import fsdp
from src.core.state import Parts, Run
from src.distributed import Process, local_gradients
from src.errors import UserError
from src.settings import Trainer

# A global batch as the data gives it: this rank's inputs and targets, and the global batch's size.
Batch = tuple[torch.Tensor, torch.Tensor, int]


def train_step(
    run: Run, parts: Parts, batch: Batch, measure_norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on this rank's share of a global `batch` of `global_size` samples, in
    `trainer.accumulate_grad_batches` micro-batches of which only the last all-reduces under DDP.

    Each micro-batch's loss is the task's sum over its terms divided by the global batch's count
    of them (the task's `count`, summed over the micro-batches and the ranks) times the number of
    ranks: the micro-batches' gradients add up and DDP averages the ranks', which leaves the
    gradient of the mean over the whole global batch, however unevenly the terms fall.

    Returns this rank's loss (its part of the global batch's mean) and the gradients' global norm
    before clipping, which is measured when `gradient_clip_val` clips or `measure_norm` asks.
    """
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    task, process, trainer = run.task, run.process, run.trainer
    inputs, targets, global_size = batch
    optimizer.zero_grad(set_to_none=True)
    # From global values, so every rank runs as many forwards (SyncBatchNorm meets in each).
    micro = max(1, min(trainer.accumulate_grad_batches, global_size // process.world_size))
    pieces = list(zip(inputs.tensor_split(micro), targets.tensor_split(micro), strict=True))
    count = global_count([task.count(x, y) for x, y in pieces], process)
    # In the weights' dtype: an int64 count divided by 3 would be a float32 2.6666667 in float64.
    per_rank = (count.to(trainer.dtype) if torch.is_tensor(count) else count) / process.world_size
    total = None
    for i, (x, y) in enumerate(pieces):
        last = i == len(pieces) - 1
        # DDP and FSDP reduce in the backward of the last micro-batch only, the sum of them all.
        with local_gradients(model, process, local=not last):
            with autocast(process.device, trainer):
                loss = task.loss(model(laid_out(x, trainer)), x, y) / per_rank
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    grad_norm = None
    if trainer.gradient_clip_val is not None or measure_norm:
        scaler.unscale_(optimizer)  # the true gradients (float16's scaler multiplied them)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = fsdp.full(torch.nn.utils.get_total_norm(grads))  # FSDP: of all the shards
        if trainer.gradient_clip_val is not None:
            torch.nn.utils.clip_grads_with_norm_(
                model.parameters(), trainer.gradient_clip_val, grad_norm
            )
    scaler.step(optimizer)  # float16: skipped when a gradient is not finite, then a lower scale
    scaler.update()
    return total, grad_norm


def global_count(counts: list[int | torch.Tensor], process: Process) -> int | torch.Tensor:
    """The global batch's count of loss terms, from this rank's micro-batches' `counts`: summed
    over the ranks in one all-reduce on the device, which the host does not wait for (a count
    known on the host is filled in by a kernel, not copied). One process: the sum, which may not
    be 0 (a batch with nothing to learn from)."""
    total = sum(counts)
    if process.in_group:
        if not torch.is_tensor(total):
            total = torch.full((), total, dtype=torch.int64, device=process.device)
        dist.all_reduce(total)
    elif isinstance(total, int) and total == 0:
        raise nothing_counted("a training batch")
    return total


def check_count(run: Run) -> None:
    """Before training: the task counts loss terms in the first global batch (a count that is
    always 0, every target masked, would make each step's mean 0 / 0). Later batches with none
    stop the run at the next check of the losses, as any non-finite loss does."""
    inputs, targets, _ = next(run.data.train_batches(1))
    count = global_count([run.task.count(inputs, targets)], run.process)  # one process: 0 refused
    if int(count) == 0:
        raise nothing_counted("the first training batch")


def nothing_counted(batch: str) -> UserError:
    """The one sentence for a `batch` in which the task counts no loss terms."""
    return UserError(
        f"The task counts no loss terms in {batch} (every target masked?): the loss's mean over "
        "it is undefined. Check the task's count and the data."
    )


def laid_out(inputs: torch.Tensor, trainer: Trainer) -> torch.Tensor:
    """Images in the memory layout `trainer.channels_last` asks; other inputs as they are."""
    if inputs.ndim != 4:
        return inputs
    return inputs.contiguous(memory_format=trainer.memory_format)


def autocast(device: torch.device, trainer: Trainer) -> AbstractContextManager:
    """Mixed precision for `trainer.precision` (bf16 or 16); nothing at all for 32."""
    dtype = trainer.autocast_dtype
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
