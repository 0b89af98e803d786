"""The run's settings, read once from the config into plain typed values and checked there.

`read_settings(cfg)` turns the `trainer:`, `checkpoint:` and related keys into frozen
dataclasses. Each checks its own values where it is built, so a value training cannot use stops
the run before any work, with one sentence naming the key; below `src/engine/run.py`, functions take
these settings instead of the DictConfig.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from src import tasks
from src.engine.errors import UserError

# Each precision's autocast dtype (None: none), and the dtype of the weights and float inputs.
PRECISIONS = {"64": None, "32": None, "bf16": torch.bfloat16, "16": torch.float16}
WEIGHTS = {"64": torch.float64}  # the others keep float32 weights (mixed precision autocasts)
PROCESS_GROUP_MODES = ("ddp", "fsdp")  # one process per device, started by torchrun or train.py
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _refuse(key: str, value: Any, allowed: str) -> None:
    if isinstance(value, bool):
        value = str(value).lower()
    raise UserError(f"{key}={value} is not allowed: use {allowed}.")


def _at_least(key: str, value: int | None, low: int, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if value is None or value < low:
        allowed = f"at least {low}" if low else "0 or more"
        _refuse(key, value, f"null or {allowed}" if nullable else allowed)


# What each annotation of the settings accepts, and how to say it; bool is no number here.
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "a whole number"),
    "int | None": ((int, type(None)), "null or a whole number"),
    "float": ((int, float), "a number"),
    "float | None": ((int, float, type(None)), "null or a number"),
    "str | None": ((str, type(None)), "null or a string"),
    "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"),
    "bool | str": ((bool, str), "true, false or a string"),
}


def _is_a(value: Any, annotation: str) -> bool:
    """Whether `value` is of `annotation` (true is no count, no number)."""
    kinds = _TYPES[annotation][0]
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def _check_type(key: str, value: Any, annotation: str) -> None:
    """Refuse a value that is not of `annotation` (a string for a number, true for a count)."""
    if not _is_a(value, annotation):
        _refuse(key, value, _TYPES[annotation][1])


def _check_types(settings: Any, section: str) -> None:
    """Refuse a value of the wrong type by its key, for each field of `settings`."""
    for f in fields(settings):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if annotation not in _TYPES:  # a field a fork added, of a type not listed above
            raise TypeError(
                f"{section}.{f.name} is annotated {annotation}, which _TYPES in "
                f"src/engine/settings.py does not check: add it there ({', '.join(_TYPES)} are)."
            )
        _check_type(f"{section}.{f.name}", getattr(settings, f.name), annotation)


@dataclass(frozen=True)
class Trainer:
    """`trainer:` of the config (see conf/config.yaml for each key's meaning), and when the
    scheduler steps."""

    epochs: int = 1
    max_steps: int | None = None
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    deterministic: bool = False
    matmul_precision: str = "highest"
    precision: str = "32"
    channels_last: bool = False
    profile: int | None = None
    compile: bool | str = False
    warmup_steps: int = 0
    early_stopping_patience: int | None = None
    test_weights: str = "best"
    step_interval: bool = False  # scheduler.interval=step: the scheduler steps after every step

    def __post_init__(self) -> None:
        _check_types(self, "trainer")
        _at_least("trainer.epochs", self.epochs, 1)
        _at_least("trainer.max_steps", self.max_steps, 1, nullable=True)
        _at_least("trainer.log_every_n_steps", self.log_every_n_steps, 1)
        _at_least("trainer.accumulate_grad_batches", self.accumulate_grad_batches, 1)
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            _refuse(
                "trainer.gradient_clip_val",
                self.gradient_clip_val,
                "null (no clipping) or a norm above 0, e.g. 1.0",
            )
        if self.matmul_precision not in ("highest", "high"):
            _refuse("trainer.matmul_precision", self.matmul_precision, "highest or high")
        if self.precision not in PRECISIONS:
            _refuse("trainer.precision", self.precision, "32, bf16, 16 or 64")
        if self.compile not in (True, False, *COMPILE_MODES):
            _refuse(
                "trainer.compile",
                self.compile,
                f"true, false or a mode: {', '.join(COMPILE_MODES)}",
            )
        _at_least("trainer.profile", self.profile, 1, nullable=True)
        _at_least("trainer.warmup_steps", self.warmup_steps, 0)
        _at_least("trainer.early_stopping_patience", self.early_stopping_patience, 1, nullable=True)
        if self.test_weights not in ("best", "last"):
            _refuse("trainer.test_weights", self.test_weights, "best or last")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Mixed precision's dtype (bf16, 16); None for float32."""
        return PRECISIONS[self.precision]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, the float inputs and the optimizer's state: float64 for
        precision 64, float32 otherwise (bf16 and 16 autocast float32 weights)."""
        return WEIGHTS.get(self.precision, torch.float32)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Mixed precision on `device` for bf16 or 16; nothing at all for 32 and 64."""
        dtype = self.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@dataclass(frozen=True)
class Checkpointing:
    """`checkpoint:` of the config: what to save, when, and what picks the best epoch."""

    save: bool = True
    every_n_steps: int | None = None
    monitor: str = "val/acc"
    mode: str | None = "max"  # null in the config: the way the task says the monitor is better
    sharded: bool = False

    def __post_init__(self) -> None:
        _check_types(self, "checkpoint")
        _at_least("checkpoint.every_n_steps", self.every_n_steps, 1, nullable=True)
        if not self.monitor.startswith("val/"):
            _refuse("checkpoint.monitor", self.monitor, "a metric of the validation split: val/...")
        if self.mode not in (None, "max", "min"):
            _refuse("checkpoint.mode", self.mode, "max, min or null (as the monitor says)")


def checkpoint_mode(monitor: Any, mode: Any, modes: dict[str, str] | None) -> Any:
    """`checkpoint.mode`, or where it is null the way the task's `modes` say `monitor` is better
    (val/loss: min, val/acc: max). A mode against the task's is refused: best.pt would keep the
    worst epoch."""
    declared = (modes or {}).get(str(monitor).removeprefix("val/"))
    if mode is None:
        return declared
    if declared and mode != declared:
        better = "lower" if declared == "min" else "higher"
        raise UserError(
            f"checkpoint.mode={mode} keeps the worst epoch of checkpoint.monitor={monitor}, "
            f"where {better} is better: use checkpoint.mode={declared}, or leave it null (it "
            "follows the monitor)."
        )
    return mode


def checkpoint_mode_of(cfg: DictConfig) -> Any:
    """`checkpoint_mode` of a whole config, the task's `modes` read off its class (not built)."""
    task = get_class(cfg.task._target_) if cfg.get("task") else None
    return checkpoint_mode(cfg.checkpoint.monitor, cfg.checkpoint.mode, task and tasks.modes(task))


def _direction(*, _root_: DictConfig) -> str:
    """`${checkpoint_mode:}` in a config (the Optuna sweeper's direction): max or min."""
    if mode := checkpoint_mode_of(_root_):
        return mode
    raise UserError(
        f"checkpoint.mode is null, and task={_root_.task._target_} does not say whether a higher "
        f"or a lower {_root_.checkpoint.monitor} is better: set checkpoint.mode=max or min."
    )


if not OmegaConf.has_resolver("checkpoint_mode"):
    OmegaConf.register_new_resolver("checkpoint_mode", _direction)


@dataclass(frozen=True)
class Parallel:
    """The `parallel:` keys (checked by `check_parallel`) and `device`: how this process is set
    up and how the model is wrapped. A key a mode's YAML lacks keeps its default here."""

    mode: str = "none"  # none | dp | ddp | fsdp
    device: str = "auto"
    backend: str = "auto"
    init_method: str = "env://"
    timeout: float = 1800
    device_ids: tuple[int, ...] | None = None  # dp
    output_device: int | None = None  # dp
    find_unused_parameters: bool = False  # ddp
    bucket_cap_mb: float = 25
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    sync_batchnorm: bool = False
    shard_modules: tuple[str, ...] = ()  # fsdp
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Checkpoints:
    """Which checkpoint a run starts from: `resume` (auto, a path or None), `init_from` (first
    weights to fine-tune) and `ckpt_path` (the weights `train=false` evaluates)."""

    resume: str | None = "auto"
    init_from: str | None = None
    ckpt_path: str | None = None


@dataclass(frozen=True)
class Settings:
    """Everything below `src/engine/run.py` reads of the config, checked as a whole."""

    trainer: Trainer
    checkpoint: Checkpointing
    task: Any = None  # what is learned: its loss and metrics (src/tasks.py)
    parallel: Parallel = Parallel()
    paths: Checkpoints = Checkpoints()
    train: bool = True
    validates: bool = True  # data.val_size > 0: a validation split is held out
    # DDP: compare the ranks' parameters before each validation and save ("eval"), also every
    # N steps (N), or never (None); see parallel.check_sync_every_n_steps.
    check_sync: int | str | None = None

    def __post_init__(self) -> None:
        monitor, known = self.checkpoint.monitor, tasks.modes(self.task) if self.task else None
        if known and monitor.removeprefix("val/") not in known:
            metrics = " or ".join(f"val/{name}" for name in known)
            raise UserError(f"checkpoint.monitor={monitor} is not a metric this task returns: "
                            f"use {metrics}.")  # fmt: skip
        selects = self.train and self.validates
        if selects and self.checkpoint.mode is None:
            raise UserError(
                f"checkpoint.mode is null, and task={type(self.task).__name__} does not say "
                f"whether a higher or a lower {monitor} is better: set checkpoint.mode=max or min "
                "(or give the task modes, as in src/tasks.py)."
            )
        if self.trainer.early_stopping_patience is not None and not selects:
            raise UserError(
                "trainer.early_stopping_patience watches the validation split, and "
                "data.val_size=0 holds none out: set data.val_size (e.g. 5000) or "
                "trainer.early_stopping_patience=null."
            )
        if selects and self.trainer.test_weights == "best" and not self.checkpoint.save:
            raise UserError(
                "trainer.test_weights=best tests the weights of best.pt, which "
                "checkpoint.save=false does not write: set trainer.test_weights=last, or "
                "checkpoint.save=true."
            )


def _section(cls: type, values: dict[str, Any], **extra: Any) -> Any:
    """`cls` built from the keys of `values` it has (a key the YAML lacks keeps its default)."""
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values}, **extra)


def check_fsdp(cfg: DictConfig) -> None:
    """Refuse what parallel=fsdp does not do: DDP's options, and what FSDP2 does not support."""
    if cfg.parallel.sync_batchnorm:
        raise UserError(
            "parallel.sync_batchnorm=true is DDP's: parallel=fsdp normalises each rank's share by "
            "its own statistics. Use parallel=ddp for SyncBatchNorm, or leave it false."
        )
    if cfg.trainer.channels_last:
        raise UserError(
            "trainer.channels_last=true with parallel=fsdp: this torch's FSDP shards contiguous "
            "parameters only, and channels-last convolution weights are not. Use parallel=ddp "
            "for channels-last, or trainer.channels_last=false."
        )
    if cfg.parallel.find_unused_parameters:
        raise UserError(
            "parallel.find_unused_parameters=true is DDP's: FSDP needs no search for parameters "
            "without a gradient. Leave it false with parallel=fsdp."
        )


# The data keys every dataset config shares: what each takes, and its least value (None: a flag).
_DATA_KEYS: dict[str, tuple[str, int | None]] = {
    "batch_size": ("int", 1),
    "test_batch_size": ("int", 1),
    "subset": ("int | None", 1),
    "num_workers": ("int", 0),
    "split_seed": ("int", 0),
    "seed": ("int", 0),
    "num_classes": ("int", 1),
    "in_channels": ("int", 1),
    "augment": ("bool", None),
    "download": ("bool", None),
    "pin_memory": ("bool", None),
    "persistent_workers": ("bool", None),
}


def check_data(cfg: DictConfig) -> None:
    """Refuse a shared data key of the wrong type or range, a std of 0 and a seed numpy cannot
    take, by its key, before the data is read (`data.augment=no` is a string, not false)."""
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        _refuse("seed", seed, "a whole number, 0 or more")
    for key, (annotation, low) in _DATA_KEYS.items():
        value = cfg.data.get(key)
        if value is None and key not in ("batch_size", "test_batch_size", "seed"):
            continue  # a key this dataset's config leaves out or null
        _check_type(f"data.{key}", value, annotation)
        if low is not None:
            _at_least(f"data.{key}", value, low, nullable="None" in annotation)
    names, classes = cfg.data.get("class_names"), cfg.data.get("num_classes")
    if names is not None and not OmegaConf.is_list(names):
        _refuse("data.class_names", names, "a list of names, [a,b,...], or null")
    if names is not None and isinstance(classes, int) and len(names) != classes:
        raise UserError(
            f"data.class_names has {len(names)} names, and data.num_classes={classes}: give one "
            "name per class, in the order of their numbers (or null: the numbers themselves)."
        )
    root = cfg.data.get("root")
    if root is not None and not isinstance(root, str):
        _refuse("data.root", root, "the path of the data's folder")
    for key in ("mean", "std"):  # a number, or one per channel
        value = cfg.data.get(key)
        if value is None:
            continue
        values = list(value) if OmegaConf.is_list(value) else [value]
        if not all(_is_a(v, "float") for v in values):
            _refuse(f"data.{key}", value, "a number, one per channel ([0.5,0.5,0.5]) or null "
                    "(computed from the training images)")  # fmt: skip
        if key == "std" and any(v <= 0 for v in values):
            _refuse("data.std", value, "the pixels' standard deviation, above 0 (null computes it)")


# The parallel keys each mode's config may have: what each takes (a choice, or a type and its
# least value, exclusive where it is a number of seconds or MiB).
_PARALLEL_KEYS: dict[str, tuple[str, Any]] = {
    "nproc_per_node": ("int | None", 1),
    "backend": ("choice", ("auto", "nccl", "gloo")),
    "init_method": ("choice", ("env://", "tcp://", "file://")),  # the start of the URL
    "timeout": ("float", 0),
    "bucket_cap_mb": ("float", 0),
    "find_unused_parameters": ("bool", None),
    "gradient_as_bucket_view": ("bool", None),
    "static_graph": ("bool", None),
    "sync_batchnorm": ("bool", None),
    "reshard_after_forward": ("bool", None),
}


def check_parallel(cfg: DictConfig) -> None:
    """Refuse a `parallel.*` value of the wrong type, range or choice by its key, before any
    process starts (`parallel.timeout=abc`, `parallel.backend=mpi2`)."""
    for key, (kind, allowed) in _PARALLEL_KEYS.items():
        if key not in cfg.parallel:
            continue
        value, name = cfg.parallel[key], f"parallel.{key}"
        if kind != "choice":
            _check_type(name, value, kind)
            if kind == "int | None":
                _at_least(name, value, allowed, nullable=True)
            elif allowed is not None and not value > allowed:
                _refuse(name, value, f"a number above {allowed}")
        elif key == "init_method":
            _check_init_method(value, allowed)
        elif value not in allowed:
            _refuse(name, value, f"{', '.join(allowed[:-1])} or {allowed[-1]}")


def _check_init_method(value: Any, schemes: tuple[str, ...]) -> None:
    """`parallel.init_method` is env://, tcp://HOST:PORT or file:///PATH (an absolute path)."""
    name = "parallel.init_method"
    if not (isinstance(value, str) and value.startswith(schemes)):
        _refuse(name, value, "env:// (torchrun's variables), tcp://HOST:PORT or file:///PATH")
    url = urlsplit(value)
    try:
        port = url.port
    except ValueError:  # a port above 65535
        port = None
    if url.scheme == "tcp" and not (url.hostname and port):
        _refuse(name, value, "tcp://HOST:PORT, with rank 0's host and a port from 1 to 65535")
    if url.scheme == "file" and (url.netloc or not url.path.startswith("/")):
        _refuse(name, value, "file:///PATH, a file's absolute path on a folder every process sees")


def check_paths(cfg: DictConfig) -> None:
    """`resume` is auto, null or a path; `init_from` and `ckpt_path` null or a path."""
    resume = cfg.get("resume")
    if not (resume is None or isinstance(resume, str)):
        _refuse(
            "resume", resume, "auto (the run folder's last.pt), null (never) or a checkpoint's path"
        )
    for key in ("init_from", "ckpt_path"):
        if not (cfg.get(key) is None or isinstance(cfg.get(key), str)):
            _refuse(key, cfg.get(key), "null or a checkpoint's path")


def read_settings(cfg: DictConfig) -> Settings:
    """The settings of `cfg`; a UserError naming the key for any value training cannot use."""
    for key in cfg.data:  # `???` in the YAML: a value only the user can give
        if OmegaConf.is_missing(cfg.data, key):
            raise UserError(
                f"data.{key} has no value: add data.{key}=... to the command (data=image_folder "
                "needs data.root=PATH, the folder that holds train/ and test/)."
            )
    try:  # a model's keys that name the data's (${data.in_channels}) the data config lacks
        OmegaConf.to_container(cfg.model, resolve=True)
    except InterpolationKeyError as err:
        raise UserError(
            f"{err.full_key} takes the data's {err.key}, and data.dataset="
            f"{cfg.data.get('dataset')} has none (not images?): pick a model that takes the "
            f"data's input_shape, or set {err.full_key}=... yourself."
        ) from None
    check_data(cfg)
    check_parallel(cfg)
    check_paths(cfg)
    val_size = cfg.data.get("val_size", 0)
    share = isinstance(val_size, float) and 0 < val_size < 1
    if not (
        share or isinstance(val_size, int) and not isinstance(val_size, bool) and val_size >= 0
    ):
        _refuse("data.val_size", val_size, "0 (none) or more images, or a share (0.1)")
    interval = cfg.scheduler.get("interval")
    if interval not in ("epoch", "step"):
        _refuse("scheduler.interval", interval, "epoch or step")
    if cfg.parallel.mode == "fsdp":
        check_fsdp(cfg)
    elif cfg.checkpoint.get("sharded"):
        raise UserError(
            "checkpoint.sharded=true writes each FSDP rank's shards, and parallel="
            f"{cfg.parallel.mode} holds whole weights: use parallel=fsdp, or leave it false."
        )
    if cfg.parallel.get("sync_batchnorm", False) and cfg.parallel.mode != "ddp":
        raise UserError(
            "parallel.sync_batchnorm=true syncs BatchNorm's statistics across DDP processes, "
            f"and parallel={cfg.parallel.mode} trains in one: use parallel=ddp, or leave it false."
        )
    if cfg.parallel.get("static_graph") and cfg.trainer.get("accumulate_grad_batches", 1) > 1:
        raise UserError(
            "parallel.static_graph=true cannot skip the all-reduce of accumulated micro-batches "
            "(DDP's no_sync asserts, pytorch/pytorch#143580): use parallel.static_graph=false with "
            "trainer.accumulate_grad_batches."
        )
    if cfg.parallel.get("sync_batchnorm", False) and (
        str(cfg.device).startswith(("cpu", "mps")) or not torch.cuda.is_available()
    ):
        raise UserError(
            "parallel.sync_batchnorm=true needs CUDA GPUs: PyTorch's SyncBatchNorm runs only "
            "there. Leave it false on CPUs (each rank then normalises by its own share's "
            "statistics)."
        )
    if not cfg.train and cfg.ckpt_path is None:
        raise UserError("train=false evaluates a checkpoint: add ckpt_path=PATH.")
    if cfg.train and cfg.ckpt_path is not None:
        raise UserError(
            "ckpt_path is the checkpoint to evaluate with train=false. To continue training from "
            "it use resume=PATH; to start from its weights, init_from=PATH."
        )
    check_sync = cfg.parallel.get("check_sync_every_n_steps")
    steps = isinstance(check_sync, int) and not isinstance(check_sync, bool) and check_sync >= 1
    if not (steps or check_sync in (None, "eval")):
        _refuse(
            "parallel.check_sync_every_n_steps",
            check_sync,
            "eval (before each validation and save), N of 1 or more (also every N steps) or null",
        )
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer["precision"] = str(trainer["precision"])  # 32 and 16 come from YAML as numbers
    checkpoint = _section(Checkpointing, OmegaConf.to_container(cfg.checkpoint, resolve=True))
    task = tasks.build(cfg.task)
    mode = checkpoint_mode(checkpoint.monitor, checkpoint.mode, tasks.modes(task))
    parallel = OmegaConf.to_container(cfg.parallel, resolve=True)
    for key in ("device_ids", "shard_modules"):  # lists in the YAML, frozen here
        if parallel.get(key) is not None:
            parallel[key] = tuple(parallel[key])
    return Settings(
        trainer=_section(Trainer, trainer, step_interval=interval == "step"),
        checkpoint=replace(checkpoint, mode=mode),
        task=task,
        parallel=_section(Parallel, parallel, device=str(cfg.device)),
        paths=Checkpoints(cfg.resume, cfg.init_from, cfg.ckpt_path),
        train=cfg.train,
        validates=val_size > 0,
        check_sync=check_sync if cfg.parallel.mode == "ddp" else None,
    )
