"""What `src/engine/run.py` builds from the config: the model (wrapped for its parallel mode), the
optimizer, the schedule and the loss scaler, and the kernels' settings.

With `src/engine/run.py` it is the top of the run: the only modules below `train.py` that read the
DictConfig (its `model`, `optimizer` and `scheduler` groups, which name classes to build).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationKeyError, ValidationError
from torch import nn

from src.engine import checkpoint, storage
from src.engine.checkpoint import Checkpointer
from src.engine.config import (
    Checkpointing,
    DataKeys,
    ScheduleKeys,
    Settings,
    Start,
    Trainer,
    checkpoint_mode,
    modes,
)
from src.engine.core.context import Hooks, Run
from src.engine.core.state import Best, Parts, Progress, Schedule
from src.engine.core.task import preflight
from src.engine.errors import UserError, first_line, refuse, where
from src.engine.guards import drift
from src.engine.guards.checks import NonFinite, UnwrittenMetrics, check_count
from src.engine.guards.signals import StopSignals
from src.engine.logger import MetricsLogger, open_logger
from src.engine.parallel import PROTOCOL, Process, Strategy
from src.engine.tools.profiler import Profiler
from src.engine.tools.progress import ProgressBar
from src.engine.tools.speed import Speed
from src.engine.tools.warmup import WarmUp

log = logging.getLogger("train")

# What a model may take from the data: a sample's shape (any data; an image's channels and size)
# and what it is to output (the number of classes; a target's shape).
DATA_SHAPE = ("input_shape", "in_channels", "image_size", "num_classes", "target_shape")


# What Python says when a call's keywords do not fit the function: a key the class does not take.
_SIGNATURE = ("unexpected keyword argument", "required positional argument", "multiple values")


def instantiated(group: str, node: Any, *args: Any, values: bool = False, **kwargs: Any) -> Any:
    """`instantiate(node, *args, **kwargs)` for the config group `group` (model, data, optimizer,
    scheduler, task). A class that cannot be imported, a key its class does not take, or, with
    `values`, a value it refuses (torch's optimizers and schedulers check theirs) is one sentence
    naming the group; the class's own UserError stays its sentence; anything else keeps its
    traceback."""
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as err:
        cause, target = err.__cause__, node.get("_target_")
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, ImportError):
            raise UserError(
                f"{group}._target_={target} cannot be imported: check its module and class name "
                f"(or choose a {group} config: python train.py --help lists them).",
                every_rank=True,
            ) from None
        signature = isinstance(cause, TypeError) and any(s in str(cause) for s in _SIGNATURE)
        if not (signature or (values and isinstance(cause, (TypeError, ValueError)))):
            raise
        refused = "does not take these keys" if signature else "refuses a value"
        raise UserError(
            f"{group}: {target} {refused} ({first_line(cause)}). Fix the {group}.* keys "
            "(python train.py --cfg job shows them).",
            every_rank=True,
        ) from None


def typed(cls: type, node: Any, section: str, exclude: tuple[str, ...] = ()) -> Any:
    """The dataclass `cls` built from the config `node` (a DictConfig or a dict): OmegaConf checks
    each value against its field's type, `cls.__post_init__` its range and choices. A value of
    the wrong type, or a key `cls` has no field for, is one sentence naming it."""
    untyped(cls, section)
    if not isinstance(node, dict):
        node = OmegaConf.to_container(node, resolve=True)
    values = {key: value for key, value in node.items() if key not in exclude}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except ConfigKeyError as err:
        raise UserError(
            f"{section}.{err.key} is not a key of {section}: {cls.__name__} ({where(cls)}) has "
            "no field of that name. Check its spelling (python train.py --cfg job shows the keys).",
            every_rank=True,
        ) from None
    except ValidationError as err:
        value = values.get(err.full_key, err.value)
        raise UserError(
            f"{section}.{err.full_key}={value} is not allowed: {first_line(err)} (the type of "
            f"{cls.__name__}.{err.full_key}).",
            every_rank=True,
        ) from None


def untyped(cls: type, section: str) -> None:
    """Refuse a setting a fork declared without a type (`rate = 0.1` in a dataclass is a class
    attribute, no field, and no key of the config)."""
    shared = {name for c in cls.__mro__ for name, t in vars(c).get("__annotations__", {}).items()
              if "ClassVar" in str(t)}  # fmt: skip
    fields = getattr(cls, "__dataclass_fields__", {})
    for c in cls.__mro__[:-1]:
        for name, value in vars(c).items():
            if name.startswith("_") or name in fields or name in shared:
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                continue
            raise UserError(
                f"{where(c)}: {c.__name__}.{name} = {value!r} has no type, so it is no key of "
                f"{section}: declare it as a field, `{name}: {type(value).__name__} = {value!r}`.",
                every_rank=True,
            )


def build_strategy(node: Any) -> Strategy:
    """The strategy a `parallel:` node names by `_target_`, its fields checked by their types."""
    target = node.get("_target_")
    try:
        cls = get_class(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps what the import raised
        raise UserError(
            f"parallel._target_={target} cannot be imported ({first_line(err)}): name a strategy "
            "class (conf/parallel/ holds the template's).",
            every_rank=True,
        ) from None
    if missing := [name for name in PROTOCOL if not hasattr(cls, name)]:
        raise UserError(
            f"parallel: {cls.__name__} ({where(cls)}) has no {', '.join(missing)}: a strategy "
            "answers the whole protocol of src/engine/parallel/__init__.py; subclass Strategy (or "
            "the mode it varies) to inherit what it does not change.",
            every_rank=True,
        )
    return typed(cls, node, "parallel", exclude=("_target_",))


def read_settings(cfg: DictConfig) -> Settings:
    """The settings of `cfg`; a UserError naming the key for any value training cannot use."""
    for key in cfg.data:  # `???` in the YAML: a value only the user can give
        if OmegaConf.is_missing(cfg.data, key):
            raise UserError(
                f"data.{key} has no value: add data.{key}=... to the command (data=image_folder "
                "needs data.root=PATH, the folder that holds train/ and test/)."
            )
    try:  # also a model's keys that name the data's (${data.in_channels}) the data config lacks
        config = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationKeyError as err:
        raise UserError(
            f"{err.full_key} takes the data's {err.key}, and data.dataset="
            f"{cfg.data.get('dataset')} has none (not images?): pick a model that takes the "
            f"data's input_shape, or set {err.full_key}=... yourself."
        ) from None
    if not isinstance(config["data"].get("root", ""), str):  # a dataset's folder of files
        refuse("data.root", config["data"]["root"], "the path of the data's folder")
    start = typed(Start, {f.name: config[f.name] for f in dataclasses.fields(Start)}, "")
    shared = {f.name for f in dataclasses.fields(DataKeys)}
    data = typed(DataKeys, {k: v for k, v in config["data"].items() if k in shared}, "data")
    typed(ScheduleKeys, {"interval": config["scheduler"].get("interval")}, "scheduler")
    checkpoint = typed(Checkpointing, config["checkpoint"], "checkpoint")
    task = build_task(cfg.task)
    checkpoint.mode = checkpoint_mode(checkpoint.monitor, checkpoint.mode, modes(task))
    trainer, strategy = typed(Trainer, config["trainer"], "trainer"), build_strategy(cfg.parallel)
    return Settings(trainer, checkpoint, task, strategy, start, data.val_size > 0, config)


# The task contract's methods (src/engine/core/task.py).
TASK_METHODS = ("count", "loss", "sums", "metrics")


def build_task(config: Any) -> Any:
    """The task `config` (the `task:` node) names, checked to have the contract's methods."""
    task = instantiated("task", config)
    if missing := [name for name in TASK_METHODS if not callable(getattr(task, name, None))]:
        raise UserError(
            f"task={config.get('_target_')} has no {', '.join(missing)}: a task needs count, "
            "loss, sums and metrics (see src/tasks.py)."
        )
    return task


def logged(
    cfg: DictConfig, settings: Settings, run_dir: Path, process: Process, resumed: tuple | None
) -> AbstractContextManager[MetricsLogger | None]:
    """The resolved config written to config_resolved.yaml (and printed), then the main
    process's logger: metrics.jsonl and the tracker `cfg.logger` names (wandb), continued from
    the `resumed` run. Every rank stops if the storage refuses the config."""
    path, text = run_dir / "config_resolved.yaml", OmegaConf.to_yaml(settings.config)

    def write() -> None:
        log.info("Config:\n%s", text)
        storage.write_atomically(path, lambda file: file.write(text.encode()))

    if unwritten := storage.on_main(process, write):
        raise storage.stopped(unwritten, run_dir, None, resumed and (resumed[0], step(resumed)))
    tracker = None
    if cfg.logger._target_ is not None:  # not recursive: the config's _target_s are data for it
        tracker = lambda run_id: instantiate(  # noqa: E731
            cfg.logger, run_dir=run_dir, resolved_config=settings.config, run_id=run_id,
            _recursive_=False, _convert_="all",
        )  # fmt: skip
    return open_logger(run_dir, process, resumed, tracker)


def build_run(
    cfg: DictConfig,
    settings: Settings,
    process: Process,
    logger: MetricsLogger | None,
    run_dir: Path,
) -> Run:
    """The run's context: its data (checked: under DDP the ranks' shares of the first batch make
    it up, and it has something to learn from), its logger and its hooks."""
    if settings.train:  # each rank's share of a batch splits into the micro-batches asked for
        check_accumulation(settings.trainer, cfg.data.batch_size, process.world_size)
    data = instantiated("data", cfg.data)
    data.setup(process, settings.trainer.dtype, settings.trainer.memory_format)
    run = Run(process, settings, data, logger, hooks=hooks(settings), run_dir=run_dir)
    if settings.train:
        drift.check_first_batch(data, process)
        check_count(run)
    return run


def hooks(settings: Settings) -> Hooks:
    """The guards and the tools the loop calls, in the order they act at each of its points."""
    trainer = settings.trainer
    chosen = [WarmUp()] if trainer.warmup_steps else []  # before the signal handlers
    chosen += [UnwrittenMetrics(), NonFinite(), StopSignals()]  # checked in this order
    if settings.parallel.drift_every is not None:  # the ranks' weights compared
        chosen.append(drift.DriftGuard(settings.parallel.drift_every))
    chosen += [ProgressBar(), Speed()]
    if trainer.profile:
        chosen.append(Profiler(trainer.profile))
    return Hooks(chosen)


def checkpointer(run: Run, parts: dict[str, Any], resumed: tuple | None) -> Checkpointer:
    """What saves the run's `parts`; the checkpoint it resumes from is kept until it writes its
    own."""
    metadata = {"config": run.settings.config, "wandb_id": run.logger and run.logger.run_id}
    saver = Checkpointer(run.settings.checkpoint, run.run_dir, run.process, run.strategy, parts,
                         metadata)  # fmt: skip
    saver.kept = resumed and (resumed[0], step(resumed))
    return saver


def step(resumed: tuple[Path, dict]) -> int:
    """The optimizer step the checkpoint (path, contents) training resumes from stands at."""
    return resumed[1]["progress"]["step"]


def build_model(cfg: DictConfig, run: Run, weights: tuple | None) -> nn.Module:
    """The model of `cfg.model`, the same on every rank, with the checkpoint `weights` if given,
    checked to take the data's samples and give the task what it needs (`preflight`), wrapped
    as the parallel mode trains it."""
    # The input's shape and the number of classes that the config leaves to the data to find.
    trainer, task, process, data = run.trainer, run.task, run.process, run.data
    configure_kernels(trainer)
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
