"""The config's schema, registered as `schema` (the first of conf/config.yaml's defaults; conf/'s
YAML files are presets): the engine's keys, each with its type, default and comment, written once.
Hydra checks the types as it composes (a command line's, `check_command_line` first, in a sentence),
each section its ranges and choices as it is built. The keys of what a group names by `_target_` (a
model, an optimizer, a dataset) are that class's own."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from argparse import ArgumentError
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import torch
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig, OmegaConf, ValidationError

from src.engine import parallel
from src.engine.errors import Checked, UserError, above, checked, least, not_allowed, one_of, refuse
from src.engine.parallel.none import Single

MAX_SEED = 2**32 - 2**16  # NumPy takes seeds below 2**32; room for a rank's number added to it
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class Trainer(Checked):
    """`trainer:` how training runs."""

    section = "trainer"
    epochs: int = least(1, 1)  # passes over the training set
    max_steps: int | None = least(1, None, nullable=True)  # or stop after this many steps in all
    log_every_n_steps: int = least(1, 10)  # train/loss, grad_norm to metrics.jsonl every N steps
    log_every_n_epochs: int = least(1, 1)  # the "epoch N trained" line every N epochs, and the last
    accumulate_grad_batches: int = least(1, 1)  # split each rank's batch into N micro-batches
    # null, or clip the gradients' global norm to this value before each optimizer step.
    gradient_clip_val: float | None = above(0, None, "no clipping", "a norm above 0, e.g. 1.0")
    deterministic: bool = False  # repeatable kernels, maybe slower; false lets cuDNN autotune
    # float32 matmuls: highest (full float32) or high (TF32 where the GPU has it: faster, ~1e-3).
    matmul_precision: str = one_of("highest", "high", default="highest")
    # 32 = float32; bf16 or 16 = autocast (16 with a gradient scaler); 64 = float64 (exact, slow).
    precision: str = one_of("32", "bf16", "16", "64", default="32")
    channels_last: bool = False  # the model's and images' tensors channels-last: faster on GPUs
    # null, or trace this many training steps with torch.profiler into profile/ of the run folder.
    profile: int | None = least(1, None, nullable=True)
    # torch.compile the model: true, or a mode.
    compile: Any = one_of(True, False, *COMPILE_MODES, default=False,
                          said=f"true, false or a mode: {', '.join(COMPILE_MODES)}")  # fmt: skip
    # Train this many steps (and evaluate once) to compile and autotune, then undo them.
    warmup_steps: int = least(0, 0)
    # null, or stop after this many validations in a row without improving checkpoint.monitor.
    early_stopping_patience: int | None = least(1, None, nullable=True)
    # The weights tested once after training: best (best.pt, by checkpoint.monitor) or last; with
    # callbacks=ema, the average of those (best.pt's, which picked it), unless ema's evaluate=raw.
    test_weights: str = one_of("best", "last", default="best")
    # The parameters optimizer.weight_decay applies to: all (torch's default), or matrices, those
    # of 2 or more dimensions (linear and convolution weights, embeddings), not biases and
    # normalisation layers (nanoGPT's rule). A model's own param_groups(weight_decay) comes first.
    weight_decay_on: str = one_of("all", "matrices", default="all")

    def __post_init__(self) -> None:
        super().__post_init__()
        # Read on every step. bf16 and 16 autocast, their weights float32; 64 is float64 throughout.
        self.autocast_dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(self.precision)
        self.dtype = torch.float64 if self.precision == "64" else torch.float32
        self.memory_format = torch.channels_last if self.channels_last else torch.contiguous_format


@dataclass
class Checkpointing(Checked):
    """`checkpoint:` what is saved, when, and what picks the best epoch."""

    section = "checkpoint"
    save: bool = True  # write checkpoints/last.pt after every epoch, and best.pt by the monitor
    every_n_steps: int | None = least(1, None, nullable=True)  # or also last.pt every N steps
    # The val/ metric that picks best.pt, early stopping, a sweep's best.
    monitor: str = checked(lambda v: v.startswith("val/"), "val/acc",
                           "a metric of the validation split: val/...")  # fmt: skip
    # max or min: whether a higher or lower monitor is better; null: as the task says (loss: min).
    mode: str | None = one_of("max", "min", None, default=None,
                              said="max, min or null (as the monitor says)")  # fmt: skip
    # parallel=fsdp: each rank writes its shards into a folder .pt names (models too large for one).
    sharded: bool = False


@dataclass
class Paths:
    """`paths:` where things are."""

    root_dir: str = "${oc.env:PROJECT_ROOT,.}"  # the repository root (train.py sets PROJECT_ROOT)
    data_dir: str = "${paths.root_dir}/data"  # default home of the datasets
    log_dir: str = "${paths.root_dir}/outputs"  # where the run folders go


@dataclass
class DataKeys(Checked):
    """`data:` the keys every dataset shares, `_target_` and `Data`'s own (src/engine/data.py's
    `Data` is this section, built), beside which a dataset class's own keys go."""

    section = "data"
    _target_: str = "src.engine.data.Data"  # holds the splits and batches them, for every dataset
    dataset: str = "???"  # the class that finds the files and reads them (src/datasets.py, yours)
    download: bool = False  # download the files when they are missing (where the class can)
    in_channels: int | None = least(1, None, nullable=True)  # an image's channels; null: found
    image_size: int | None = least(1, None, nullable=True)  # height and width; null: found
    num_classes: int | None = least(1, None, nullable=True)  # the models' outputs; null: found
    class_names: list[str] | None = None  # a name per label, for predictions.png (null: numbers)
    # Pixel mean and std (0-1 scale), one or one per channel; null: computed from train, logged.
    mean: Any = None
    std: Any = None
    # true: random crop (padding image_size/8) and horizontal flip of each training image.
    augment: bool = False
    batch_size: int = least(1, 64)  # global batch per optimizer step; each rank takes its share
    test_batch_size: int = least(1, 1000)  # evaluation batch per process
    subset: int | None = least(1, None, nullable=True)  # or train on the first N images only
    # or evaluate the first N images of the validation and test splits only (debug=fast)
    eval_subset: int | None = least(1, None, nullable=True)
    # Images held out of train for validation, or a share (0.1); 0 = none.
    val_size: Any = checked(lambda v: type(v) is int and v >= 0 or type(v) is float and 0 < v < 1,
                            5000, "0 (none) or more images, or a share (0.1)")  # fmt: skip
    # Which images are held out (not `seed`: every job and parallel mode validates on the same).
    split_seed: int = least(0, 0)
    seed: int = least(0, "${seed}")  # the sample order: DistributedSampler's, from seed + epoch
    # tensor = each split one tensor on the device; torch = DataLoader (data too large for memory).
    loader: str = one_of("tensor", "torch", default="tensor")
    num_workers: int = least(0, 0)  # loader=torch: worker processes reading samples
    pin_memory: bool = False  # loader=torch: page-locked batches, copied to the GPU asynchronously
    persistent_workers: bool = False  # loader=torch: keep the workers between epochs

    def __post_init__(self) -> None:
        super().__post_init__()
        names, classes = self.class_names, self.num_classes
        if names is not None and classes is not None and len(names) != classes:
            raise UserError(
                f"data.class_names has {len(names)} names, and data.num_classes={classes}: give "
                "one name per class, in the order of their numbers (or null: the numbers "
                "themselves)."
            )
        for key in ("mean", "std"):  # a number, or one per channel
            value = getattr(self, key)
            values = list(value) if isinstance(value, list | ListConfig) else [value]
            if value is not None and not all(type(v) in (int, float) for v in values):  # no bool
                refuse(f"data.{key}", value, "a number, one per channel ([0.5,0.5,0.5]) or null "
                       "(computed from the training images)")  # fmt: skip
            if key == "std" and value is not None and any(v <= 0 for v in values):
                refuse("data.std", value, "the pixels' standard deviation, above 0 (null "
                       "computes it)")  # fmt: skip


@dataclass
class ScheduleKeys(Checked):
    """`scheduler:` the class (`_target_`, given the optimizer) and its keys, and when it steps."""

    section = "scheduler"
    _target_: str | None = None  # the scheduler class; null = a constant learning rate
    interval: str = one_of("epoch", "step", default="epoch")  # scheduler.step() after each


@dataclass
class Start(Checked):
    """The run's own keys: what it trains from, where, and whether it trains at all."""

    # Seeds the weights, the sample order and dropout (whose stream is seed + rank on each rank).
    seed: int = checked(lambda v: 0 <= v <= MAX_SEED, 1, f"a whole number from 0 to {MAX_SEED}")
    device: str = "auto"  # auto = cuda, then mps, then cpu; or name one: cpu, cuda, cuda:1, mps
    train: bool = True  # false: only evaluate ckpt_path's weights, on the val and test splits
    # auto = continue from the run folder's checkpoints/last.pt if any; a checkpoint; null = fresh.
    resume: Any = checked(lambda v: isinstance(v, str), "auto", "auto (the run folder's last.pt), "
                          "null (never) or a checkpoint's path", True, null="")  # fmt: skip
    # A checkpoint or state_dict to start the weights from (fine-tuning); the rest starts fresh.
    init_from: Any = checked(lambda v: isinstance(v, str), None, "a checkpoint's path", True)
    # With train=false: the checkpoint (or state_dict) to evaluate.
    ckpt_path: Any = checked(lambda v: isinstance(v, str), None, "a checkpoint's path", True)


@dataclass
class Config(Start):
    """The whole run: its own keys (`Start`'s), the engine's sections and the groups of conf/."""

    task_name: str = "train"  # what kind of run this is; recorded with the run and given to wandb
    tags: list[str] = field(default_factory=list)  # labels of the run, recorded and given to wandb
    plots: bool = True  # at the end write curves.png, predictions.png (and log them to wandb)
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
    callbacks: Any = None  # what the loop calls at its named points: {name: a class and its keys}
    debug: Any = None  # a debugging set-up's keys (conf/debug/)


def register() -> DictConfig:
    """`schema` in Hydra's ConfigStore (sections a group adds keys to open), and each strategy as
    `schema/parallel/<mode>`, its fields and `_target_`, which conf/parallel/<mode>.yaml extends;
    returns `schema`."""
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
    return schema


@dataclass(frozen=True)
class Settings:
    """Everything below `src/engine/app.py` reads of the config, checked as a whole."""

    trainer: Trainer
    checkpoint: Checkpointing
    task: Any = None  # what is learned: its loss and metrics (src/tasks.py)
    parallel: parallel.Strategy = field(default_factory=Single)  # the parallel mode's strategy
    paths: Start = field(default_factory=Start)  # seed, device, train, the checkpoints: the Config
    validates: bool = True  # data.val_size > 0: a validation split is held out
    config: dict[str, Any] = field(default_factory=dict)  # all of it, resolved: the run's record
    train: bool = True  # train, or only evaluate ckpt_path (the config's `train`)
    device: str = "auto"  # the config's `device`

    def __post_init__(self) -> None:
        paths = self.paths  # where training starts from, or what it evaluates
        if paths.init_from is not None and paths.resume not in (None, "auto"):
            raise UserError(
                f"resume={paths.resume} continues a run, its weights included, and init_from="
                f"{paths.init_from} starts a new one from a file's weights: give one of them."
            )
        if not self.train and paths.ckpt_path is None:
            raise UserError("train=false evaluates a checkpoint: add ckpt_path=PATH.")
        if self.train and paths.ckpt_path is not None:
            raise UserError(
                "ckpt_path is the checkpoint to evaluate with train=false. To continue training "
                "from it use resume=PATH; to start from its weights, init_from=PATH."
            )
        monitor, known = self.checkpoint.monitor, getattr(self.task, "modes", None)
        self.checkpoint.mode = checkpoint_mode(monitor, self.checkpoint.mode, self.task)
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
        self.parallel.check(self)


def checkpoint_mode(monitor: Any, mode: Any, task: Any) -> Any:
    """`checkpoint.mode`, or where null the `task`'s (or its class's) `modes` for `monitor` (its
    metrics, each with `max` or `min`); one against the task's is refused (best.pt would keep the
    worst epoch)."""
    declared = (getattr(task, "modes", None) or {}).get(str(monitor).removeprefix("val/"))
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


def direction(*, _root_: DictConfig) -> str:
    """`${checkpoint_mode:}` in a config (the Optuna sweeper's direction): max or min, the
    `checkpoint_mode` of the whole config, the task's `modes` read off its class (not built)."""
    task = get_class(_root_.task._target_) if _root_.get("task") else None
    if mode := checkpoint_mode(_root_.checkpoint.monitor, _root_.checkpoint.mode, task):
        return mode
    raise UserError(
        f"checkpoint.mode is null, and task={_root_.task._target_} does not say whether a higher "
        f"or a lower {_root_.checkpoint.monitor} is better: set checkpoint.mode=max or min."
    )


def _gpus_per_node(*, _root_: DictConfig) -> int:
    """`${gpus_per_node:}` (conf/hydra/launcher/slurm.yaml): one GPU per process the job starts
    (`parallel.nproc_per_node`), else one: a job that asks for none trains on the node's CPU."""
    return OmegaConf.select(_root_, "parallel.nproc_per_node") or 1


def check_command_line(args: list[str]) -> str | None:
    """The sentence that refuses a value on the command line (`args`, those after the script's
    name) of a type its key does not take (`trainer.epochs=abc`, a sweep's `trainer.epochs=1,abc`),
    to say before Hydra composes, whose own would be 5 lines; None where each value fits, and with
    HYDRA_FULL_ERROR=1 (Hydra then says its own). Each value is merged as Hydra merges it, into the
    schema (a `parallel.` key: into the chosen mode's, else into each mode's that types it); a key
    the schema does not type (a class's own, an unknown one) is left to its own check."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return None
    parser = get_args_parser()
    parser.exit_on_error = False  # a mistaken flag is Hydra's to tell
    try:
        overrides = OverridesParser.create().parse_overrides(
            parser.parse_known_args(args)[0].overrides
        )
    except (ArgumentError, HydraException):  # a command line Hydra cannot read: it says why
        return None
    modes = {cls.name: cls for cls in parallel.strategies()}
    chosen = [modes[o.value()] for o in overrides if o.key_or_group == "parallel"
              and not o.is_sweep_override() and str(o.value()) in modes]  # fmt: skip
    config = copy.deepcopy(SCHEMA)  # what the command line has set so far, as Hydra merges it
    for override in overrides:
        # Not merged into the schema's types: `~key`, `+key`, `key@package`, an interval to sample,
        # a key outside the schema (hydra.*).
        key, nodes = override.key_or_group, [config]
        skip = override.is_delete() or override.is_add() or override.package
        if skip or override.is_interval_sweep() or key.split(".")[0] not in config:
            continue
        if key.startswith("parallel."):  # the chosen mode's keys, else those of any mode
            nodes = [OmegaConf.structured(cls) for cls in chosen[-1:] or modes.values()]
        values = [(override.input_line.split("=", 1)[1], override.value())]
        if override.is_sweep_override():  # each value, as written and as read
            values = zip(override.sweep_string_iterator(), override.sweep_iterator(), strict=True)
            values = [(str(v).lower() if isinstance(v, bool) else shown, v) for shown, v in values]
        for shown, value in values:
            fits, said = False, None
            for node in nodes:
                try:
                    OmegaConf.update(node, key.removeprefix("parallel."), value, merge=True)
                    fits = True
                except ValidationError as err:  # its own key's, not one inside a dict it sets
                    if str(err.key) == key.rpartition(".")[2]:
                        said = said or _takes(err.object_type, err.key)
                except Exception:  # noqa: BLE001 - no key of its (a group's, a list's): not typed there
                    pass
            if said and not fits:
                return not_allowed(key, shown, said)
    return None


# What a key of each type takes, in words.
KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string"}
LISTS = {int: "a list of whole numbers, [1,2]", float: "a list of numbers, [0.5,1.5]"}


def _takes(schema: type, name: str) -> str | None:
    """What the field `name` of the dataclass `schema` takes, in words: null first where it may be
    null, then its type and the range it was declared with (`least`, `between`...), or its choices
    (`one_of`); None where it takes any value, or is a section (a group's choice)."""
    # Annotations are strings here: evaluated. A list's item has no dataclass: any value.
    hint = get_type_hints(schema).get(name) if dataclasses.is_dataclass(schema) else Any
    if hint is Any or dataclasses.is_dataclass(hint):
        return None
    declared = next(f.metadata for f in dataclasses.fields(schema) if f.name == name)
    nullable = type(None) in get_args(hint)  # `int | None`
    kind = next(a for a in get_args(hint) if a is not type(None)) if nullable else hint
    null = declared.get("null said", "null or " if nullable else "")
    said = declared.get("range", "")
    if said.startswith(("a ", "an ")) or said and kind is str:  # says its type; its choices
        return null + said
    if get_origin(kind) is list:
        takes = LISTS.get(next(iter(get_args(kind)), Any), "a list, [a,b]")
    else:
        takes = KINDS.get(kind, f"a {getattr(kind, '__name__', kind)}")
    return null + (f"{takes}, {said}" if said else takes)


def run_name(task_name: str) -> str:
    """`${run_name:${task_name}}`, logger.name's default: `task_name`, a sweep job's number (#0),
    then the job's overrides as Hydra took them, the swept ones first, cut at 128 characters from
    the end."""
    if not HydraConfig.initialized():  # composed outside a Hydra run (the compose API)
        return task_name
    hydra, words = HydraConfig.get(), [task_name]
    overrides = list(hydra.overrides.task)
    if hydra.mode == RunMode.MULTIRUN:  # the job's number tells the sweep's jobs apart
        words.append(f"#{hydra.job.num}")
        keys = swept(hydra.sweeper.get("params") or {})
        overrides.sort(key=lambda override: override.split("=", 1)[0] not in keys)  # stable
    return cut(" ".join(words + overrides))


def swept(params: dict[str, str]) -> set[str]:
    """The keys a sweep varies, which a job's config does not record: its sweeper's `params`
    (Optuna's search space) and the command line's sweeps (a=1,2), which a job in a process of its
    own (submitit's) does not see."""
    keys = set(params)
    with suppress(OverrideParseException, SystemExit):  # not Hydra's: a job's own process
        args = get_args_parser().parse_known_args(sys.argv[1:])[0].overrides  # argparse may exit
        parsed = OverridesParser.create().parse_overrides(args)
        keys |= {override.get_key_element() for override in parsed if override.is_sweep_override()}
    return keys


def sweep_group(task_name: str, log_dir: str) -> str | None:
    """`${sweep_group:${task_name},${paths.log_dir}}`, logger.group's default: a sweep's jobs
    share one, `task_name` and the sweep's folder (under `log_dir`, where there); a run has none."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    sweep = Path(HydraConfig.get().sweep.dir).absolute()
    with suppress(ValueError):  # named from where the run folders go, where it is there
        sweep = sweep.relative_to(Path(log_dir).absolute())
    return cut(f"{task_name} {sweep}")


def cut(name: str) -> str:
    """A wandb name or group of at most 128 characters, cut from its end (the least telling)."""
    return name if len(name) <= 128 else name[:127] + "…"


RESOLVERS = {"checkpoint_mode": direction, "gpus_per_node": _gpus_per_node}
RESOLVERS |= {"run_name": run_name, "sweep_group": sweep_group}  # the wandb run's, where Hydra runs
for name, resolver in RESOLVERS.items():
    if not OmegaConf.has_resolver(name):
        OmegaConf.register_new_resolver(name, resolver)
SCHEMA = register()  # what a config handed on as plain values (to a process) is typed by
