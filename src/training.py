"""The training loop and the evaluation: the same code for every parallel mode.

Read it top down: `fit` runs the epochs, `train_epoch` one pass over the training batches,
`train_step` one optimizer step, `evaluate` one split. What is saved and when is decided in
`src/checkpoint.py`, the settings are checked in `src/settings.py`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import resource
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, islice
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from src import checkpoint, drift, fsdp
from src.checkpoint import Best, Checkpointer, Parts, Progress
from src.data import Data
from src.distributed import Process, local_gradients, unwrap
from src.errors import Stopped, UserError, first_line, instantiated
from src.logger import MetricsLogger
from src.settings import Settings, Trainer
from src.tasks import Task

log = logging.getLogger(__name__)

# One process draws the bar. tqdm's default lock is a multiprocessing one, for bars of several
# processes on one terminal; in a spawned DDP worker, which ends without the interpreter's
# teardown (launch.exit_worker), it would be reported as a leaked semaphore.
tqdm.set_lock(threading.RLock())


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's default random generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_kernels(trainer: Trainer) -> None:
    """The kernels `trainer` asks for: deterministic ones only (an error where none exists), or
    cuDNN's autotuned fastest; full float32 matmuls, or TF32 (`matmul_precision=high`).

    Set for every job, so one job of a sweep does not leave its choice on for the next.
    """
    if trainer.deterministic:
        # cuBLAS reads this once, at its first call: train.py also sets it at process start.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Only when it changes: the call imports torch._inductor (1.4 s here) even to switch it off.
    if torch.are_deterministic_algorithms_enabled() != trainer.deterministic:
        torch.use_deterministic_algorithms(trainer.deterministic)
    torch.backends.cudnn.benchmark = not trainer.deterministic  # autotuned per input shape
    torch.set_float32_matmul_precision(trainer.matmul_precision)


def compiled(model: nn.Module, trainer: Trainer) -> nn.Module:
    """The model compiled as `trainer.compile` asks: inside a DDP wrapper, around FSDP's."""
    if not trainer.compile:
        return model
    mode = None if trainer.compile is True else trainer.compile
    # CUDA graphs record one graph per batch shape: static shapes, each compiled in the warm-up,
    # rather than a dynamic-shape recompile inside the first timed epoch.
    return torch.compile(model, mode=mode, dynamic=False if mode == "reduce-overhead" else None)


def autocast(device: torch.device, trainer: Trainer | None) -> AbstractContextManager:
    """Mixed precision for `trainer.precision` (bf16 or 16); nothing at all for 32."""
    dtype = trainer and trainer.autocast_dtype
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def build_scheduler(
    cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler of `cfg.scheduler`. Its `interval` is for the loop, not the constructor, and a
    `total_steps: null` is filled with the run's number of optimizer steps."""
    spec = OmegaConf.to_container(cfg.scheduler, resolve=True)
    del spec["interval"]
    if "total_steps" in spec and spec["total_steps"] is None:
        spec["total_steps"] = total_steps
    return instantiated("scheduler", spec, optimizer, values=True)


def check_schedule(cfg: DictConfig, total_steps: int, steps_per_epoch: int) -> None:
    """Step this config's schedule through its whole plan on a stand-in (a one-element parameter
    under the config's optimizer): an error it meets partway (scheduler=step
    scheduler.step_size=0) stops the run before training, in one sentence, not after an epoch.
    About 3 µs a step."""
    stand_in = [torch.zeros(1, requires_grad=True)]
    optimizer = instantiated("optimizer", cfg.optimizer, stand_in, values=True)
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    by_step = cfg.scheduler.interval == "step"
    plan = total_steps if by_step else -(-total_steps // steps_per_epoch)  # its epochs
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        for step in range(1, plan + 1):
            try:
                scheduler.step()
            except Exception as err:  # noqa: BLE001 - whatever its arithmetic meets, told once
                raise UserError(
                    f"scheduler: {cfg.scheduler.get('_target_')} fails at its step {step} of "
                    f"{plan} ({'optimizer steps' if by_step else 'epochs'}) with "
                    f"{type(err).__name__}: {first_line(err)}. Fix the scheduler.* keys (python "
                    "train.py --cfg job shows them).",
                    every_rank=True,
                ) from None


def check_accumulation(trainer: Trainer, batch_size: int, world_size: int) -> None:
    """Each process splits its share of a global batch into `accumulate_grad_batches` parts:
    refuse a split that leaves one empty. (A smaller last batch is split into fewer parts.)"""
    share, parts = batch_size // world_size, trainer.accumulate_grad_batches
    if 0 < share < parts and batch_size % world_size == 0:  # else data.setup tells what is wrong
        raise UserError(
            f"trainer.accumulate_grad_batches={parts} splits each process's share of a batch "
            f"({share} images: data.batch_size={batch_size} over {world_size} processes) into "
            f"{parts} micro-batches, and some would be empty. Use at most {share}, or a larger "
            "data.batch_size.",
            every_rank=True,
        )


class StopSignals:
    """While active, SIGTERM and SIGINT (pre-emption, Ctrl-C, torchrun shutting down) only ask
    training to stop: one process stops after the current step, DDP ranks at the next logging
    step, where they agree on it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def __enter__(self) -> StopSignals:
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *_: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Outside training, SIGTERM interrupts as Ctrl-C does (a KeyboardInterrupt), so that the
    run can say where it stopped (`interrupted`); within it, StopSignals asks training to stop
    at a step. Python handles signals in the main thread only: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(process: Process, when: str) -> Stopped:
    """The sentence for a signal outside training (`when`: where the run was, and what is
    kept); ranks other than 0 end quietly, as at a stop during training."""
    if not process.is_main:
        sys.exit(1)
    return Stopped(f"Stopped by a signal {when}.")


def during_the_test(step: int, checkpointer: Checkpointer) -> str:
    """Where a signal during the test finds a run that trained to `step`, and what is kept."""
    kept = "checkpoint.save=false kept no weights"
    if checkpointer.policy.save:
        kept = f"{checkpointer.run_dir}/checkpoints holds its weights (test one with train=false "
        kept += "ckpt_path=...)"
    return f"after training ended at step {step}, during the test; {kept}"


class NonFiniteLoss(CompactHydraException):
    """The training loss became NaN or infinite; nothing after it was saved."""


class Fitted(NamedTuple):
    """Where training ended, and its best validation (None without a validation split)."""

    epoch: int
    step: int
    best: Best | None


def fit(
    parts: Parts,
    data: Data,
    process: Process,
    settings: Settings,
    checkpointer: Checkpointer,
    logger: MetricsLogger | None,
    run_dir: Path,
    resumed: dict[str, Any] | None = None,
) -> Fitted:
    """Train for `trainer.epochs` epochs (or `trainer.max_steps` steps, or until early stopping),
    validating after each epoch and saving checkpoints; continue where `resumed` stood.

    Without a validation split (`data.val_size=0`) nothing is validated or selected. The test
    split is not touched here. `logger` is None on every process but the main one.
    """
    trainer = settings.trainer
    progress = Progress.start(
        checkpointer.policy, settings.validates, resumed, data.steps_per_epoch
    )
    if why := why_finished(progress, trainer):
        log.info("Nothing left to train: the checkpoint is at the end of this run (%s).", why)
        return Fitted(progress.ended_in, progress.step, progress.best)
    if trainer.warmup_steps:
        warm_up(parts, settings.task, data, process, trainer, logger, progress.step)
    with StopSignals() as signals, profiler(trainer.profile, run_dir, process) as profile:
        watch = Watch(process, trainer, logger, signals, checkpointer, settings.check_sync)
        while not (why := why_finished(progress, trainer)):
            speed = train_epoch(parts, settings.task, data, process, trainer, progress, watch,
                                profile)  # fmt: skip
            watch.check(progress, parts.model)  # nothing non-finite is validated or saved
            if settings.validates:
                progress.metrics = evaluate_and_log(
                    parts.model,
                    settings.task,
                    data,
                    "val",
                    process,
                    logger,
                    trainer,
                    progress.record,
                    progress.about,
                )
            log_speed(speed, progress, logger)
            watch.check(progress)  # metrics.jsonl took those lines: checked before a save
            checkpointer.epoch_done(progress)
            if watch.stop:
                stop_now(process, checkpointer, progress.step)
            if progress.epoch_step == data.steps_per_epoch:
                progress.epoch, progress.epoch_step = progress.epoch + 1, 0
    log.info("Training ended: %s.", why)
    return Fitted(progress.ended_in, progress.step, progress.best)


def why_finished(progress: Progress, trainer: Trainer) -> str:
    """Why training is over (all epochs done, `max_steps` reached, stopped early), or "" if not."""
    if trainer.max_steps is not None and progress.step >= trainer.max_steps:
        return (
            f"trainer.max_steps={trainer.max_steps} reached: {progress.step} optimizer steps done"
        )
    best, patience = progress.best, trainer.early_stopping_patience
    if best is not None and patience is not None and best.stale >= patience:
        return (
            f"early stopping: {best.monitor} has not improved for {best.stale} validations; the "
            f"best, {best.value:.4f}, was at epoch {best.epoch}"
        )
    return f"{trainer.epochs} epoch(s) done" if progress.epoch > trainer.epochs else ""


def train_epoch(
    parts: Parts,
    task: Task,
    data: Data,
    process: Process,
    trainer: Trainer,
    progress: Progress,
    watch: Watch,
    profile: Any,
) -> dict[str, float]:
    """One pass over the training batches (what is left of it, after a resume), or up to
    `max_steps` or a stop signal; returns its speed."""
    parts.model.train()
    if process.device.type == "cuda":  # this epoch's training peak, not an earlier evaluation's
        torch.cuda.reset_peak_memory_stats(process.device)
    started, samples_seen = time.perf_counter(), 0
    bar = tqdm(
        initial=progress.epoch_step,
        total=data.steps_per_epoch,
        leave=False,
        desc=f"epoch {progress.epoch}",
        disable=not (process.is_main and sys.stdout.isatty()),
    )
    for inputs, targets, global_size in data.train_batches(progress.epoch, progress.epoch_step):
        logs = (progress.step + 1) % trainer.log_every_n_steps == 0
        loss, grad_norm = train_step(
            parts, task, inputs, targets, global_size, process, trainer, logs
        )
        lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step used
        if trainer.step_interval:
            parts.scheduler.step()
        progress.step, progress.epoch_step = progress.step + 1, progress.epoch_step + 1
        samples_seen += global_size
        bar.update()
        if profile:
            profile.step()
        watch.step_done(progress, loss, lr, grad_norm)
        if progress.step == trainer.max_steps or progress.epoch_step == data.steps_per_epoch:
            break  # the epoch's end validates and saves
        if watch.stop:
            watch.save(progress)
            stop_now(process, watch.checkpointer, progress.step)
        watch.step_saves(progress, data.steps_per_epoch)
    bar.close()
    if not trainer.step_interval and progress.epoch_step == data.steps_per_epoch:
        parts.scheduler.step()
    return {**throughput(started, samples_seen, process.device), "memory/state_mb": state_mb(parts)}


def train_step(
    parts: Parts,
    task: Task,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    global_size: int,
    process: Process,
    trainer: Trainer,
    measure_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on this rank's share of a global batch of `global_size` samples, in
    `trainer.accumulate_grad_batches` micro-batches of which only the last all-reduces under DDP.

    Each micro-batch's loss is the task's sum over its terms divided by the global batch's count
    of them (the task's `count`, summed over the micro-batches and the ranks) times the number of
    ranks: the micro-batches' gradients add up and DDP averages the ranks', which leaves the
    gradient of the mean over the whole global batch, however unevenly the terms fall.

    Returns this rank's loss (its part of the global batch's mean) and the gradients' global norm
    before clipping, which is measured when `gradient_clip_val` clips or `measure_norm` asks.
    """
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
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


def check_count(task: Task, data: Data, process: Process) -> None:
    """Before training: the task counts loss terms in the first global batch (a count that is
    always 0, every target masked, would make each step's mean 0 / 0). Later batches with none
    stop the run at the next check of the losses, as any non-finite loss does."""
    inputs, targets, _ = next(data.train_batches(1))
    if int(global_count([task.count(inputs, targets)], process)) == 0:  # int: refused in there
        raise nothing_counted("the first training batch")


def nothing_counted(batch: str) -> UserError:
    """The one sentence for a `batch` in which the task counts no loss terms."""
    return UserError(
        f"The task counts no loss terms in {batch} (every target masked?): the loss's mean over "
        "it is undefined. Check the task's count and the data."
    )


def laid_out(inputs: torch.Tensor, trainer: Trainer | None) -> torch.Tensor:
    """Images in the memory layout `trainer.channels_last` asks; other inputs as they are."""
    if trainer is None or inputs.ndim != 4:
        return inputs
    return inputs.contiguous(memory_format=trainer.memory_format)


class Watch:
    """What the loop checks between steps without making the GPU wait at every one.

    The losses stay on the device until a logging step (`trainer.log_every_n_steps`), a save or
    the epoch's end; then one all-reduce gives every rank the global loss, whether any rank's
    loss was not finite since the last check (the run stops, on every rank, before anything is
    saved) and whether any rank received a stop signal. Under DDP, `check_sync` compares the
    ranks' parameters before each validation and save ("eval"), also every N steps (N).
    """

    def __init__(
        self,
        process: Process,
        trainer: Trainer,
        logger: MetricsLogger | None,
        signals: StopSignals,
        checkpointer: Checkpointer,
        check_sync: int | str | None = None,
    ):
        self.process, self.trainer, self.logger, self.signals = process, trainer, logger, signals
        self.checkpointer, self.check_sync = checkpointer, check_sync
        self.losses: list[tuple[int, torch.Tensor]] = []  # (step, loss) since the last check
        self.stop = False

    def step_done(
        self, progress: Progress, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor | None
    ) -> None:
        self.losses.append((progress.step, loss))
        if progress.step % self.trainer.log_every_n_steps == 0:
            mean_loss = self.check(progress)
            if self.logger:
                record = {**progress.record, "train/loss": mean_loss, "lr": lr}
                if grad_norm is not None:
                    record["train/grad_norm"] = grad_norm.item()
                self.logger.log(record)
        elif self.process.world_size == 1:  # no other rank to agree with: stop after this step
            self.stop = bool(self.signals.received)
        if isinstance(self.check_sync, int) and progress.step % self.check_sync == 0:
            self.in_sync(progress, self.checkpointer.parts.model)

    def check(self, progress: Progress, weights: nn.Module | None = None) -> float:
        """Agree with the other ranks on the losses since the last check (and on the `weights`,
        before they are saved or evaluated): stop every rank if one is not finite, or if the
        main process could not write metrics.jsonl. Returns the last step's loss, averaged over
        the ranks."""
        steps, losses = zip(*self.losses, strict=True) if self.losses else ((), ())
        bad = (~torch.isfinite(torch.stack(losses))).nonzero() if losses else []
        first_bad = steps[bad[0].item()] if len(bad) else None
        broken = weights is not None and not finite(unwrap(weights).state_dict().values())
        last = losses[-1].item() if losses else 0.0
        unwritten = self.logger and self.logger.fault
        loss_sum, stop, bad_losses, bad_weights, refused = self.process.sum_over_ranks(
            [last, bool(self.signals.received), first_bad is not None, broken, bool(unwritten)]
        )
        self.losses, self.stop = [], self.stop or bool(stop)
        if refused:
            raise self.checkpointer.stopped(self.process.broadcast_object(unwritten), progress.step)
        if bad_losses:
            first = min(s for s in self.process.all_gather_object(first_bad) if s is not None)
            raise non_finite(f"the training loss was not finite at step {first}", self)
        if bad_weights:
            raise non_finite(f"the weights were not finite after step {progress.step}", self)
        if weights is not None and self.check_sync is not None:
            self.in_sync(progress, weights)
        return loss_sum / self.process.world_size

    def in_sync(self, progress: Progress, weights: nn.Module) -> None:
        """The drift guard: stop every rank if the ranks' parameters are no longer equal."""
        drift.check_in_sync(unwrap(weights), self.process, progress.step, intact(self))

    def save(self, progress: Progress) -> None:
        """`last.pt` now, once the losses and the weights are checked to be finite."""
        self.check(progress, self.checkpointer.parts.model)
        self.checkpointer.save(progress)

    def step_saves(self, progress: Progress, epoch_steps: int) -> None:
        """`checkpoint.every_n_steps`: `last.pt` within an epoch (its end saves anyway)."""
        if self.checkpointer.due(progress, epoch_steps):
            self.save(progress)


def finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point tensor (parameters, and buffers such as BatchNorm's running
    statistics) is free of NaN and infinity; one device sync for them all, not one each. Of a
    sharded tensor, this rank's part (the ranks then agree on the whole)."""
    checks = [fsdp.local(t).isfinite().all() for t in tensors if t.is_floating_point()]
    return not checks or bool(torch.stack(checks).all())


def intact(watch: Watch) -> str:
    """What is saved from before a stop: the checkpoint written last, if any."""
    kept = watch.checkpointer.kept
    return f"{kept[0]} holds step {kept[1]}, before it" if kept else "no checkpoint before it"


def non_finite(what: str, watch: Watch) -> NonFiniteLoss:
    """The one sentence a NaN or an infinity stops the run with."""
    clip = watch.trainer.gradient_clip_val
    tries = ["a lower optimizer.lr"]
    tries.append("trainer.gradient_clip_val=1.0" if clip is None else "a lower gradient_clip_val")
    if watch.trainer.precision != "32":
        tries.append("trainer.precision=32")
    return NonFiniteLoss(
        f"Stopped: {what} (NaN or infinite), and nothing after it was saved ({intact(watch)}). "
        f"Try {', '.join(tries[:-1])} or {tries[-1]}."
    )


def stop_now(process: Process, checkpointer: Checkpointer, step: int) -> NoReturn:
    """End the run after a stop signal, with the command that resumes it."""
    if not process.is_main:
        sys.exit(1)  # quietly: rank 0 tells the user
    if not checkpointer.policy.save:
        raise Stopped(f"Stopped by a signal after step {step} (checkpoint.save=false).")
    raise Stopped(
        f"Stopped by a signal after step {step}; {checkpointer.last} is saved. "
        f"Run the same command with hydra.run.dir={checkpointer.run_dir} to resume."
    )


def warm_up(
    parts: Parts,
    task: Task,
    data: Data,
    process: Process,
    trainer: Trainer,
    logger: MetricsLogger | None,
    step: int,
) -> None:
    """`trainer.warmup_steps=N`: train N steps (at least 2) on the first batches of an epoch and
    two on its last (often smaller) batch, evaluate once, then undo it all: the weights, the
    optimizer, the scaler and the random generators are put back as they were, so training goes
    on exactly as without it. What stays is what is slow the first time: torch.compile's
    compilation (once per batch shape), cuDNN's autotuning, CUDA graph capture (on a shape's
    second run), the allocator's pools. Logs its seconds.
    """
    started = time.perf_counter()
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    saved = copy.deepcopy((unwrap(model).state_dict(), optimizer.state_dict(), scaler.state_dict()))
    generators = checkpoint.rng_state()
    # Each batch shape at least twice: CUDA graph trees run a new graph once, then record it.
    steps, last = min(max(trainer.warmup_steps, 2), data.steps_per_epoch), data.steps_per_epoch - 1
    model.train()
    batches = chain(
        islice(data.train_batches(1), steps),
        data.train_batches(1, skip=last),  # the last batch, often smaller: another shape
        data.train_batches(1, skip=last),
    )
    for inputs, targets, global_size in batches:
        train_step(parts, task, inputs, targets, global_size, process, trainer)
    evaluate(model, task, data, "val" if data.size("val") else "test", process, trainer)  # dropped
    unwrap(model).load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    checkpoint.set_rng_state(generators)
    if process.device.type == "cuda":
        torch.cuda.synchronize(process.device)
    seconds = time.perf_counter() - started
    log.info("Warm-up (compilation, autotuning; its steps undone): %.2f s", seconds)
    if logger:
        logger.log({"step": step, "time/warmup_s": seconds})


def profiler(steps: int | None, run_dir: Path, process: Process) -> AbstractContextManager:
    """`trainer.profile=N`: a torch.profiler trace of N training steps (after one to warm up),
    one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto."""
    if not steps:
        return nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if process.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir / "profile"), f"rank{process.rank}"),
        record_shapes=True,
    )


def throughput(started: float, images: int, device: torch.device) -> dict[str, float]:
    """The epoch's training time and speed (images of all ranks per second), and peak memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    speed = {
        "time/train_s": seconds,
        "time/images_per_s": images / seconds,
        "memory/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        speed["memory/peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return speed


def state_mb(parts: Parts) -> float:
    """MiB of this rank's weights, gradients and optimizer state: the tensors themselves, which
    FSDP shards over the ranks (1/N on each) and every other mode holds whole."""
    parameters = list(parts.model.parameters())
    grads = [p.grad for p in parameters if p.grad is not None]
    moments = [v for s in parts.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = (fsdp.local(t) for t in chain(parameters, grads, moments))
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def log_speed(speed: dict[str, float], progress: Progress, logger: MetricsLogger | None) -> None:
    log.info(
        "epoch %d trained in %.2f s (%.0f images/s), peak memory %.0f MB (weights, gradients and "
        "optimizer state %.1f MB)",
        progress.epoch,
        speed["time/train_s"],
        speed["time/images_per_s"],
        speed.get("memory/peak_cuda_mb", speed["memory/peak_rss_mb"]),
        speed["memory/state_mb"],
    )
    if logger:
        logger.log({**progress.record, **speed})


def evaluate_and_log(
    model: nn.Module,
    task: Task,
    data: Data,
    split: str,
    process: Process,
    logger: MetricsLogger | None,
    trainer: Trainer,
    record: dict[str, Any],
    about: str,
) -> dict[str, Any]:
    """Evaluate on `split` (val or test); print the result after `about` (where training stands,
    which weights), and log it with `record` (its step, epoch, ...)."""
    metrics = evaluate(model, task, data, split, process, trainer)
    shown = ", ".join(
        f"{split} {key.split('/', 1)[1]} {value:.4f}"
        for key, value in metrics.items()
        if isinstance(value, float)
    )
    log.info("%s: %s", about, shown)
    if logger:
        logger.log({**record, **metrics})
    return metrics


def test(
    model: nn.Module,
    task: Task,
    data: Data,
    process: Process,
    logger: MetricsLogger | None,
    trainer: Trainer,
    fitted: Fitted,
    run_dir: Path,
) -> dict[str, Any]:
    """The test split, once, after training: on best.pt's weights (`trainer.test_weights=best`,
    where a validation picked them), else on the weights training ended with."""
    epoch, step, best = fitted
    weights, weights_epoch = f"the weights after epoch {epoch} (step {step})", epoch
    if best and best.epoch is not None and trainer.test_weights == "best":
        checkpoint.load_best(model, run_dir, process)
        weights = f"best.pt, the weights of epoch {best.epoch} ({best.monitor} {best.value:.4f})"
        weights_epoch = best.epoch
    record = {"step": step, "epoch": epoch, "test/weights_epoch": weights_epoch}
    about = f"Test on {weights}"
    metrics = evaluate_and_log(model, task, data, "test", process, logger, trainer, record, about)
    if logger:
        chosen = {f"best/{best.monitor}": best.value, "best/epoch": best.epoch} if best else {}
        logger.summary({**metrics, **chosen, "test/weights_epoch": weights_epoch})
    return metrics


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    task: Task,
    data: Data,
    split: str,
    process: Process,
    trainer: Trainer | None = None,
) -> dict[str, Any]:
    """The task's metrics over the whole `split` (val or test), each sample counted once across
    ranks, with the precision and memory layout of `trainer` (if given).

    The task's sums of each batch are added up in float64 on the CPU, then over the ranks, and
    turned into metrics once: exact, whatever the world size and the batch size.
    """
    # Under DDP each rank evaluates its share with the model inside: DDP's forward may broadcast
    # buffers, a collective that ranks with different numbers of batches would hang in.
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    # Buffers (BatchNorm's running statistics) are updated by each rank's own share of the last
    # step: every rank takes rank 0's, as DDP does before each forward and the checkpoint saves.
    process.broadcast_tensors(model.buffers())
    model.eval()
    sums: dict[str, float] = {}
    # Under FSDP every forward is collective: each rank runs as many as the rank with the most.
    for inputs, targets in data.eval_batches(split, even=process.mode == "fsdp"):
        with autocast(process.device, trainer):
            outputs = model(laid_out(inputs, trainer))
        batch = {"count": task.count(inputs, targets), **task.sums(outputs, inputs, targets)}
        for key, value in batch.items():
            sums[key] = sums.get(key, 0.0) + float64_sum(value)
    if process.in_group:  # a rank with no batch of this split knows none of the sums' names
        names = sorted({n for names in process.all_gather_object(sorted(sums)) for n in names})
        sums = dict(
            zip(names, process.sum_over_ranks([sums.get(n, 0.0) for n in names]), strict=True)
        )
    return {f"{split}/{name}": value for name, value in task.metrics(sums).items()}


def float64_sum(value: torch.Tensor | float) -> float:
    """A batch's sum of `value`'s elements, in float64 on the CPU (MPS has no float64)."""
    if not torch.is_tensor(value):
        return float(value)
    return value.detach().cpu().double().sum().item()
