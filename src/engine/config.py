"""The config's schema: the engine's keys, each with its type, default and comment, written once.

The dataclasses below are registered in Hydra's ConfigStore as `schema`, the first entry of
conf/config.yaml's defaults: Hydra checks each value's type as it composes, and the YAML files in
conf/ are presets that set values. Each section checks its ranges and choices where it is built
(`__post_init__`); `read_settings` builds them from a composed config and checks the keys
against each other. The keys of what a group names by `_target_` (a model, an optimizer, a
parallel strategy, a dataset class) are that class's own parameters.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from src.engine import parallel
from src.engine.errors import UserError, at_least, instantiated, refuse, typed
from src.engine.parallel.none import Single

# Each precision's autocast dtype (None: none), and the dtype of the weights and float inputs.
PRECISIONS = {"64": None, "32": None, "bf16": torch.bfloat16, "16": torch.float16}
WEIGHTS = {"64": torch.float64}  # the others keep float32 weights (mixed precision autocasts)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class Trainer:
    """`trainer:` how training runs."""

    epochs: int = 1  # passes over the training set
    max_steps: int | None = None  # null, or stop after this many optimizer steps in total
    # Write train/loss and train/grad_norm to metrics.jsonl (and wandb) every this many steps.
    log_every_n_steps: int = 10
    # Split each process's share of a batch into this many micro-batches (less memory; DDP
    # all-reduces once, after the last).
    accumulate_grad_batches: int = 1
    # null, or clip the gradients' global norm to this value before each optimizer step.
    gradient_clip_val: float | None = None
    # Deterministic kernels only (torch.use_deterministic_algorithms): repeatable, maybe slower;
    # false lets cuDNN autotune.
    deterministic: bool = False
    # float32 matmuls: highest (full float32) or high (TF32 on GPUs that have it: faster, about
    # 1e-3 relative).
    matmul_precision: str = "highest"
    # 32 = float32; bf16 = bfloat16 autocast; 16 = float16 autocast with a gradient scaler;
    # 64 = float64 weights, inputs and optimizer state (exact comparisons, slow).
    precision: str = "32"
    # Keep the model's (and the images') tensors channels-last: faster convolutions on GPUs.
    channels_last: bool = False
    # null, or trace this many training steps with torch.profiler into profile/ of the run folder.
    profile: int | None = None
    # torch.compile the model: true, or a mode (reduce-overhead, max-autotune).
    compile: Any = False
    # Train this many steps (and evaluate once) before the clock starts, then undo them:
    # compilation and autotuning happen there.
    warmup_steps: int = 0
    # null, or stop after this many validations in a row without improving checkpoint.monitor.
    early_stopping_patience: int | None = None
    # The weights the test split is evaluated on, once, after training: best (best.pt, by
    # checkpoint.monitor) or last.
    test_weights: str = "best"

    def __post_init__(self) -> None:
        at_least("trainer.epochs", self.epochs, 1)
        at_least("trainer.max_steps", self.max_steps, 1, nullable=True)
        at_least("trainer.log_every_n_steps", self.log_every_n_steps, 1)
        at_least("trainer.accumulate_grad_batches", self.accumulate_grad_batches, 1)
        if self.gradient_clip_val is not None and not self.gradient_clip_val > 0:
            refuse("trainer.gradient_clip_val", self.gradient_clip_val,
                   "null (no clipping) or a norm above 0, e.g. 1.0")  # fmt: skip
        if self.matmul_precision not in ("highest", "high"):
            refuse("trainer.matmul_precision", self.matmul_precision, "highest or high")
        if self.precision not in PRECISIONS:
            refuse("trainer.precision", self.precision, "32, bf16, 16 or 64")
        if self.compile not in (True, False, *COMPILE_MODES):
            refuse("trainer.compile", self.compile,
                   f"true, false or a mode: {', '.join(COMPILE_MODES)}")  # fmt: skip
        at_least("trainer.profile", self.profile, 1, nullable=True)
        at_least("trainer.warmup_steps", self.warmup_steps, 0)
        at_least("trainer.early_stopping_patience", self.early_stopping_patience, 1, nullable=True)
        if self.test_weights not in ("best", "last"):
            refuse("trainer.test_weights", self.test_weights, "best or last")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Mixed precision's dtype (bf16, 16); None for float32 and float64."""
        return PRECISIONS[self.precision]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, the float inputs and the optimizer's state."""
        return WEIGHTS.get(self.precision, torch.float32)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def autocast(self, device: torch.device) -> AbstractContextManager:
        """Mixed precision on `device` for bf16 or 16; nothing at all for 32 and 64."""
        dtype = self.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@dataclass
class Checkpointing:
    """`checkpoint:` what is saved, when, and what picks the best epoch."""

    # Write checkpoints/last.pt in the run folder after every epoch, and best.pt by the monitor.
    save: bool = True
    # null, or also write last.pt every this many optimizer steps within an epoch.
    every_n_steps: int | None = None
    # The validation metric that picks best.pt, early stopping and a sweep's best job: any val/
    # metric the task returns (val/acc, val/loss, ...).
    monitor: str = "val/acc"
    # max or min: whether a higher or a lower value of the monitor is better; null: as the task
    # says (val/acc max, val/loss and val/mae min).
    mode: str | None = None
    # parallel=fsdp: each rank writes its own shards (torch.distributed.checkpoint) into a folder
    # the .pt names, for models too large to gather on one rank.
    sharded: bool = False

    def __post_init__(self) -> None:
        at_least("checkpoint.every_n_steps", self.every_n_steps, 1, nullable=True)
        if not self.monitor.startswith("val/"):
            refuse("checkpoint.monitor", self.monitor, "a metric of the validation split: val/...")
        if self.mode not in (None, "max", "min"):
            refuse("checkpoint.mode", self.mode, "max, min or null (as the monitor says)")


@dataclass
class Paths:
    """`paths:` where things are."""

    root_dir: str = "${oc.env:PROJECT_ROOT,.}"  # the repository root (train.py sets PROJECT_ROOT)
    data_dir: str = "${paths.root_dir}/data"  # default home of the datasets
    log_dir: str = "${paths.root_dir}/outputs"  # where the run folders go


@dataclass
class DataKeys:
    """`data:` the keys every dataset shares (src/engine/data.py's `Data`). A `conf/data/` file
    sets them and adds the keys of its `dataset` class, which this section leaves open."""

    _target_: str = "src.engine.data.Data"  # holds the splits and batches them, for every dataset
    dataset: str = "???"  # the class that finds the files and reads them (src/datasets.py, yours)
    download: bool = False  # download the files when they are missing (where the class can)
    in_channels: int | None = None  # colour channels of an image (null: the data's own)
    image_size: int | None = None  # height and width of an image in pixels (null: the data's own)
    num_classes: int | None = None  # number of labels, the models' outputs (null: as found)
    class_names: list[str] | None = None  # a name per label, for predictions.png (null: numbers)
    # Pixel mean and std (0-1 scale), one number or one per channel, for normalisation; null:
    # computed from the training images (and logged, to copy here).
    mean: Any = None
    std: Any = None
    # true: random crop (padding image_size/8) and horizontal flip of each training image.
    augment: bool = False
    batch_size: int = 64  # global batch per optimizer step; each rank takes batch_size / ranks
    test_batch_size: int = 1000  # evaluation batch per process
    subset: int | None = None  # null, or train on the first N training images only
    # Training images held out for validation: a number, or a share (0.1); 0 = none.
    val_size: Any = 5000
    # Seeds which training images are held out: not `seed`, so every job and parallel mode
    # validates on the same ones.
    split_seed: int = 0
    seed: int = (
        "${seed}"  # seeds the sample order: DistributedSampler's permutation of seed + epoch
    )
    # tensor = each split one tensor on the device, batches gathered by index; torch =
    # DataLoader, one sample at a time (for data that does not fit in memory).
    loader: str = "tensor"
    num_workers: int = 0  # loader=torch: worker processes reading samples (0 = in this process)
    pin_memory: bool = False  # loader=torch: page-locked batches, copied to the GPU asynchronously
    persistent_workers: bool = False  # loader=torch: keep the workers between epochs

    def __post_init__(self) -> None:
        for key in ("batch_size", "test_batch_size"):
            at_least(f"data.{key}", getattr(self, key), 1)
        for key in ("subset", "num_classes", "in_channels", "image_size"):
            at_least(f"data.{key}", getattr(self, key), 1, nullable=True)
        for key in ("num_workers", "split_seed", "seed"):
            if not str(getattr(self, key)).startswith("${"):  # the schema's own ${seed}
                at_least(f"data.{key}", getattr(self, key), 0)
        if self.loader not in ("tensor", "torch"):
            refuse("data.loader", self.loader, "tensor or torch")
        names, classes = self.class_names, self.num_classes
        if names is not None and classes is not None and len(names) != classes:
            raise UserError(
                f"data.class_names has {len(names)} names, and data.num_classes={classes}: give "
                "one name per class, in the order of their numbers (or null: the numbers "
                "themselves)."
            )
        for key in ("mean", "std"):  # a number, or one per channel
            value = getattr(self, key)
            values = value if isinstance(value, list) else [value]
            if value is not None and not all(is_number(v) for v in values):
                refuse(f"data.{key}", value, "a number, one per channel ([0.5,0.5,0.5]) or null "
                       "(computed from the training images)")  # fmt: skip
            if key == "std" and value is not None and any(v <= 0 for v in values):
                refuse("data.std", value, "the pixels' standard deviation, above 0 (null "
                       "computes it)")  # fmt: skip
        share = isinstance(self.val_size, float) and 0 < self.val_size < 1
        if not (share or is_number(self.val_size, int) and self.val_size >= 0):
            refuse("data.val_size", self.val_size, "0 (none) or more images, or a share (0.1)")


@dataclass
class ScheduleKeys:
    """`scheduler:` the class (`_target_`, given the optimizer) and its keys, and when it steps."""

    _target_: str | None = None  # the scheduler class; null = a constant learning rate
    interval: str = "epoch"  # call scheduler.step() after every: epoch | step

    def __post_init__(self) -> None:
        if self.interval not in ("epoch", "step"):
            refuse("scheduler.interval", self.interval, "epoch or step")


@dataclass
class Config:
    """The whole run: the engine's sections above, the groups (each a class and its keys), and
    the run's own keys."""

    task_name: str = "train"  # what kind of run this is; recorded with the run and given to wandb
    tags: list[str] = field(default_factory=list)  # labels of the run, recorded and given to wandb
    # Seeds the weights, the sample order and dropout (whose stream is seed + rank on each rank).
    seed: int = 1
    device: str = "auto"  # auto = cuda, then mps, then cpu; or name one: cpu, cuda, cuda:1, mps
    # false: only evaluate the weights of ckpt_path, on the validation and test splits.
    train: bool = True
    # auto = continue from checkpoints/last.pt of the run folder if there is one; a checkpoint's
    # path; null = start fresh.
    resume: Any = "auto"
    # A checkpoint or a model's state_dict to take the first weights from (fine-tuning); the
    # optimizer and the schedule start fresh.
    init_from: Any = None
    ckpt_path: Any = None  # with train=false: the checkpoint (or state_dict) to evaluate
    # At the end, write curves.png and predictions.png in the run folder (and log them to wandb).
    plots: bool = True
    trainer: Trainer = field(default_factory=Trainer)
    checkpoint: Checkpointing = field(default_factory=Checkpointing)
    paths: Paths = field(default_factory=Paths)
    data: DataKeys = field(default_factory=DataKeys)
    scheduler: ScheduleKeys = field(default_factory=ScheduleKeys)
    model: Any = None  # the groups of conf/: a class (`_target_`) and its own keys each
    task: Any = None
    optimizer: Any = None
    parallel: Any = None
    logger: Any = None
    debug: Any = None  # a debugging set-up's keys (conf/debug/)


def register() -> None:
    """`schema` in Hydra's ConfigStore, with the sections a group's file adds keys to open; and
    each of the engine's strategies as `schema/parallel/<mode>`, its fields and `_target_`, which
    `conf/parallel/<mode>.yaml` starts from."""
    store = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    for open_section in ("data", "scheduler"):  # a dataset's, a scheduler class's own keys
        OmegaConf.set_struct(schema[open_section], False)
    store.store(name="schema", node=schema)
    for cls in parallel.strategies():
        target = field(default=f"{cls.__module__}.{cls.__qualname__}")
        keys = dataclasses.make_dataclass(f"{cls.__name__}Keys", [("_target_", str, target)],
                                          bases=(cls,))  # fmt: skip
        node = OmegaConf.structured(keys)
        OmegaConf.set_struct(node, False)  # a fork's variant of a mode adds keys of its own
        store.store(group="schema/parallel", name=cls.name, node=node)


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
    parallel: parallel.Strategy = field(default_factory=Single)  # the parallel mode's strategy
    paths: Checkpoints = Checkpoints()
    device: str = "auto"
    train: bool = True
    validates: bool = True  # data.val_size > 0: a validation split is held out

    def __post_init__(self) -> None:
        monitor, known = self.checkpoint.monitor, modes(self.task)
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
        if not self.train and self.paths.ckpt_path is None:
            raise UserError("train=false evaluates a checkpoint: add ckpt_path=PATH.")
        if self.train and self.paths.ckpt_path is not None:
            raise UserError(
                "ckpt_path is the checkpoint to evaluate with train=false. To continue training "
                "from it use resume=PATH; to start from its weights, init_from=PATH."
            )
        self.parallel.check(self)


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
    if not (is_number(cfg.seed, int) and cfg.seed >= 0):
        refuse("seed", cfg.seed, "a whole number, 0 or more")
    if not (cfg.resume is None or isinstance(cfg.resume, str)):
        refuse("resume", cfg.resume,
               "auto (the run folder's last.pt), null (never) or a checkpoint's path")  # fmt: skip
    for key in ("init_from", "ckpt_path"):
        if not (cfg[key] is None or isinstance(cfg[key], str)):
            refuse(key, cfg[key], "null or a checkpoint's path")
    if not isinstance(cfg.data.get("root", ""), str):  # the folder of a dataset that reads files
        refuse("data.root", cfg.data.root, "the path of the data's folder")
    shared = {f.name for f in dataclasses.fields(DataKeys)}
    data = typed(DataKeys, {k: v for k, v in cfg_dict(cfg.data).items() if k in shared}, "data")
    typed(ScheduleKeys, {"interval": cfg.scheduler.get("interval")}, "scheduler")
    checkpoint = typed(Checkpointing, cfg.checkpoint, "checkpoint")
    task = build_task(cfg.task)
    checkpoint.mode = checkpoint_mode(checkpoint.monitor, checkpoint.mode, modes(task))
    return Settings(
        trainer=typed(Trainer, cfg.trainer, "trainer"),
        checkpoint=checkpoint,
        parallel=parallel.build(cfg.parallel),
        task=task,
        paths=Checkpoints(cfg.resume, cfg.init_from, cfg.ckpt_path),
        device=cfg.device,
        train=cfg.train,
        validates=data.val_size > 0,
    )


def cfg_dict(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def is_number(value: Any, kind: type = float) -> bool:
    """`value` is a number (of `kind`: int for a count); true is neither."""
    kinds = (int,) if kind is int else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


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


def modes(task: Any) -> dict[str, str] | None:
    """The task's (or its class's) metrics, each with `max` or `min` (None: it does not say)."""
    return dict(getattr(task, "modes", None) or {}) or None


def checkpoint_mode(monitor: Any, mode: Any, known: dict[str, str] | None) -> Any:
    """`checkpoint.mode`, or where it is null the way the task's `modes` say `monitor` is better
    (val/loss: min, val/acc: max). A mode against the task's is refused: best.pt would keep the
    worst epoch."""
    declared = (known or {}).get(str(monitor).removeprefix("val/"))
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
    return checkpoint_mode(cfg.checkpoint.monitor, cfg.checkpoint.mode, modes(task))


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
register()
