"""One optimizer step: the loop a PyTorch user knows (zero the gradients, forward, loss,
backward, step), on this rank's share of a global batch, its loss a mean over the whole of it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from src.engine.core.context import Run
from src.engine.core.state import Parts
from src.engine.errors import UserError
from src.engine.parallel import Process

# A global batch as the data gives it: this rank's inputs and targets, and the global batch's size.
Batch = tuple[torch.Tensor, torch.Tensor, int]


def train_step(
    run: Run, parts: Parts, batch: Batch, measure_norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on this rank's share of a global batch, in `accumulate_grad_batches`
    micro-batches. Each micro-batch's loss is the task's sum over its terms, divided by the
    global batch's count of them times the number of ranks: the micro-batches' gradients add up
    and DDP averages the ranks', which leaves the gradient of the mean over the global batch,
    however unevenly the terms fall. Returns this rank's part of that mean and the gradients'
    norm before clipping (when `gradient_clip_val` clips or `measure_norm` asks; else None)."""
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    task, process, trainer, strategy = run.task, run.process, run.trainer, run.strategy
    inputs, targets, global_size = batch
    optimizer.zero_grad(set_to_none=True)
    # From global values, so every rank runs as many forwards (SyncBatchNorm meets in each).
    micro = max(1, min(trainer.accumulate_grad_batches, global_size // process.world_size))
    pieces = list(zip(inputs.tensor_split(micro), targets.tensor_split(micro), strict=True))
    count = global_count([task.count(x, y) for x, y in pieces], process)
    # In the weights' dtype: an int64 count divided by 3 would be a float32 2.6666667 in float64.
    per_rank = (count.to(trainer.dtype) if torch.is_tensor(count) else count) / process.world_size
    losses = []
    for i, (x, y) in enumerate(pieces):
        # The ranks reduce in the backward of the last micro-batch only, the sum of them all.
        with strategy.no_sync(model) if i < len(pieces) - 1 else nullcontext():
            with trainer.autocast(process.device):
                loss = task.loss(model(x), x, y) / per_rank
            scaler.scale(loss).backward()
        losses.append(loss.detach())
    grad_norm = None
    if trainer.gradient_clip_val is not None or measure_norm:
        scaler.unscale_(optimizer)  # the true gradients (float16's scaler multiplied them)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = strategy.full(nn.utils.get_total_norm(grads))  # of all the shards
        if trainer.gradient_clip_val is not None:
            nn.utils.clip_grads_with_norm_(model.parameters(), trainer.gradient_clip_val, grad_norm)
    scaler.step(optimizer)  # float16: skipped when a gradient is not finite, then a lower scale
    scaler.update()
    return sum(losses), grad_norm


def global_count(counts: list[int | torch.Tensor], process: Process) -> int | torch.Tensor:
    """The global batch's count of loss terms, from this rank's micro-batches' `counts`: summed
    over the ranks in one all-reduce on the device, which the host does not wait for. One
    process: the sum, which may not be 0 (a batch with nothing to learn from)."""
    total = sum(counts)
    if process.in_group:
        if not torch.is_tensor(total):  # filled in on the device by a kernel, not copied
            total = torch.full((), total, dtype=torch.int64, device=process.device)
        dist.all_reduce(total)
    elif isinstance(total, int) and total == 0:
        raise nothing_counted("a training batch")
    return total


def nothing_counted(batch: str) -> UserError:
    """The one sentence for a `batch` in which the task counts no loss terms."""
    return UserError(
        f"The task counts no loss terms in {batch} (every target masked?): the loss's mean over "
        "it is undefined. Check the task's count and the data."
    )
