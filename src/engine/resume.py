"""A resumed run with another config: what changed is applied from this config, or refused.

A checkpoint holds the config it was trained with. Resuming compares it with this run's: each
key that differs is logged in one line ("optimizer.lr 0.01 → 0.5 from this config") and trains as
this config says, or, where that cannot be (the split, the sample order, another optimizer's
state), stops the run before any work with one sentence. What would otherwise continue from the
checkpoint against the config is made to follow it:

- the optimizer's settings (lr, momentum, betas, weight decay) are this config's, over the
  loaded state (its moments continue);
- the learning-rate schedule is this config's plan (for its epochs, max_steps, batch size),
  stepped to where training stands: the rates a fresh run of this config would use from there;
- a mid-epoch checkpoint continues at the same image of the epoch under another batch size, if
  it divides the images done.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from src.engine.errors import UserError

log = logging.getLogger(__name__)

# What decides which images are trained on, validated on and in what order: it stays the
# checkpoint's, or the rest of the run trains on other images than its start did.
FIXED = ("seed", "data.seed", "data.split_seed", "data.val_size", "data.subset", "data.dataset")
QUIET = ("paths", "resume")  # where files are: no line when they change


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """Each leaf of a nested config, by its dotted key."""
    if not isinstance(config, dict):
        return {prefix: config}
    leaves = {}
    for key, value in config.items():
        leaves.update(_flat(value, f"{prefix}{key}." if isinstance(value, dict) else prefix + key))
    return leaves


def check_changes(saved: dict[str, Any] | None, config: dict[str, Any], path: Any) -> None:
    """Log each key this config changes from the checkpoint's `saved` config (both resolved), and
    refuse a change a resumed run cannot make. A checkpoint without a config is taken as is."""
    if not saved:
        return
    before, after = _flat(saved), _flat(config)
    optimizer = before.get("optimizer._target_"), after.get("optimizer._target_")
    if optimizer[0] and optimizer[0] != optimizer[1]:
        raise UserError(
            f"{path} was trained with {optimizer[0]}, and this config's optimizer is "
            f"{optimizer[1]}: its state cannot continue in another optimizer. Resume with the "
            f"checkpoint's optimizer, or start from its weights with a fresh one: init_from={path}."
        )
    interval = before.get("scheduler.interval"), after.get("scheduler.interval")
    if interval[0] and interval[0] != interval[1]:
        raise UserError(
            f"scheduler.interval={interval[1]}, and {path} was trained with "
            f"scheduler.interval={interval[0]}: where its schedule stands is counted in "
            f"{interval[0]}s. Resume with scheduler.interval={interval[0]}, or start a new run "
            f"from its weights: init_from={path}."
        )
    for key in FIXED:
        if key in before and before[key] != after.get(key):
            raise UserError(
                f"{key}={after.get(key)}, and {path} was trained with {key}={before[key]}: it "
                "decides which images train and validate, in what order, so it cannot change in "
                f"a resumed run. Resume with {key}={before[key]}, or start a new run from its "
                f"weights: init_from={path}."
            )
    for key in sorted(before.keys() | after.keys()):
        if key.split(".")[0] not in QUIET and before.get(key) != after.get(key):
            log.info("%s %s → %s from this config", key, before.get(key), after.get(key))


def rebatch(state: dict[str, Any], batch_size: int, train_size: int) -> None:
    """Express a mid-epoch checkpoint's position in this run's batches: the same image of the
    epoch, when this config's `batch_size` divides the images done; refused otherwise."""
    saved = (state.get("config") or {}).get("data", {}).get("batch_size", batch_size)
    if saved == batch_size:
        return
    done = min(state["epoch_step"] * saved, train_size)
    if done == train_size:  # saved at the end of an epoch
        state["epoch_step"] = math.ceil(train_size / batch_size)
        return
    if done % batch_size:
        sizes = [d for d in range(1, done + 1) if done % d == 0]
        near = sorted(sorted(sizes, key=lambda d: (abs(d - batch_size), d))[:3])
        raise UserError(
            f"The checkpoint stands {done} images into epoch {state['epoch']} "
            f"({state['epoch_step']} batches of {saved}), which data.batch_size={batch_size} "
            f"does not divide: resume with one that does ({', '.join(map(str, near))}), or from "
            "a checkpoint at the end of an epoch."
        )
    log.info(
        "The checkpoint's %d batches of %d into epoch %d are %d batches of %d",
        state["epoch_step"],
        saved,
        state["epoch"],
        done // batch_size,
        batch_size,
    )
    state["epoch_step"] = done // batch_size


def settings_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (lr, momentum, ...), without its parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def apply_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """This config's `settings` over the groups a checkpoint's state loaded (its lr, betas, ...:
    the optimizer's moments continue, its settings are this config's)."""
    for group, fresh in zip(optimizer.param_groups, settings, strict=True):
        group.pop("initial_lr", None)  # the schedule's start: this config's lr, when it is built
        group.update(fresh)


def replan(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> None:
    """Step this config's freshly built `scheduler` through the `steps` its checkpoint had taken:
    the learning rate of this plan where training stands (exactly the checkpoint's, when the plan
    is the same)."""
    total = getattr(scheduler, "total_steps", None)  # OneCycleLR cannot step past its plan
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(min(steps, total) if total else steps):
            scheduler.step()
