"""The training loop and the evaluation: the same code for every parallel mode."""

from __future__ import annotations

import copy
import logging
import os
import random
import resource
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, islice
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from hydra.errors import CompactHydraException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from src import checkpoint
from src.checkpoint import Best
from src.data import MNISTData
from src.distributed import Process, unwrap
from src.errors import UserError
from src.logger import MetricsLogger

log = logging.getLogger(__name__)


PRECISIONS = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}  # autocast's dtype
MONITORS = ("val/acc", "val/loss")  # what each validation measures
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's default random generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic(on: bool) -> None:
    """Deterministic kernels only (an error where none exists), on CPU and CUDA; or the defaults.

    Set for every job, so one job of a sweep does not leave it on for the next.
    """
    if on:
        # cuBLAS needs a fixed workspace to be deterministic; it reads this before its first call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Only when it changes: the call imports torch._inductor (1.4 s here) even to switch it off.
    if torch.are_deterministic_algorithms_enabled() != on:
        torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.benchmark = False


def check_config(cfg: DictConfig) -> None:
    """Stop on values the config's types allow but training cannot use, before any work."""
    rules = [
        ("trainer.epochs", cfg.trainer.epochs >= 1, "at least 1"),
        ("trainer.max_steps", cfg.trainer.max_steps is None or cfg.trainer.max_steps >= 1,
         "null or at least 1"),
        ("trainer.log_every_n_steps", cfg.trainer.log_every_n_steps >= 1, "at least 1"),
        ("data.subset", cfg.data.get("subset") is None or cfg.data.subset >= 1,
         "null or at least 1"),
        ("scheduler.interval", cfg.scheduler.get("interval") in ("epoch", "step"),
         "epoch or step"),
        ("trainer.precision", str(cfg.trainer.precision) in PRECISIONS, "32, bf16 or 16"),
        ("trainer.compile", cfg.trainer.compile in (True, False, *COMPILE_MODES),
         f"true, false or a mode: {', '.join(COMPILE_MODES)}"),
        ("trainer.profile", cfg.trainer.profile is None or cfg.trainer.profile >= 1,
         "null or at least 1"),
        ("trainer.warmup_steps", cfg.trainer.warmup_steps >= 0, "0 or more"),
        ("checkpoint.every_n_steps",
         cfg.checkpoint.every_n_steps is None or cfg.checkpoint.every_n_steps >= 1,
         "null or at least 1"),
        ("data.val_size", cfg.data.get("val_size", 0) >= 0, "0 (none) or more"),
        ("checkpoint.monitor", cfg.checkpoint.monitor in MONITORS, " or ".join(MONITORS)),
        ("checkpoint.mode", cfg.checkpoint.mode in ("max", "min"), "max or min"),
        ("trainer.test_weights", cfg.trainer.test_weights in ("best", "last"), "best or last"),
        ("trainer.early_stopping_patience",
         cfg.trainer.early_stopping_patience is None or cfg.trainer.early_stopping_patience >= 1,
         "null or at least 1"),
    ]  # fmt: skip
    for key, good, allowed in rules:
        if not good:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} is not allowed: use {allowed}.")
    selects = cfg.train and cfg.data.get("val_size", 0) > 0
    if cfg.trainer.early_stopping_patience is not None and not selects:
        raise UserError(
            "trainer.early_stopping_patience watches the validation split, and data.val_size=0 "
            "holds none out: set data.val_size (e.g. 5000) or trainer.early_stopping_patience=null."
        )
    if selects and cfg.trainer.test_weights == "best" and not cfg.checkpoint.save:
        raise UserError(
            "trainer.test_weights=best tests the weights of best.pt, which checkpoint.save=false "
            "does not write: set trainer.test_weights=last, or checkpoint.save=true."
        )
    if not cfg.train and cfg.ckpt_path is None:
        raise UserError("train=false evaluates a checkpoint: add ckpt_path=PATH.")
    if cfg.train and cfg.ckpt_path is not None:
        raise UserError(
            "ckpt_path is the checkpoint to evaluate with train=false. To continue training from "
            "it use resume=PATH; to start from its weights, init_from=PATH."
        )


def speed_up(model: nn.Module, trainer: DictConfig) -> nn.Module:
    """The plain model, channels-last and compiled as `trainer` asks; before any DDP wrapper."""
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if trainer.compile:
        model = torch.compile(model, mode=None if trainer.compile is True else trainer.compile)
    return model


def autocast(device: torch.device, precision: Any) -> AbstractContextManager:
    """Mixed precision for `trainer.precision` (bf16 or 16); nothing at all for 32."""
    dtype = PRECISIONS[str(precision)]
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
    return instantiate(spec, optimizer)


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


class Stopped(CompactHydraException):
    """Training stopped on a signal after saving its checkpoint; Hydra prints the message alone."""


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: MNISTData,
    proc: Process,
    cfg: DictConfig,
    logger: MetricsLogger | None,
    run_dir: Path,
    resumed: dict[str, Any] | None = None,
) -> Fitted:
    """Train for `trainer.epochs` epochs (or `trainer.max_steps` steps, or until early stopping),
    validating after each and saving `checkpoints/last.pt`, and `best.pt` when the validation is
    the best so far by `checkpoint.monitor`; continue where the `resumed` checkpoint stood.

    Without a validation split (`data.val_size=0`) nothing is validated or selected. The test
    split is not touched here. `logger` is None on every process but the main one.
    """
    trainer, step_interval = cfg.trainer, cfg.scheduler.interval == "step"
    last_pt, best_pt = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "best.pt"
    first_epoch, epoch_step, step, metrics = 1, 0, 0, {}
    validates, patience = len(data.val[1]) > 0, trainer.early_stopping_patience
    best = Best(cfg.checkpoint.monitor, cfg.checkpoint.mode) if validates else None
    # float16 gradients underflow without loss scaling; for other precisions the scaler is a no-op.
    scaler = torch.amp.GradScaler(proc.device.type, enabled=str(trainer.precision) == "16")
    layout = torch.channels_last if trainer.channels_last else torch.contiguous_format
    # Plain values for the loop: each read of a DictConfig costs microseconds, at every step.
    precision, max_steps = trainer.precision, trainer.max_steps
    log_every = trainer.log_every_n_steps
    if resumed:
        scaler.load_state_dict(resumed.get("scaler", {}))
        first_epoch, epoch_step, step = resumed["epoch"], resumed["epoch_step"], resumed["step"]
        metrics = resumed["metrics"]
        if validates:
            best = Best.resume(best.monitor, best.mode, resumed.get("best"))
        if epoch_step >= data.steps_per_epoch:  # saved at the end of an epoch
            first_epoch, epoch_step = first_epoch + 1, 0
        log.info("Resuming at epoch %d, after %d of its batches, step %d", first_epoch,
                 epoch_step, step)  # fmt: skip
    if step == max_steps or first_epoch > trainer.epochs or stops_early(best, patience):
        log.info("Nothing left to train: the checkpoint is at the end of this run.")
        ended_in = first_epoch if epoch_step else first_epoch - 1  # saved mid-epoch, or after it
        return Fitted(ended_in, step, best)

    def save(epoch: int, epoch_step: int, path: Path = last_pt) -> None:  # as training stands now
        if cfg.checkpoint.save:
            checkpoint.save(
                path, proc, model=model, optimizer=optimizer, scheduler=scheduler, epoch=epoch,
                epoch_step=epoch_step, step=step, best=best, cfg=cfg, metrics=metrics,
                wandb_id=logger.run_id if logger else None, scaler=scaler,
            )  # fmt: skip

    def stop_now() -> NoReturn:
        if not proc.is_main:
            sys.exit(1)  # quietly: rank 0 tells the user
        if not cfg.checkpoint.save:
            raise Stopped(f"Stopped by a signal after step {step} (checkpoint.save=false).")
        raise Stopped(
            f"Stopped by a signal after step {step}; {last_pt} is saved. "
            f"Run the same command with hydra.run.dir={run_dir} to resume."
        )

    def train_step(images: torch.Tensor, labels: torch.Tensor, global_size: int) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast(proc.device, precision):
            logits = model(images.contiguous(memory_format=layout))
            loss = train_loss(logits, labels, global_size, proc.world_size)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    if trainer.warmup_steps:
        seconds = warm_up(train_step, model, optimizer, scaler, data, proc, trainer)
        log.info("Warm-up (compilation, autotuning; its steps undone): %.2f s", seconds)
        if logger:
            logger.log({"step": step, "time/warmup_s": seconds})

    every, stop, train_seconds = cfg.checkpoint.every_n_steps, False, 0.0
    with StopSignals() as signals, profiler(trainer.profile, run_dir, proc) as profile:
        for epoch in range(first_epoch, trainer.epochs + 1):
            model.train()
            skip = epoch_step if epoch == first_epoch else 0  # batches done before a resume
            epoch_step = skip
            started, images_seen = time.perf_counter(), 0
            bar = tqdm(
                initial=skip,
                total=data.steps_per_epoch,
                desc=f"epoch {epoch}",
                leave=False,
                disable=not (proc.is_main and sys.stdout.isatty()),
            )
            for images, labels, global_size in data.train_batches(epoch, skip):
                loss = train_step(images, labels, global_size)
                lr = optimizer.param_groups[0]["lr"]  # the rate this step used
                if step_interval:
                    scheduler.step()
                step, epoch_step, images_seen = step + 1, epoch_step + 1, images_seen + global_size
                bar.update()
                if profile:
                    profile.step()
                if step % log_every == 0:
                    # The mean over the global batch: the ranks' scaled losses average to it.
                    # The same reduction tells every rank whether any was asked to stop.
                    loss_sum, stop = proc.sum_over_ranks([loss.item(), bool(signals.received)])
                    if logger:
                        logger.log(
                            {
                                "step": step,
                                "epoch": epoch,
                                "train/loss": loss_sum / proc.world_size,
                                "lr": lr,
                            }
                        )
                elif proc.world_size == 1:  # no other rank to agree with: stop after this step
                    stop = bool(signals.received)
                if step == max_steps:
                    break
                if epoch_step < data.steps_per_epoch:  # else the epoch's end saves (and stops)
                    if stop:
                        save(epoch, epoch_step)
                        stop_now()
                    if every and step % every == 0:
                        save(epoch, epoch_step)
            bar.close()
            speed = throughput(started, images_seen, proc.device)
            train_seconds += speed["time/train_s"]
            if not step_interval and epoch_step == data.steps_per_epoch:
                scheduler.step()

            if validates:
                metrics = evaluate_and_log(model, data, "val", proc, logger, trainer,
                                           {"step": step, "epoch": epoch},
                                           f"epoch {epoch}, step {step}")  # fmt: skip
            log.info("epoch %d trained in %.2f s (%.0f images/s); %.2f s in all", epoch,
                     speed["time/train_s"], speed["time/images_per_s"], train_seconds)  # fmt: skip
            if logger:
                logger.log({"step": step, "epoch": epoch, **speed})
            if validates and best.update(metrics, epoch):
                # best.pt first: a kill between the two writes leaves last.pt behind it, and the
                # resumed run redoes this epoch and writes the same best.pt again.
                save(epoch, epoch_step, best_pt)
                if cfg.checkpoint.save:
                    checkpoint.copy(best_pt, last_pt, proc)
            else:
                save(epoch, epoch_step)
            if stop:
                stop_now()
            if step == max_steps:
                log.info("Stopped after trainer.max_steps=%d optimizer steps", step)
                break
            if stops_early(best, patience):
                log.info(
                    "Early stopping: %s has not improved for %d validations; the best, %.4f, "
                    "was at epoch %d.", best.monitor, best.stale, best.value, best.epoch,
                )  # fmt: skip
                break
    return Fitted(epoch, step, best)


class Fitted(NamedTuple):
    """Where training ended, and its best validation (None without a validation split)."""

    epoch: int
    step: int
    best: Best | None


def stops_early(best: Best | None, patience: int | None) -> bool:
    """`trainer.early_stopping_patience` validations in a row without a new best."""
    return best is not None and patience is not None and best.stale >= patience


def warm_up(
    train_step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    data: MNISTData,
    proc: Process,
    trainer: DictConfig,
) -> float:
    """`trainer.warmup_steps=N`: train N steps on the first batches of an epoch and one on its last
    (often smaller) batch, evaluate once, then undo it all: the weights, the optimizer, the scaler
    and the random generators are put back as they were, so training goes on exactly as without
    it. What stays is what is slow the first time: torch.compile's compilation (once per batch
    shape), cuDNN's autotuning, CUDA graph capture, the allocator's pools. Returns its seconds.
    """
    started = time.perf_counter()
    saved = copy.deepcopy((unwrap(model).state_dict(), optimizer.state_dict(), scaler.state_dict()))
    generators = checkpoint.rng_state()
    steps = min(trainer.warmup_steps, data.steps_per_epoch)
    model.train()
    batches = islice(data.train_batches(1), steps)
    if steps < data.steps_per_epoch:
        batches = chain(batches, data.train_batches(1, skip=data.steps_per_epoch - 1))
    for images, labels, global_size in batches:
        train_step(images, labels, global_size)
    evaluate(model, data, "val" if len(data.val[1]) else "test", proc, trainer)  # thrown away
    unwrap(model).load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    checkpoint.set_rng_state(generators)
    if proc.device.type == "cuda":
        torch.cuda.synchronize(proc.device)
    return time.perf_counter() - started


def profiler(steps: int | None, run_dir: Path, proc: Process) -> AbstractContextManager:
    """`trainer.profile=N`: a torch.profiler trace of N training steps (after one to warm up),
    one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto."""
    if not steps:
        return nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if proc.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir / "profile"), f"rank{proc.rank}"),
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


def evaluate_and_log(
    model: nn.Module,
    data: MNISTData,
    split: str,
    proc: Process,
    logger: MetricsLogger | None,
    trainer: DictConfig,
    record: dict[str, Any],
    about: str,
) -> dict[str, Any]:
    """Evaluate on `split` (val or test); print the result after `about` (where training stands,
    which weights), and log it with `record` (its step, epoch, ...)."""
    metrics = evaluate(model, data, split, proc, trainer)
    log.info("%s: %s loss %.4f, %s accuracy %.4f", about, split, metrics[f"{split}/loss"], split,
             metrics[f"{split}/acc"])  # fmt: skip
    if logger:
        logger.log({**record, **metrics})
    return metrics


def test(
    model: nn.Module,
    data: MNISTData,
    proc: Process,
    logger: MetricsLogger | None,
    trainer: DictConfig,
    fitted: Fitted,
    run_dir: Path,
) -> dict[str, Any]:
    """The test split, once, after training: on best.pt's weights (`trainer.test_weights=best`,
    where a validation picked them), else on the weights training ended with."""
    epoch, step, best = fitted
    weights, weights_epoch = f"the weights after epoch {epoch} (step {step})", epoch
    if best and best.epoch is not None and trainer.test_weights == "best":
        checkpoint.load_best(model, run_dir, proc)
        weights = f"best.pt, the weights of epoch {best.epoch} ({best.monitor} {best.value:.4f})"
        weights_epoch = best.epoch
    record = {"step": step, "epoch": epoch, "test/weights_epoch": weights_epoch}
    about = f"Test on {weights}"
    metrics = evaluate_and_log(model, data, "test", proc, logger, trainer, record, about)
    if logger:
        chosen = {f"best/{best.monitor}": best.value, "best/epoch": best.epoch} if best else {}
        logger.summary({**metrics, **chosen, "test/weights_epoch": weights_epoch})
    return metrics


def train_loss(
    logits: torch.Tensor, labels: torch.Tensor, global_size: int, world_size: int
) -> torch.Tensor:
    """Cross-entropy scaled so that DDP's gradient equals the mean over the whole global batch.

    Each rank sums its samples' losses and multiplies by world_size / global_size; DDP divides the
    sum of the ranks' gradients by world_size, which leaves the gradient of the mean loss over the
    global batch. With equal shares (always in one process) that is each rank's plain mean, one
    operation fewer per step; the scaled sum keeps it exact when a last batch splits unevenly.
    """
    if len(labels) * world_size == global_size:
        return F.cross_entropy(logits, labels)
    return F.cross_entropy(logits, labels, reduction="sum") * (world_size / global_size)


@torch.inference_mode()
def evaluate(
    model: nn.Module, data: MNISTData, split: str, proc: Process, trainer: DictConfig | None = None
) -> dict[str, Any]:
    """Loss and accuracy over the whole `split` (val or test), each image counted once across
    ranks, with the precision and memory layout of `trainer` (if given)."""
    # Under DDP each rank evaluates its share with the model inside: DDP's forward may broadcast
    # buffers, a collective that ranks with different numbers of batches would hang in.
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    layout = torch.channels_last if trainer and trainer.channels_last else torch.contiguous_format
    precision = trainer.precision if trainer else "32"
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for images, labels in data.eval_batches(split):
        with autocast(proc.device, precision):
            logits = model(images.contiguous(memory_format=layout)).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="none").cpu().double().sum().item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        count += len(labels)
    loss_sum, correct, count = proc.sum_over_ranks([loss_sum, correct, count])
    return {
        f"{split}/loss": loss_sum / count,
        f"{split}/acc": correct / count,
        f"{split}/correct": int(correct),
    }
