"""What `src/engine/run.py` builds from the config: the model (wrapped for its parallel mode), the
optimizer, the schedule and the loss scaler, and the kernels' settings.

With `src/engine/run.py` it is the top of the run: the only modules below `train.py` that read the
DictConfig (its `model`, `optimizer` and `scheduler` groups, which name classes to build).
"""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.engine import checkpoint
from src.engine.config import Trainer
from src.engine.core.context import Run
from src.engine.core.state import Best, Parts, Progress, Schedule
from src.engine.core.task import preflight
from src.engine.errors import UserError, first_line, instantiated
from src.engine.guards import drift

# What a model may take from the data: a sample's shape (any data; an image's channels and size)
# and what it is to output (the number of classes; a target's shape).
DATA_SHAPE = ("input_shape", "in_channels", "image_size", "num_classes", "target_shape")


def build_model(cfg: DictConfig, run: Run, weights: tuple | None) -> nn.Module:
    """The model of `cfg.model`, the same on every rank, with the checkpoint `weights` if given,
    checked to take the data's samples and give the task what it needs (`preflight`), wrapped
    as the parallel mode trains it."""
    # The input's shape and the number of classes that the config leaves to the data to find.
    trainer, task, process, data = run.trainer, run.task, run.process, run.data
    found = {key: getattr(data, key) for key in DATA_SHAPE if cfg.model.get(key, 0) is None}
    seed_everything(cfg.seed)  # the same initial weights on every rank
    # Built in float32 (as the default dtype makes it), then cast: float64 starts from the same
    # weights as float32 does.
    model = instantiated("model", cfg.model, **found).to(process.device, trainer.dtype)
    preflight(model, data, task, cfg.model.get("_target_"))
    shards = weights and weights[1].get(checkpoint.SHARDS)  # checkpoint.sharded=true's folder
    if weights and not shards:
        checkpoint.Weights(model, run.strategy, weights[0]).load_state_dict(weights[1]["model"])
    drift.check_start(model, process)  # in a process group: every rank's weights are rank 0's
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = run.strategy.wrap(model, trainer)
    if shards:  # checkpoint.sharded=true's folder: each rank reads its own parts
        checkpoint.load_shards(model, weights[0], shards, run.strategy)
    return model


def build_parts(
    cfg: DictConfig, run: Run, model: nn.Module, state: dict | None
) -> tuple[Parts, Progress, dict[str, Any]]:
    """The model's optimizer, schedule and float16's loss scaler, and the progress: fresh, or
    continued from the checkpoint `state` training resumes. Also the checkpoint's parts, each
    of which saves and loads its own state (the model's weights loaded as it was built)."""
    trainer, process, data, strategy = run.trainer, run.process, run.data, run.strategy
    optimizer = instantiated("optimizer", cfg.optimizer, model.parameters(), values=True)
    # float16 gradients underflow without loss scaling; for other precisions it is off.
    scaler = strategy.scaler(process.device, enabled=trainer.precision == "16")
    total_steps = data.steps_per_epoch * trainer.epochs
    total_steps = min(total_steps, trainer.max_steps or total_steps)
    check_schedule(cfg, total_steps, data.steps_per_epoch)  # its whole plan, before training
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    schedule = Schedule(scheduler, every_step=cfg.scheduler.interval == "step")
    policy = run.settings.checkpoint
    best = Best(policy.monitor, policy.mode) if run.settings.validates else None
    progress = Progress(best=best, batch_size=data.batch_size, train_size=data.size("train"))
    streams = checkpoint.RandomState(process)
    parts = {
        "model": checkpoint.Weights(strategy.unwrap(model), strategy),
        "optimizer": checkpoint.OptimizerState(optimizer, model, strategy),
        "scheduler": schedule,
        "scaler": scaler,  # {} unless trainer.precision=16
        "progress": progress,
        "rng": streams,
    }
    if callable(getattr(run.task, "state_dict", None)):  # a task that keeps state of its own
        checkpoint.check_part("task", run.task)
        parts["task"] = run.task
    if state:  # the model's weights were loaded as it was built
        checkpoint.load_parts({k: v for k, v in parts.items() if k != "model"}, state)
        if shards := state.get(checkpoint.SHARDS):  # checkpoint.sharded=true: each rank its own
            strategy.load_shards(model, Path(shards), optimizer)
    if not streams.continued:
        seed_everything(cfg.seed + process.rank)  # each rank its own dropout stream
        strategy.seed(cfg.seed)  # and what the mode draws on beyond (dp: each GPU's replica)
    return Parts(model, optimizer, schedule, scaler), progress, parts


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


def build_scheduler(
    cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler of `cfg.scheduler`. Its `interval` is for the loop, not the constructor, and a
    `total_steps: null` is filled with the run's number of optimizer steps."""
    spec = OmegaConf.to_container(cfg.scheduler, resolve=True)
    spec.pop("interval", None)
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
