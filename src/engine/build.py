"""What `train` (src/engine/app.py) builds from the composed config: the typed settings, the
logger, the data, the model, the optimizer, the schedule, the checkpoint's parts; below, only these
travel."""

from __future__ import annotations

import collections
import copy
import dataclasses
import difflib
import functools
import logging
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, SCMode, ValidationError
from omegaconf.errors import InterpolationKeyError
from torch import nn

from src.engine import checkpoint, guards, storage
from src.engine.checkpoint import Checkpointer
from src.engine.config import SCHEMA, Checkpointing, Config, Settings, Start, Trainer
from src.engine.core.context import Best, Callback, Callbacks, Hooks, Parts, Progress, Run, Schedule
from src.engine.core.task import CONTRACT, place
from src.engine.data import kind
from src.engine.errors import UserError, first_line, refuse, where
from src.engine.guards import NonFinite, UnwrittenMetrics, preflight
from src.engine.logger import MetricsLogger, open_logger
from src.engine.parallel import PROTOCOL, Process, Strategy, own_keys, unwrap
from src.engine.tools.overfit import Overfit
from src.engine.tools.profiler import Profiler
from src.engine.tools.progress import ProgressBar, Speed
from src.engine.tools.warmup import WarmUp

log = logging.getLogger("train")

WANDB_MODES = ("online", "offline", "disabled")  # logger.mode: what wandb.init takes
# What a model may take from the data where the config leaves it null: a sample's shape, and what
# it is to output (the number of classes; a target's shape).
DATA_SHAPE = ("input_shape", "in_channels", "image_size", "num_classes", "target_shape")
# What Python says when a call's keywords do not fit the function: a key the class does not take.
SIGNATURE = ("unexpected keyword argument", "required positional argument", "multiple values")


def read_settings(cfg: DictConfig) -> Settings:
    """The settings of `cfg`: OmegaConf builds each section's dataclass from what Hydra composed on
    the schema (the types checked as it composed; the ranges as each is built), then the task and
    the strategy; a UserError naming the key for any value training cannot use."""
    for key in cfg.data:  # `???` in the YAML: a value only the user can give
        if OmegaConf.is_missing(cfg.data, key):
            raise UserError(
                f"data.{key} has no value: add data.{key}=... to the command (data=image_folder "
                "needs data.root=PATH, the folder that holds train/ and test/)."
            )
    if OmegaConf.get_type(cfg) is not Config:  # handed on as plain values: a started process's
        cfg = OmegaConf.merge(SCHEMA, cfg)
    values = copy.deepcopy(cfg)  # resolved once, here: Hydra's own config is left as composed
    try:  # also a model's keys that name the data's (${data.in_channels}) the data config lacks
        try:
            OmegaConf.resolve(values)
        except InterpolationKeyError:  # which names no key: a reading names the first
            OmegaConf.to_container(values, resolve=True)
    except InterpolationKeyError as err:
        has = f"data.dataset={cfg.data.get('dataset')} has none (not images?)"
        raise unfilled(err.full_key, err.key, has) from None
    resolved = OmegaConf.to_container(values)  # the run's record
    if not isinstance(resolved["data"].get("root", ""), str):  # a dataset's folder of files
        refuse("data.root", resolved["data"]["root"], "the path of the data's folder")
    Start(**{f.name: resolved[f.name] for f in dataclasses.fields(Start)})  # seed before data.seed
    # Hydra lets a `+` key in, which no field of the class takes: refused, as a strategy's is.
    trainer = typed(Trainer, resolved["trainer"], "trainer")
    checkpointing = typed(Checkpointing, resolved["checkpoint"], "checkpoint")
    # OmegaConf.to_object, but a `???` of a class's own keys left for the class to tell.
    sections = OmegaConf.to_container(values, structured_config_mode=SCMode.INSTANTIATE)
    sections.trainer, sections.checkpoint = trainer, checkpointing  # one of each, the checked
    logger = resolved["logger"] or {}
    if (mode := logger.get("mode")) not in (None, *WANDB_MODES):
        refuse("logger.mode", mode, f"{', '.join(WANDB_MODES)} or null ($WANDB_MODE, else online)")
    if logger.get("log_checkpoints"):
        check_logged_checkpoints(logger, checkpointing, sections.train)
    task, strategy = build_task(cfg), build_strategy(cfg.parallel)
    validates = sections.data.val_size > 0
    return Settings(trainer, checkpointing, task, strategy, sections, validates, resolved,
                    train=sections.train, device=sections.device)  # fmt: skip


def unfilled(full_key: str, key: str, has: str) -> UserError:
    """A model's key that takes the data's `key`, which the data lack (`has`: what they are)."""
    return UserError(
        f"{full_key} takes the data's {key}, and {has}: pick a model that takes the data's "
        f"input_shape, or set {full_key}=... yourself.",
        every_rank=True,  # the config's: every rank finds it alike
    )


def check_logged_checkpoints(logger: dict[str, Any], saved: Checkpointing, train: bool) -> None:
    """logger.log_checkpoints=true needs a tracker to log to and checkpoints to log."""
    if not logger.get("_target_"):
        why = "and logger=none has no tracker: use logger=wandb, or set"
    elif not train:
        why = "and train=false writes none (the checkpoint it tests is already kept): set"
    elif not saved.save:
        why = "and checkpoint.save=false writes none: drop checkpoint.save=false, or set"
    else:
        return
    raise UserError(
        f"logger.log_checkpoints=true logs the run's best.pt and last.pt, {why} "
        "logger.log_checkpoints=false."
    )


def build_task(cfg: DictConfig) -> Any:
    """The task `cfg.task` names, checked to have the contract's methods."""
    task = instantiated("task", cfg.task)
    if missing := [name for name in CONTRACT if not callable(getattr(task, name, None))]:
        raise UserError(
            f"task={cfg.task.get('_target_')} has no {', '.join(missing)}: a task needs count, "
            "loss, sums and metrics (see src/tasks.py)."
        )
    return task


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
    node = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    return typed(cls, own_keys(cls, {k: v for k, v in node.items() if k != "_target_"}), "parallel")


@contextmanager
def logged(cfg: DictConfig, run: Run, resumed: tuple | None) -> Iterator[MetricsLogger | None]:
    """The run begins, all checked: Hydra's files kept, the main process's logger opened (or
    continued), the `resumed` run's best.pt taken, config_resolved.yaml written and printed."""
    settings, process, run_dir = run.settings, run.process, run.run_dir
    path, text = run_dir / "config_resolved.yaml", OmegaConf.to_yaml(settings.config)

    def tracker(run_id: str | None) -> Any:  # not recursive: the config's _target_s are data
        given = {"resolved_config": settings.config, "run_id": run_id, "run_dir": run_dir}
        # What a tracker's keys left null take from the run: the job's type and the monitor to
        # summarise by (its name and group are resolved in the config: conf/logger/wandb.yaml).
        if cfg.logger.get("job_type", "") is None:
            given["job_type"] = "train" if settings.train else "eval"
        if (monitor := settings.checkpoint.monitor) and settings.checkpoint.mode and settings.train:
            given["monitor"] = (monitor, settings.checkpoint.mode)
        return instantiate(cfg.logger, **given, _recursive_=False, _convert_="all")

    storage.admit(run_dir)
    with open_logger(run_dir, process, resumed, tracker if cfg.logger._target_ else None) as logger:
        if resumed:  # its best.pt, into this run's folder
            checkpoint.take_best(resumed, run_dir, process)
        if process.is_main:
            log.info("Config:\n%s", text)
        write = functools.partial(storage.write_atomically, path, lambda f: f.write(text.encode()))
        if unwritten := storage.on_main(process, write):
            at = resumed and (resumed[0], resumed[1]["progress"]["step"])  # its checkpoint, step
            raise storage.stopped(unwritten, run_dir, None, at)
        if run.checkpointer:  # its checkpoints name the wandb run that a resume continues
            run.checkpointer.metadata["wandb_id"] = logger and logger.run_id
        yield logger


def build_run(cfg: DictConfig, settings: Settings, process: Process, run_dir: Path) -> Run:
    """The run's context: its data (checked for training) and its hooks, in order; no logger yet."""
    trainer, batch_size, world_size = settings.trainer, cfg.data.batch_size, process.world_size
    # More micro-batches than a rank's share of a batch has samples (a smaller last batch is split
    # into fewer); a batch that does not divide over the ranks is data.setup's to tell.
    share, parts = batch_size // world_size, trainer.accumulate_grad_batches
    if settings.train and 0 < share < parts and batch_size % world_size == 0:
        raise UserError(
            f"trainer.accumulate_grad_batches={parts} splits each process's share of a batch "
            f"({share} images: data.batch_size={batch_size} over {world_size} processes) into "
            f"{parts} micro-batches, and some would be empty. Use at most {share}, or a larger "
            "data.batch_size.",
            every_rank=True,
        )
    data = instantiated("data", cfg.data)
    data.setup(process, trainer.dtype, trainer.memory_format)
    hooks = [WarmUp()] if trainer.warmup_steps else []  # before the signal handlers
    hooks += [UnwrittenMetrics(), NonFinite()]  # checked in this order
    if (every := getattr(settings.parallel, "check_sync_every_n_steps", None)) is not None:
        hooks.append(guards.DriftGuard(every))  # the ranks' weights compared
    hooks.append(build_callbacks(cfg))  # the config's callbacks= list
    hooks += [ProgressBar(), Speed()] + ([Profiler()] if trainer.profile else [])
    if (below := (cfg.debug or {}).get("overfit_below")) is not None:
        hooks.append(Overfit(below))  # debug=overfit's verdict
    run = Run(process, settings, data, hooks=Hooks(hooks), run_dir=run_dir)
    if settings.train:
        guards.check_first_batch(data, process, run.task)
    return run


def build_callbacks(cfg: DictConfig) -> Callbacks:
    """The callbacks `cfg.callbacks` names (`{name: a class and its keys}`), built afresh."""
    built = {}
    for name, node in (cfg.get("callbacks") or {}).items():
        if not isinstance(node, DictConfig) or not node.get("_target_"):
            raise UserError(
                f"callbacks.{name} names no class: its file in conf/callbacks/ needs `{name}:` "
                "with a `_target_: module.Class` under it (conf/callbacks/ema.yaml is one).",
                every_rank=True,
            )
        built[str(name)] = callback = instantiated(f"callbacks.{name}", node, values=True)
        if not isinstance(callback, Callback):
            raise UserError(
                f"callbacks.{name}._target_={node._target_} is no Callback: subclass "
                "src.engine.core.context.Callback, whose methods the loop calls.",
                every_rank=True,
            )
    return Callbacks(built)


def build_model(cfg: DictConfig, run: Run, weights: tuple | None) -> nn.Module:
    """The model of `cfg.model`: alike on every rank, from `weights` if given, checked, wrapped."""
    trainer, process, data, strategy = run.trainer, run.process, run.data, run.strategy
    configure_kernels(trainer)
    found = {key: getattr(data, key) for key in DATA_SHAPE if cfg.model.get(key, 0) is None}
    if lacking := [key for key in ("in_channels", "image_size") if key in found and not found[key]]:
        has = f"{data.name} gives {kind(data.input_dtype, data.input_shape)} samples, not images"
        raise unfilled(f"model.{lacking[0]}", lacking[0], has)
    if cfg.model.get("num_classes") not in (None, data.num_classes) and data.num_classes:
        raise UserError(
            f"model.num_classes={cfg.model.num_classes}, but the data have {data.num_classes} "
            f"classes: a score for each is what the model gives. Set model.num_classes to "
            f"{data.num_classes}, or leave it to the data (${{data.num_classes}}).",
            every_rank=True,
        )
    checkpoint.seed_everything(cfg.seed)  # the same initial weights on every rank
    # Built in float32 (the default dtype), then cast: float64 starts from float32's weights.
    model = instantiated("model", cfg.model, **found).to(process.device, trainer.dtype)
    place(run.task, process.device)  # its metric objects where the model's outputs are
    preflight(model, data, run.task, cfg.model.get("_target_"))
    shards = weights and weights[1].get(checkpoint.SHARDS)  # checkpoint.sharded=true's folder
    if weights and not shards:
        checkpoint.Weights(model, weights[0]).load_state_dict(weights[1]["model"])
    guards.check_start(model, process)  # in a process group: every rank's weights are rank 0's
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = strategy.wrap(model, trainer)
    if shards:  # each rank reads its own parts
        checkpoint.load_shards(model, weights[0], shards, strategy)
    return model


def build_parts(
    cfg: DictConfig, run: Run, model: nn.Module, resumed: tuple | None
) -> tuple[Parts, Progress, Checkpointer]:
    """The optimizer, schedule, scaler and progress (fresh or `resumed`), and their checkpointer."""
    trainer, process, data, strategy = run.trainer, run.process, run.data, run.strategy
    decay = cfg.optimizer.get("weight_decay") or 0.0  # what a model's own groups are given
    groups = param_groups(unwrap(model), trainer.weight_decay_on, decay)
    steps = data.steps_per_epoch * trainer.epochs
    steps = min(steps, trainer.max_steps or steps)
    optimizer, schedule = build_optimizer(cfg, groups, steps, data.steps_per_epoch)
    # float16 gradients underflow without loss scaling; for other precisions it is off.
    scaler = strategy.scaler(process.device, enabled=trainer.precision == "16")
    policy = run.settings.checkpoint
    best = Best(policy.monitor, policy.mode) if run.settings.validates else None
    progress = Progress(best=best, batch_size=data.batch_size, train_size=data.size("train"))
    parts = {
        "model": checkpoint.Weights(model),
        "optimizer": checkpoint.OptimizerState(optimizer, model),
        "scheduler": schedule,
        "scaler": scaler,  # {} unless trainer.precision=16
        "progress": progress,
        "rng": checkpoint.RandomState(process, cfg.seed, strategy),  # or the checkpoint's
    }
    if callable(getattr(run.task, "state_dict", None)):  # a task that keeps state of its own
        parts["task"] = run.task
    for hook in run.hooks:  # set up before the checkpoint gives them their state back
        if isinstance(hook, Callbacks):
            hook.setup(run, model, optimizer)
            parts |= {"callbacks": hook} if hook.stateful else {}
    metadata = {"config": run.settings.config, "wandb_id": None}  # the run's, once it begins
    saver = Checkpointer(policy, run.run_dir, process, strategy, parts, metadata, resumed)
    if resumed and run.trainer.test_weights == "best":  # the test loads the best.pt it names
        saver.check_best(*resumed)
    return Parts(model, optimizer, schedule, scaler), progress, saver


def build_optimizer(
    cfg: DictConfig, groups: list[Any], total_steps: int, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, Schedule]:
    """`cfg.optimizer` over `groups` (its parameters), and `cfg.scheduler` over it (`interval` is
    the loop's, `total_steps: null` the run's). Refused: what torch's optimizers accept but cannot
    mean, a value that is not finite (NaN compares false with every bound they check), a momentum
    of 1 or more (steps without bound); a schedule that fails partway (scheduler.step_size=0),
    stepped first through its whole plan on a stand-in parameter (3 µs a step), in one sentence
    before training, not later."""
    optimizer = instantiated("optimizer", cfg.optimizer, groups, values=True)
    for key, value in optimizer.defaults.items():
        if isinstance(value, float) and not math.isfinite(value):
            refuse(f"optimizer.{key}", value, "a finite number")
    if not 0 <= optimizer.defaults.get("momentum", 0) < 1:
        refuse(
            "optimizer.momentum", optimizer.defaults["momentum"], "0 up to below 1 (0.9 is usual)"
        )
    spec = OmegaConf.to_container(cfg.scheduler, resolve=True)
    every_step = spec.pop("interval", None) == "step"
    if "total_steps" in spec and spec["total_steps"] is None:
        spec["total_steps"] = total_steps
    parameter = [torch.zeros(1, requires_grad=True)]
    stand_in = instantiated("optimizer", cfg.optimizer, parameter, values=True)
    planned = instantiated("scheduler", spec, stand_in, values=True)
    plan = total_steps if every_step else -(-total_steps // steps_per_epoch)  # its epochs
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        for step_ in range(1, plan + 1):
            try:
                planned.step()
            except Exception as err:  # noqa: BLE001 - whatever its arithmetic meets, told once
                raise UserError(
                    f"scheduler: {cfg.scheduler.get('_target_')} fails at its step {step_} of "
                    f"{plan} ({'optimizer steps' if every_step else 'epochs'}) with "
                    f"{type(err).__name__}: {first_line(err)}. Fix the scheduler.* keys (python "
                    "train.py --cfg job shows them).",
                    every_rank=True,
                ) from None
    scheduler = instantiated("scheduler", spec, optimizer, values=True)
    return optimizer, Schedule(scheduler, every_step=every_step)


def configure_kernels(trainer: Trainer) -> None:
    """The kernels `trainer` asks for: deterministic ones only, or cuDNN's autotuned fastest;
    full float32 matmuls, or TF32. Set for every job: one job of a sweep leaves nothing on."""
    if trainer.deterministic:  # cuBLAS reads it at its first call: train.py sets it at start too
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Only when it changes: the call imports torch._inductor (1.4 s here) even to switch it off.
    if torch.are_deterministic_algorithms_enabled() != trainer.deterministic:
        torch.use_deterministic_algorithms(trainer.deterministic)
    torch.backends.cudnn.benchmark = not trainer.deterministic  # autotuned per input shape
    torch.set_float32_matmul_precision(trainer.matmul_precision)


def instantiated(group: str, node: Any, *args: Any, values: bool = False, **kwargs: Any) -> Any:
    """`instantiate(node, ...)`: a class that cannot be imported, a key it does not take or (with
    `values`) a value it refuses, as torch's optimizers do, is one sentence naming `group`."""
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as err:
        cause, target = err.__cause__, node.get("_target_")
        if isinstance(cause, UserError):  # the class's own sentence
            raise cause from None
        if isinstance(cause, ImportError):  # what its module raised, unless the class is missing
            inner = cause.__cause__ or cause
            said = "" if getattr(inner, "name", None) == target else f" ({first_line(inner)})"
            raise UserError(
                f"{group}._target_={target} cannot be imported{said}: check its module and class "
                f"name (or choose a {group} config: python train.py --help lists them).",
                every_rank=True,
            ) from None
        signature = isinstance(cause, TypeError) and any(s in str(cause) for s in SIGNATURE)
        refused = (TypeError, ValueError, IndexError)  # IndexError: Adam's betas=[0.9]
        if not (signature or (values and isinstance(cause, refused))):
            raise
        said = "refuses a value"
        if signature:
            missing = "missing" in str(cause)
            said = "needs keys the config lacks" if missing else "does not take these keys"
        raise UserError(
            f"{group}: {target} {said} ({first_line(cause)}). Fix the {group}.* keys (python "
            "train.py --cfg job shows them).",
            every_rank=True,
        ) from None


# A dataclass as OmegaConf checks values against it, made once per class (a merge copies it).
schema = functools.cache(OmegaConf.structured)


def typed(cls: type, values: dict[str, Any], section: str) -> Any:
    """The dataclass `cls` (a section, or a strategy, which its `_target_` names) from `values`,
    types checked by OmegaConf, ranges by `cls.__post_init__`; a wrong type, a key that is no field
    of `cls` and a value of `cls` written without a type (no field, so no key) are one sentence
    naming the class and its file."""
    annotated = [item for c in cls.__mro__ for item in vars(c).get("__annotations__", {}).items()]
    # Its fields (a class without @dataclass of its own has none of its annotations), its ClassVars
    typed_names = {name for name, hint in annotated if "ClassVar" in str(hint)}
    typed_names |= set(cls.__dataclass_fields__)
    for c in cls.__mro__[:-1]:  # `rate = 0.1` in a dataclass is no field: no key of the config
        for name, value in vars(c).items():
            method = callable(value) or isinstance(value, property | classmethod | staticmethod)
            if not (method or name.startswith("_") or name in typed_names):  # fields, ClassVars
                raise UserError(
                    f"{where(c)}: {c.__name__}.{name} = {value!r} has no type, so it is no key "
                    f"of {section}: declare it as a field, `{name}: {type(value).__name__} = "
                    f"{value!r}`.",
                    every_rank=True,
                )
    fields = [f.name for f in dataclasses.fields(cls)]
    if (key := next((key for key in values if key not in fields), None)) is not None:
        close = difflib.get_close_matches(str(key), fields, n=1)
        raise UserError(
            f"{section}.{key} is not a key of {section}: {cls.__name__} ({where(cls)}) has no "
            f"field of that name. "
            f"{f'Did you mean {section}.{close[0]}?' if close else 'Check its spelling'}"
            " (python train.py --cfg job shows the keys).",
            every_rank=True,
        )
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema(cls), values))
    except ValidationError as err:
        raise UserError(
            f"{section}.{err.full_key}={values.get(err.full_key, err.value)} is not allowed: "
            f"{first_line(err)} (the type of {cls.__name__}.{err.full_key}).",
            every_rank=True,
        ) from None


def param_groups(model: nn.Module, weight_decay_on: str, decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups over the plain `model` (after wrapping: FSDP's parameters
    are its new ones): the model's own `param_groups(decay)` (`decay`: optimizer.weight_decay),
    checked, where it has that method; else `trainer.weight_decay_on`'s, one group of all (torch's
    default), or the matrices in one and the rest (biases, normalisation layers) in one without
    weight decay (nanoGPT's rule)."""
    own, parameters = getattr(model, "param_groups", None), list(model.parameters())
    if callable(own):
        if weight_decay_on != "all":
            log.info(
                "%s.param_groups gives the optimizer's groups: trainer.weight_decay_on=%s is not "
                "used.",
                type(model).__name__,
                weight_decay_on,
            )
        return checked_groups(model, own(decay))
    if weight_decay_on == "all":
        return [{"params": parameters}]
    matrices = [p for p in parameters if p.dim() >= 2]
    rest = [p for p in parameters if p.dim() < 2]
    groups = [{"params": matrices}, {"params": rest, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # a model without biases: one


def checked_groups(model: nn.Module, groups: Any) -> list[dict[str, Any]]:
    """A model's own `groups` (each "params" made a list), which hold each of its parameters that
    trains exactly once (a frozen one may be left out), and nothing else."""
    about = f"{type(model).__name__}.param_groups ({where(type(model))})"
    if wrong := malformed(groups):
        raise UserError(
            f"{about} {wrong}: it returns the optimizer's groups as torch's optimizers take them, "
            'a list of dicts each with "params" (some of the model\'s parameters) and the settings '
            'they change, e.g. [{"params": matrices}, {"params": biases, "weight_decay": 0.0}].',
            every_rank=True,
        )
    groups = [{**g, "params": [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])}
              for g in groups]  # fmt: skip
    named, given = dict(model.named_parameters()), [p for g in groups for p in g["params"]]
    counts, ours = collections.Counter(map(id, given)), set(map(id, named.values()))

    def some(items: list[str]) -> str:
        return ", ".join(items[:3]) + (", …" if len(items) > 3 else "")

    if strangers := [p for p in given if id(p) not in ours]:
        said = "value that is" if len(strangers) == 1 else "values that are"
        shown = [f"a tensor of shape {tuple(p.shape)}" if torch.is_tensor(p) else repr(p)
                 for p in strangers]  # fmt: skip
        raise UserError(
            f"{about} gives {len(strangers)} {said} not among the model's parameters ("
            f"{some(shown)}): "
            "take them from self.named_parameters() as it is called (FSDP replaces the "
            "parameters as it wraps the model, before the optimizer's groups are made).",
            every_rank=True,
        )
    if twice := [name for name, p in named.items() if counts[id(p)] > 1]:
        raise UserError(
            f"{about} puts {some(twice)} in more than one group (or twice in one): torch's "
            "optimizers take each parameter once; give each one group.",
            every_rank=True,
        )
    if left := [name for name, p in named.items() if p.requires_grad and not counts[id(p)]]:
        raise UserError(
            f"{about} leaves out {len(left)} of the model's parameters ({some(left)}), which "
            "would never train: give each a group (or freeze one not to train, "
            "requires_grad=False).",
            every_rank=True,
        )
    return groups


def malformed(groups: Any) -> str | None:
    """What is wrong with the shape of a model's `param_groups`, if anything."""
    if not isinstance(groups, list | tuple):
        return f"returned a {type(groups).__name__}"
    if not groups:
        return "returned no group"
    for group in groups:
        if not isinstance(group, dict):
            return f"returned a group that is a {type(group).__name__}"
        if "params" not in group:
            return f'returned a group without "params" (its keys: {", ".join(map(str, group))})'
    return None
