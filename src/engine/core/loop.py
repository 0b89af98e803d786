"""The training loop: `fit` runs the epochs, `train_epoch` one pass over the training batches,
`train_step` one optimizer step as a PyTorch user knows it (zero the gradients, forward, loss,
backward, step) on this rank's share of a global batch. The same code for every parallel mode
(what differs is `run.strategy`'s); the guards and the tools are hooks called at the loop's named
points (src/engine/core/context.py); what is saved and when is the checkpointer's to decide.
SIGTERM and Ctrl-C (pre-emption, torchrun) during training ask it to stop at a step, saving
`last.pt` and printing the command that resumes; outside it they interrupt, telling what is kept
(src/engine/guards.py)."""

import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from src.engine.core.context import Parts, Progress, Run
from src.engine.core.evaluate import Fitted, evaluate_and_log
from src.engine.errors import Stopped, UserError
from src.engine.parallel import Process, full

log = logging.getLogger(__name__)


def fit(run: Run, parts: Parts, progress: Progress) -> Fitted:
    """Train from where `progress` stands for `trainer.epochs` (or `max_steps`, or until early
    stopping), validating (where a split is held out) and saving after each epoch; no test."""
    hooks = run.hooks
    if why := why_finished(progress, run):
        log.info("Nothing left to train: the checkpoint is at the end of this run (%s).", why)
        return Fitted(progress.ended_in, progress.step, progress.best)
    with hooks.active(run, parts, progress), handling(hooks.received, *STOP_SIGNALS):
        while not (why := why_finished(progress, run)):
            hooks.call("epoch_started", run, progress)
            train_epoch(run, parts, progress)
            hooks.call("epoch_ended", run, parts, progress)
            hooks.check(run, progress, weights=parts.model)  # nothing bad is validated or saved
            if run.settings.validates:
                val = evaluate_and_log(run, parts.model, "val", progress.record, progress.about)
                progress.metrics = val
            hooks.check(run, progress)  # metrics.jsonl took those lines: checked before a save
            best = progress.best  # None without a validation split
            improved = bool(best and best.update(progress.metrics, progress.epoch))
            run.checkpointer.epoch_done(progress.step, improved)
            if hooks.stopping(run):  # a signal
                stop(run, progress)
            if progress.epoch_step == run.data.steps_per_epoch:
                progress.epoch, progress.epoch_step = progress.epoch + 1, 0
    log.info("Training ended: %s.", why)
    return Fitted(progress.ended_in, progress.step, progress.best)


def why_finished(progress: Progress, run: Run) -> str:
    """Why training is over (all epochs done, `max_steps` reached, stopped early), or "" if not."""
    trainer, best, patience = run.trainer, progress.best, run.trainer.early_stopping_patience
    if progress.stopped:
        return progress.stopped
    if (steps := trainer.max_steps) is not None and progress.step >= steps:
        return f"trainer.max_steps={steps} reached: {progress.step} optimizer steps done"
    if best is not None and patience is not None and best.stale >= patience:
        return (
            f"early stopping: {best.monitor} has not improved for {best.stale} validations; the "
            f"best, {best.value:.4f}, was at epoch {best.epoch}"
        )
    return f"{progress.epoch - 1} epoch(s) done" if progress.epoch > trainer.epochs else ""


def train_epoch(run: Run, parts: Parts, progress: Progress) -> None:
    """One pass over what is left of the training batches, up to `max_steps` or a stop signal."""
    trainer, data, hooks = run.trainer, run.data, run.hooks
    parts.model.train()
    for batch in data.train_batches(progress.epoch, progress.epoch_step):
        logs = (progress.step + 1) % trainer.log_every_n_steps == 0
        loss, grad_norm = train_step(run, parts, batch, measure_norm=logs)
        lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step used
        parts.schedule.after(step=True)
        progress.step, progress.epoch_step = progress.step + 1, progress.epoch_step + 1
        hooks.call("after_step", run, parts, progress, loss)
        if logs:  # the ranks agree on the loss (and on the guards' checks), and it is logged
            mean = hooks.check(run, progress, loss.item())
            if run.logger:
                norm = {} if grad_norm is None else {"train/grad_norm": grad_norm.item()}
                run.logger.log({**progress.record, "train/loss": mean, "lr": lr, **norm})
        if progress.step == trainer.max_steps or progress.epoch_step == data.steps_per_epoch:
            break  # the epoch's end validates and saves
        if progress.stopped:  # a callback's: the epoch's end validates and saves, then it ends
            break
        if hooks.stopping(run):  # a signal
            save(run, parts, progress)
            stop(run, progress)
        if run.checkpointer.due(progress.step):
            save(run, parts, progress)
    if progress.epoch_step == data.steps_per_epoch:
        parts.schedule.after(step=False)


def save(run: Run, parts: Parts, progress: Progress) -> None:
    """`last.pt` now, once the ranks agree that the losses and the weights are sound."""
    run.hooks.check(run, progress, weights=parts.model)
    run.checkpointer.save(progress.step)


# A global batch as the data gives it: this rank's inputs and targets, and the global batch's size.
Batch = tuple[torch.Tensor, torch.Tensor, int]


def train_step(
    run: Run, parts: Parts, batch: Batch, measure_norm: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on this rank's share of a global batch, in `accumulate_grad_batches`
    micro-batches, each one's sum of terms divided by the global count per rank (count / ranks):
    the gradients add up, DDP averages the ranks', and the mean over the global batch is left,
    however its terms fall. Returns this rank's part and the gradients' norm if clipped or asked."""
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    task, process, trainer, strategy = run.task, run.process, run.trainer, run.strategy
    inputs, targets, global_size = batch
    optimizer.zero_grad(set_to_none=True)
    # From global values, so every rank runs as many forwards (SyncBatchNorm meets in each).
    micro = max(1, min(trainer.accumulate_grad_batches, global_size // process.world_size))
    pieces = [(inputs, targets)]  # one micro-batch is not split: host time is a small step's cost
    if micro > 1:
        pieces = list(zip(inputs.tensor_split(micro), targets.tensor_split(micro), strict=True))
    count = global_count([task.count(x, y) for x, y in pieces], process)
    # In the weights' dtype: an int64 count divided by 3 would be a float32 2.6666667 in float64.
    per_rank = (count.to(trainer.dtype) if torch.is_tensor(count) else count) / process.world_size
    losses = []
    for i, (x, y) in enumerate(pieces):
        # The ranks reduce in the backward of the last micro-batch only, the sum of them all.
        with strategy.no_sync(model) if i < len(pieces) - 1 else nullcontext():
            with run.autocast():
                loss = task.loss(model(x), x, y) / per_rank
            scaler.scale(loss).backward()
        losses.append(loss.detach())
    grad_norm = None
    if trainer.gradient_clip_val is not None or measure_norm:
        scaler.unscale_(optimizer)  # the true gradients (float16's scaler multiplied them)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = full(nn.utils.get_total_norm(grads))  # of all the shards
        if trainer.gradient_clip_val is not None:
            nn.utils.clip_grads_with_norm_(model.parameters(), trainer.gradient_clip_val, grad_norm)
    scaler.step(optimizer)  # float16: skipped when a gradient is not finite, then a lower scale
    scaler.update()
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum(), grad_norm


def global_count(counts: list[int | torch.Tensor], process: Process) -> int | torch.Tensor:
    """The global batch's count of loss terms from this rank's micro-batches' `counts`, summed over
    the ranks in one all-reduce the host does not wait for; one process's may not be 0."""
    total = sum(counts)
    if process.in_group:
        if not torch.is_tensor(total):  # filled in on the device by a kernel, not copied
            total = torch.full((), total, dtype=torch.int64, device=process.device)
        dist.all_reduce(total)
    elif isinstance(total, int) and total == 0:
        raise nothing_counted("a training batch")
    return total


def nothing_counted(batch: str) -> UserError:
    return UserError(
        f"The task counts no loss terms in {batch} (every target masked?): the loss's mean over "
        "it is undefined. Check the task's count and the data."
    )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop(run: Run, progress: Progress) -> NoReturn:
    """End training at a signal, `last.pt` saved, with the command that resumes it (rank 0 tells
    it)."""
    saver, when = run.checkpointer, f"after step {progress.step}"
    if not saver.policy.save:
        raise interrupted(run.process, f"{when} (checkpoint.save=false)")
    resume = f"Run the same command with hydra.run.dir={saver.run_dir} to resume"
    raise interrupted(run.process, f"{when}; {saver.last} is saved. {resume}")


@contextmanager
def handling(handler: Callable[[int, Any], None], *signums: int) -> Iterator[None]:
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def interrupted(process: Process, when: str) -> Stopped:
    """The sentence for a signal (`when`: where the run was, and what is kept); quiet off rank 0."""
    if not process.is_main:
        sys.exit(1)  # quietly: rank 0 tells the user
    return Stopped(f"Stopped by a signal {when}.")
