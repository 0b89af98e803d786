"""The training loop and the evaluation: the same code for every parallel mode."""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from src import checkpoint
from src.data import MNISTData
from src.distributed import Process, unwrap
from src.errors import UserError
from src.logger import MetricsLogger

log = logging.getLogger(__name__)


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
    ]  # fmt: skip
    for key, good, allowed in rules:
        if not good:
            raise UserError(f"{key}={OmegaConf.select(cfg, key)} is not allowed: use {allowed}.")


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


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: MNISTData,
    proc: Process,
    cfg: DictConfig,
    logger: MetricsLogger | None,
    run_dir: Path,
) -> dict[str, float]:
    """Train for `trainer.epochs` epochs (or `trainer.max_steps` steps), evaluating after each
    and saving `checkpoints/last.pt` (and `best.pt`, by test accuracy).

    Returns the last evaluation's metrics. `logger` is None on every process but the main one.
    """
    trainer, step_interval = cfg.trainer, cfg.scheduler.interval == "step"
    last, best = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "best.pt"
    step, metrics, best_acc = 0, {}, -1.0
    for epoch in range(1, trainer.epochs + 1):
        model.train()
        bar = tqdm(
            total=data.steps_per_epoch,
            desc=f"epoch {epoch}",
            leave=False,
            disable=not (proc.is_main and sys.stdout.isatty()),
        )
        for images, labels, global_size in data.train_batches(epoch):
            optimizer.zero_grad(set_to_none=True)
            loss = train_loss(model(images), labels, global_size, proc.world_size)
            loss.backward()
            optimizer.step()
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used
            if step_interval:
                scheduler.step()
            step += 1
            bar.update()
            if step % trainer.log_every_n_steps == 0:
                # The mean over the global batch: the ranks' scaled losses average to it.
                (loss_sum,) = proc.sum_over_ranks([loss.item()])
                if logger:
                    logger.log(
                        {
                            "step": step,
                            "epoch": epoch,
                            "train/loss": loss_sum / proc.world_size,
                            "lr": lr,
                        }
                    )
            if step == trainer.max_steps:
                break
        bar.close()
        if not step_interval:
            scheduler.step()

        # Under DDP each rank evaluates its share with the plain model: DDP's forward may broadcast
        # buffers, a collective that ranks with different numbers of batches would hang in.
        metrics = evaluate(unwrap(model) if proc.mode == "ddp" else model, data, proc)
        log.info(
            "epoch %d, step %d: test loss %.4f, test accuracy %.4f",
            epoch,
            step,
            metrics["test/loss"],
            metrics["test/acc"],
        )
        if logger:
            logger.log({"step": step, "epoch": epoch, **metrics})
        if cfg.checkpoint.save:
            checkpoint.save(
                last, proc, model=model, optimizer=optimizer, scheduler=scheduler, epoch=epoch,
                step=step, cfg=cfg, metrics=metrics, wandb_id=logger.run_id if logger else None,
            )  # fmt: skip
            if metrics["test/acc"] > best_acc:
                best_acc = metrics["test/acc"]
                checkpoint.copy(last, best, proc)
        if step == trainer.max_steps:
            log.info("Stopped after trainer.max_steps=%d optimizer steps", step)
            break
    return metrics


def train_loss(
    logits: torch.Tensor, labels: torch.Tensor, global_size: int, world_size: int
) -> torch.Tensor:
    """Cross-entropy scaled so that DDP's gradient equals the mean over the whole global batch.

    Each rank sums its samples' losses and multiplies by world_size / global_size; DDP divides the
    sum of the ranks' gradients by world_size, which leaves the gradient of the mean loss over the
    global batch. With equal shares this is each rank's plain mean, and it stays exact when the
    last batch of an epoch splits unevenly. In one process it is the plain mean.
    """
    return F.cross_entropy(logits, labels, reduction="sum") * (world_size / global_size)


@torch.inference_mode()
def evaluate(model: nn.Module, data: MNISTData, proc: Process) -> dict[str, Any]:
    """Test loss and accuracy over the whole test split, each image counted once across ranks."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for images, labels in data.test_batches():
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="none").cpu().double().sum().item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        count += len(labels)
    loss_sum, correct, count = proc.sum_over_ranks([loss_sum, correct, count])
    return {
        "test/loss": loss_sum / count,
        "test/acc": correct / count,
        "test/correct": int(correct),
    }
