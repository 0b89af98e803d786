"""Checkpoints: the run's parts, each saving and loading its own state (the `Stateful` protocol), in
one file `{name: part.state_dict()}` with the config and the wandb run, written atomically by the
main process: tensors and plain values only, that `torch.load(weights_only=True)` reads anywhere."""

from __future__ import annotations

import io
import logging
import pickle
import random
import re
import shutil
import uuid
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils._pytree import tree_map_only

from src.engine import storage
from src.engine.config import Checkpointing, Settings
from src.engine.errors import UserError, first_line, where
from src.engine.parallel import Process, Strategy, unwrap

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # what DataParallel/DDP and torch.compile prepend
# Whole state dicts (torch.distributed.checkpoint's, in every mode) on rank 0's CPU only, {} on the
# other ranks: no device holds two copies, and rank 0 writes.
WHOLE = {"full_state_dict": True, "cpu_offload": True}
PARTS = ("model", "optimizer", "scheduler", "progress", "rng")  # what a training checkpoint holds
# checkpoint.sharded=true: the folder beside the file that holds these parts' shards instead.
SHARDS, SHARDED = "shards", ("model", "optimizer")
BEST_PATH = "best_path"  # a resumed checkpoint's, as read: where its best.pt lies (no part's)
# How torch.save's files begin: a zip archive, or the older format's magic number (pickled as
# binary by protocol 2 and later, as text by protocols 0 and 1).
ZIP = b"PK\x03\x04"
LEGACY = (
    torch.serialization.MAGIC_NUMBER.to_bytes(10, "little"),
    b"%d" % torch.serialization.MAGIC_NUMBER,
)


class Unusable(UserError):
    """A checkpoint file this run cannot use, told as its path, `why` (a clause) and `then` (what
    to do, its punctuation first); `why` serves the sentence on a resumed run's best.pt too."""

    def __init__(self, path: Path | str, why: str, then: str):
        super().__init__(f"{path} {why}{then}")
        self.why = why


@dataclass
class Weights:
    """The model's part: its whole `state_dict` through torch.distributed.checkpoint, gathered from
    the shards where the mode shards them; loaded checked, and in a process group from rank 0's."""

    model: nn.Module  # as its strategy wrapped it (or before)
    path: Path | str = "the checkpoint"  # where the weights it loads come from, for a message

    def state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint import state_dict as dsd

        return dsd.get_model_state_dict(unwrap(self.model), options=dsd.StateDictOptions(**WHOLE))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # Each rank's own read of the file, not rank 0's sent over it: a file that differs between
        # machines is the start-up check's to find (guards.check_start), not to be hidden.
        load_whole(self.model, checked_weights(unwrap(self.model), self.path, state), False)


def load_whole(model: nn.Module, state: dict[str, torch.Tensor], from_rank0: bool) -> None:
    """Load the whole, checked `state` into `model`, sharded where the mode shards the model;
    `from_rank0`: in a process group, rank 0's, sent to the other ranks (where it may be {})."""
    from torch.distributed.checkpoint import state_dict as dsd

    broadcast = from_rank0 and torch.distributed.is_initialized()
    options = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    dsd.set_model_state_dict(unwrap(model), state, options=options)


@dataclass
class OptimizerState:
    """The optimizer's part: its moments continue, its settings (lr, betas) stay this config's.
    Saved as one process's `optimizer.state_dict()` numbers its parameters, whatever the mode."""

    optimizer: torch.optim.Optimizer
    model: nn.Module  # the model it steps, as its strategy wrapped it

    def state_dict(self) -> dict[str, Any]:
        """Whole on rank 0 ({} on the others); torch.distributed.checkpoint names the parameters."""
        from torch.distributed.checkpoint import state_dict as dsd

        options = dsd.StateDictOptions(**WHOLE)
        state = dsd.get_optimizer_state_dict(unwrap(self.model), self.optimizer, options=options)
        names = [name for group in state.get("param_groups", []) for name in group["params"]]
        return _rekeyed(state, {name: number for number, name in enumerate(names)}) if state else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a plain `optimizer.state_dict()`, which every rank holds."""
        from torch.distributed.checkpoint import state_dict as dsd

        groups = self.optimizer.param_groups
        # Its moments are numbered by their place in the groups: only the same groups match them.
        saved, ours = ([len(g["params"]) for g in gs] for gs in (state["param_groups"], groups))
        if saved != ours:
            said = [f"{', '.join(map(str, n[:-1]))}{' and ' if n[1:] else ''}{n[-1]}"
                    for n in (saved, ours)]  # fmt: skip
            raise UserError(
                f"The checkpoint's optimizer was saved with {len(saved)} parameter group"
                f"{'s' if saved[1:] else ''} (of {said[0]} parameters), and this run's has "
                f"{len(ours)} (of {said[1]}): resume with the model and trainer.weight_decay_on it "
                "was trained with, or start a new run from its weights with init_from=PATH.",
                every_rank=True,
            )
        with self.settings_kept():
            if not state["state"]:  # a stateless optimizer (SGD without momentum): its settings
                self.optimizer.load_state_dict(state)
                return
            model, params = unwrap(self.model), [p for g in groups for p in g["params"]]
            names, had = {id(p): name for name, p in model.named_parameters()}, set(state["state"])
            state = _rekeyed(state, [names[id(p)] for p in params])
            # Group keys this optimizer lacks (the saved schedule's initial_lr, built after this)
            # are left out: the settings are this config's anyway (settings_kept), the moments
            # continue.
            state["param_groups"] = [
                {k: v for k, v in saved.items() if k in group or k == "params"}
                for saved, group in zip(state["param_groups"], groups, strict=True)
            ]
            # Not strict: parameters that never had a gradient have no state, as in a plain
            # optimizer. The state it loads into is made by a step on zero gradients, which it
            # skips where gradients are left (of no step: this loads before training).
            self.optimizer.zero_grad(set_to_none=True)
            options = dsd.StateDictOptions(full_state_dict=True, strict=False)
            dsd.set_optimizer_state_dict(model, self.optimizer, state, options=options)
            # That step gave every parameter a state: those the file has none of start afresh, as
            # a plain optimizer's load leaves them (Adam's first step of them is their step 1).
            for number in set(range(len(params))) - had:
                self.optimizer.state.pop(params[number], None)

    @contextmanager
    def settings_kept(self) -> Iterator[None]:
        """Each group's settings (lr, weight decay) stay this config's over what is loaded."""
        groups = self.optimizer.param_groups
        chosen = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        yield
        for group, fresh in zip(self.optimizer.param_groups, chosen, strict=True):
            group.pop("initial_lr", None)  # the saved schedule's start: this config's is in fresh
            group.update(fresh)


def _rekeyed(state: dict[str, Any], key: Any) -> dict[str, Any]:
    """`state` with each parameter's key `k` replaced by `key[k]` (numbers for names, or back)."""
    groups = [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]]
    return {"state": {key[k]: v for k, v in state["state"].items()}, "param_groups": groups}


class RandomState:
    """Every rank's random generators: seeded `seed` + rank (each rank draws its own dropout masks;
    the strategy seeds what it draws on beyond), or a checkpoint's saved by as many ranks."""

    def __init__(self, process: Process, seed: int, strategy: Strategy):
        self.process = process
        seed_everything(seed + process.rank)
        strategy.seed_devices(seed)  # dp: each GPU's replica its own stream

    def state_dict(self) -> list[dict[str, Any]]:
        return self.process.all_gather_object(rng_state())  # every rank calls it

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != self.process.world_size:
            said = "1 process" if len(states) == 1 else f"{len(states)} processes"
            if self.process.is_main:  # every rank's line would say the same
                log.warning(
                    f"The checkpoint was saved by {said} and this run has "
                    f"{self.process.world_size}: weights, optimizer, schedule and sample order "
                    "continue, random streams (dropout's) start afresh."
                )
            return
        set_rng_state(states[self.process.rank])


def on_cpu(value: Any) -> Any:
    """`value` (nested dicts, lists, tuples) with its tensors on the CPU, so that the file loads
    where no GPU is (the model's and optimizer's are there already, `WHOLE`: a fork's part may
    keep its own on a GPU); the tensors already there are not copied. torch's own tree map, which
    torch.distributed.checkpoint walks state dicts with."""
    return tree_map_only(torch.Tensor, torch.Tensor.cpu, value)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's default random generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy, torch CPU and CUDA), as plain lists."""
    numpy = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": (numpy[0], numpy[1].tolist(), *numpy[2:]),
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in cuda],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back where `rng_state` found them."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        cuda = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def load_parts(parts: dict[str, Any], state: dict[str, Any]) -> None:
    """Give each part its state back; one saved empty (float16's scaler, unused) stays fresh."""
    for name, part in parts.items():
        if state.get(name):
            part.load_state_dict(state[name])


def check_part(name: str, part: Any) -> None:
    """Stop before training where a fork's part gives a state a checkpoint cannot hold or load
    (loaded back into the part itself: a copy of one that holds the model may not copy)."""
    about = f"{name} {type(part).__name__} ({where(type(part))})"
    try:
        buffer = io.BytesIO()
        torch.save(part.state_dict(), buffer)
        loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the fork's state holds, told in one line
        raise UserError(
            f"The checkpoint cannot hold the state of {about}: {first_line(err)}. Its "
            "state_dict() may hold tensors and plain Python values only."
        ) from None
    try:
        part.load_state_dict(loaded)  # its own state, before any is resumed: no change
    except Exception as err:  # noqa: BLE001
        raise UserError(
            f"{about} cannot load the state its own state_dict() gives ({type(err).__name__}: "
            f"{first_line(err)}): a resumed run would stop there. Make load_state_dict take it."
        ) from None


@dataclass(eq=False, repr=False)  # the parts and the process: no repr of theirs
class Checkpointer:
    """What is saved, and when: `last.pt` after every epoch, every `every_n_steps` steps and on an
    early stop; `best.pt` when an epoch validates best by `monitor`; nothing with `save=false`."""

    policy: Checkpointing
    run_dir: Path
    process: Process
    strategy: Strategy
    parts: dict[str, Any]
    metadata: dict[str, Any]  # the config, the wandb run's id
    resumed: InitVar[tuple[Path, dict] | None] = None
    kept: tuple[Path, int] | None = field(default=None, init=False)  # the last written, its step

    def __post_init__(self, resumed: tuple[Path, dict] | None) -> None:
        """The `parts`, given their state back from the `resumed` checkpoint (path, contents),
        which is kept until this one writes its own; a fork's part is checked first."""
        folder = Path(self.run_dir or ".") / "checkpoints"
        self.last, self.best, parts = folder / "last.pt", folder / "best.pt", self.parts
        for name in parts:  # a fork's part (its callbacks checked each as they were set up)
            if name not in (*PARTS, "scaler", "callbacks"):
                check_part(name, parts[name])
        if resumed:  # the model's weights were loaded as it was built
            path, state = resumed
            load_parts({k: v for k, v in parts.items() if k != "model"}, state)
            if shards := state.get(SHARDS):  # checkpoint.sharded=true: each rank its own
                model, optimizer = parts["model"].model, parts["optimizer"]
                with optimizer.settings_kept():
                    self.strategy.load_shards(model, Path(shards), optimizer.optimizer)
            self.kept = (path, state["progress"]["step"])

    def save(self, step: int) -> None:
        """`last.pt`, as training stands now (every rank calls it)."""
        if self.policy.save:
            self._save(self.last, step)

    def due(self, step: int) -> bool:
        """Whether `last.pt` is due after `step` within an epoch: every `every_n_steps` steps."""
        every = self.policy.every_n_steps
        return bool(self.policy.save and every and step % every == 0)

    def epoch_done(self, step: int, improved: bool) -> None:
        """After an epoch's validation: `best.pt` if it `improved` on the best, and `last.pt`."""
        if not improved:
            self.save(step)
        elif self.policy.save:
            # best.pt first: a kill between the two writes leaves last.pt behind it, and the
            # resumed run redoes this epoch and writes the same best.pt again.
            self._save(self.best, step)  # kept: whole, should the copy be refused
            self._on_main(lambda: storage.copy_atomically(self.best, self.last), step)
            self.kept = (self.last, step)

    def stopped(self, fault: storage.Fault, step: int | None) -> storage.StorageFull:
        """What stops the run when the storage refused a write: with the checkpoint still intact."""
        return storage.stopped(fault, self.run_dir, step, self.kept)

    def holding(self) -> str:
        """What the run's checkpoints hold, for a sentence of what a stop keeps."""
        if not self.policy.save:
            return "checkpoint.save=false kept no weights"
        test = "test one with train=false ckpt_path=..."
        return f"{self.run_dir}/checkpoints holds its weights ({test})"

    def files(self) -> dict[str, list[Path]]:
        """The checkpoints on disk, by name (best, last): each file with its shards folder."""
        return {
            name: [path, *[path.parent / s for s in [shards_named(path)] if s]]
            for name, path in {"best": self.best, "last": self.last}.items()
            if path.is_file()
        }

    def _save(self, path: Path, step: int) -> None:
        """Write `path` atomically from the main process (every rank calls it), then `kept`."""
        sharded = self.policy.sharded
        state = {n: p.state_dict() for n, p in self.parts.items() if not (sharded and n in SHARDED)}
        if sharded:
            state[SHARDS] = self._save_shards(path, step).name

        def write() -> None:
            path.parent.mkdir(exist_ok=True)  # not parents=True: a deleted run folder is told
            whole = on_cpu(state | self.metadata)  # read anywhere, a GPU or not; loaded back
            storage.write_atomically(path, lambda file: torch.save(whole, file))  # onto it

        self._on_main(write, step, path)
        if sharded and self.process.is_main:  # the shards that neither last.pt nor best.pt names
            named = {shards_named(f) for f in (self.last, self.best) if f.is_file()}
            for shards in path.parent.glob("shards-*"):
                if shards.name not in named:
                    shutil.rmtree(shards, ignore_errors=True)
        self.kept = (path, step)

    def _on_main(self, write: Any, step: int, path: Path | None = None) -> None:
        """`write` on the main process; every rank stops where the storage refused it."""
        if fault := storage.on_main(self.process, write, path):
            raise self.stopped(fault, step)

    def _save_shards(self, path: Path, step: int) -> Path:
        """checkpoint.sharded=true: every rank writes its shards into a new folder beside `path`,
        which the file names; the previous file's folder stays whole until the file is replaced."""
        process, model = self.process, self.parts["model"].model
        optimizer = self.parts["optimizer"].optimizer
        shards = path.parent / process.broadcast_object(f"shards-{uuid.uuid4().hex[:12]}")
        # Rank 0's BatchNorm statistics on every rank, as the plain checkpoint saves them: the
        # shards' writer takes an unsharded tensor from whichever rank it picks.
        process.broadcast_tensors(model.buffers())

        def make() -> None:  # not parents=True: a run folder deleted meanwhile is told
            path.parent.mkdir(exist_ok=True)
            shards.mkdir(exist_ok=True)

        # The folder first, on every rank: no rank waits in the writer's collectives for one
        # that could not make it.
        for attempt in (make, lambda: self.strategy.save_shards(model, optimizer, shards)):
            if fault := storage.agree(process, storage.attempt(attempt, shards)):
                raise self.stopped(fault, step)
        return shards

    def check_best(self, path: Path, state: dict) -> None:
        """Stop before training where the best.pt that the resumed checkpoint (`path`, `state`)
        records its best epoch in cannot be used, which the test would load after training. Read
        here and again for the test, not kept in memory through training meanwhile."""
        if not (source := state.get(BEST_PATH)):  # no validation, or no best.pt beside (told)
            return
        epoch = state["progress"]["best"]["epoch"]

        def told(err: Unusable) -> str:
            return (
                f"{path} records its best epoch ({epoch}) in {source}, which {err.why}: delete or "
                f"move {source} to resume from {path} (the best so far then starts afresh), or "
                "give resume= another checkpoint."
            )

        self._best(source, self.parts["model"].model, told)

    def load_best(self, model: nn.Module) -> None:
        """Load the run folder's best.pt into `model`, and the fork's parts (a task's state, the
        callbacks': an average of the weights): rank 0 reads it (the run folder is rank 0's, which
        other machines may not see) and the other ranks receive it."""
        state, process = self._best(self.best, model, str), self.process
        if shards := process.broadcast_object(state.get(SHARDS)):  # each rank reads its own
            self.strategy.load_shards(model, Path(shards))
        else:
            load_whole(model, state.get("model", {}), True)  # read on rank 0 alone
        forks = {n: p for n, p in self.parts.items() if n in ("task", "callbacks")}
        load_parts(forks, process.broadcast_object({n: state.get(n) for n in forks}))

    def _best(self, path: Path, model: nn.Module, told: Callable[[Unusable], str]) -> dict:
        """The best.pt at `path`, read by rank 0 ({} on the others) and checked against the plain
        `model` (its shards' names and shapes, where it has shards): what the test loads. Where it
        cannot be used, every rank stops with `told(why)`."""
        state, error, model = {}, None, unwrap(model)
        if self.process.is_main:
            try:
                state = _checked(path, True, self.strategy)
                if SHARDS not in state:
                    state["model"] = checked_weights(model, path, state["model"])
                else:
                    check_saved(model, path, self.strategy.saved_tensors(Path(state[SHARDS])))
            except Unusable as err:
                error = told(err)
        if error := storage.agree(self.process, error):
            raise UserError(error, every_rank=True)
        return state


def starting_point(
    settings: Settings, run_dir: Path, process: Process
) -> tuple[tuple[Path, dict] | None, tuple[Path, dict] | None]:
    """The checkpoint training continues from and the one the model's weights start from (that
    one, init_from or ckpt_path), each (path, contents) or None; resume=auto: last.pt, if any."""
    paths, path = settings.paths, None
    if settings.train and paths.resume == "auto":
        last = run_dir / "checkpoints" / "last.pt"
        path = process.broadcast_object(last if last.is_file() else None)
    elif settings.train and paths.resume is not None:
        path = Path(paths.resume).expanduser()
    if path is None:
        return None, find_weights(settings, process)
    log.info("Resuming from %s", path)
    if paths.init_from:
        log.info("init_from=%s is not used: the resumed weights replace it.", paths.init_from)
    state = load(path, process, settings.parallel)
    check_changes(state.get("config"), settings.config, path)
    best = state["progress"].get("best")
    if best and best["epoch"] is not None:  # its best.pt: beside it, else in this run's folder
        beside, ours = path.parent / "best.pt", run_dir / "checkpoints" / "best.pt"
        state[BEST_PATH] = beside if beside.is_file() else ours
        if not process.broadcast_object(state[BEST_PATH].is_file()):
            log.warning("%s records its best epoch (%d), but no best.pt lies beside it: the best "
                        "so far starts afresh.", path, best["epoch"])  # fmt: skip
            state["progress"]["best"], state[BEST_PATH] = None, None
    return (path, state), (path, state)


def take_best(resumed: tuple[Path, dict], run_dir: Path, process: Process) -> None:
    """The resumed checkpoint's best.pt copied into this run's folder, once the run has begun."""
    if not (source := resumed[1].get(BEST_PATH)):
        return
    (path, state), fault, target = resumed, None, run_dir / "checkpoints" / "best.pt"
    if process.is_main and source.is_file() and source.resolve() != target.resolve():
        try:
            _copy(source, target)
        except OSError as err:  # every rank stops with the main's message
            fault = storage.Fault.of(err, target)
    storage.stop_together(process, fault, run_dir, None, (path, state["progress"]["step"]))


def find_weights(settings: Settings, process: Process) -> tuple[Path, dict] | None:
    """The model's first weights (path, contents): ckpt_path with train=false, else init_from."""
    name = settings.paths.init_from if settings.train else settings.paths.ckpt_path
    if name is None:
        return None
    path = Path(name).expanduser()
    return path, load(path, process, settings.parallel, weights_only=True)


def load(path: Path, process: Process, strategy: Strategy, weights_only: bool = False) -> dict:
    """A checkpoint of this template (with `weights_only`, anyone's bare `state_dict` too), read
    by every rank into CPU memory: the optimizer then places its state by PyTorch's rule (Adam's
    step counters stay on the CPU, costing no device sync). A bad file stops every rank."""
    error, state = None, None
    try:
        state = _checked(path, weights_only, strategy)
    except UserError as err:
        error = str(err)
    if error := storage.agree(process, error):
        raise UserError(error)
    return state


def _checked(path: Path, weights_only: bool, strategy: Strategy) -> dict[str, Any]:
    """The checkpoint at `path` (upgraded from an older layout) that `strategy` can load, or a
    UserError."""
    state = _read(path, weights_only)
    if not isinstance(state, dict):  # no part of a checkpoint
        state = {}
    elif weights_only and state and all(torch.is_tensor(v) for v in state.values()):
        state = {"model": state}  # anyone's bare state_dict
    state = upgraded(state)
    needed = ("model",) if weights_only else PARTS
    if SHARDS in state:  # checkpoint.sharded=true: beside the file
        needed = tuple(key for key in needed if key not in SHARDED)
        state[SHARDS] = str(path.parent / state[SHARDS])
        if not (Path(state[SHARDS]) / ".metadata").is_file():
            raise Unusable(
                path,
                f"keeps its weights in the folder {state[SHARDS]}, which is missing or incomplete",
                ": copy that folder beside the file with it, or use an intact checkpoint (best.pt "
                "is a second one).",
            )
    if missing := [key for key in needed if key not in state]:
        raise Unusable(
            path,
            f"is not a checkpoint of this template: it has no {', '.join(missing)}",
            f". Give {_wanted(weights_only)}.",
        )
    if SHARDS in state and not strategy.sharded:  # a checkpoint in shards, outside fsdp
        raise Unusable(
            path,
            "holds its weights in shards (checkpoint.sharded=true), which parallel=fsdp reads, "
            "with any number of processes",
            ": add parallel=fsdp.",
        )
    return state


def _wanted(weights_only: bool) -> str:
    """What a run takes where a file cannot serve: to resume, or (`weights_only`) for weights."""
    also = ", or a model's state_dict() saved with torch.save" if weights_only else ""
    return f"a last.pt or best.pt from a run folder's checkpoints/{also}"


def upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of commit 77da666 or earlier (training in keys of its own), in this layout."""
    if "progress" in state or "epoch" not in state:
        return state
    keys = ("epoch", "epoch_step", "step", "metrics", "best")
    progress = {key: state.pop(key) for key in keys if key in state}
    progress["batch_size"] = (state.get("config") or {}).get("data", {}).get("batch_size")
    return {**state, "progress": progress}


def _read(path: Path, weights_only: bool = False) -> Any:
    """What torch.save wrote at `path`, unpickled by torch.load(weights_only=True), or a
    UserError; any other file (a plain pickle, text) is refused before it is unpickled."""
    if not path.is_file():
        raise Unusable(path, "does not exist", f": check the path (relative to {Path.cwd()}).")
    try:
        with open(path, "rb") as file:
            head = file.read(32)
    except OSError as err:
        raise Unusable(
            path, f"cannot be read ({err.strerror})", ": check its permissions."
        ) from None
    if head and not (head.startswith(ZIP) or any(magic in head for magic in LEGACY)):
        raise Unusable(
            path,
            "is not a file torch.save wrote (neither a zip archive nor torch's older format)",
            f": give {_wanted(weights_only)}.",
        )
    try:
        with warnings.catch_warnings():  # its pickle protocol, told below if it is refused
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch words it "Unsupported global: GLOBAL x.y was not an allowed global" (a class),
        # "unsupported GLOBAL posix.system whose module posix is blocked" (a function that runs);
        # else the instruction it refused, on the line after "WeightsUnpickler error:".
        if unsafe := re.search(r"GLOBAL ([\w.]+)", str(err)):
            raise Unusable(
                path,
                f"holds Python objects ({unsafe.group(1)}), not only tensors and plain values",
                "; torch.load(weights_only=True) refuses to unpickle them, as that can run "
                "arbitrary code. If you trust the file, load it yourself and save its model's "
                "state_dict().",
            ) from None
        if refused := re.search(r"WeightsUnpickler error:\s*(.+)", str(err)):
            raise Unusable(
                path,
                "holds a pickle that torch.load(weights_only=True) does not read "
                f"({refused.group(1).strip()})",
                ": if you trust the file, load it yourself and save its model's state_dict() "
                "again with torch.save's default pickle_protocol.",
            ) from None
        detail = first_line(err)
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        detail = str(err).strip().split(". ")[0] or "it ends early"
    raise Unusable(
        path,
        f"is not a readable checkpoint: truncated or corrupt ({detail})",
        ". Use an intact copy (best.pt is a second one), or start without it.",
    )


def checked_weights(model: nn.Module, path: Path | str, state: dict) -> dict[str, torch.Tensor]:
    """The weights `state`, saved from any wrapper, named as the plain `model` names them and
    checked: another architecture and weights that are not finite stop, another dtype is told."""
    state = OrderedDict(state)
    for prefix in WRAPPER_PREFIXES:
        consume_prefix_in_state_dict_if_present(state, prefix)
    check_saved(model, path, {key: (tuple(t.shape), t.dtype) for key, t in state.items()})
    if bad := [k for k, t in state.items() if t.is_floating_point() and not t.isfinite().all()]:
        raise Unusable(
            path,
            "holds weights that are not finite (NaN or infinite values in "
            f"{', '.join(bad[:3]) + (', …' if len(bad) > 3 else '')})",
            ": nothing can be trained from them or evaluated. Use an earlier checkpoint (best.pt "
            "is a second one), or start without it.",
        )
    return state


def load_shards(model: nn.Module, path: Path, shards: str, strategy: Strategy) -> None:
    """Every rank loads its part of the model's weights from the checkpoint at `path`'s `shards`."""
    check_saved(unwrap(model), path, strategy.saved_tensors(Path(shards)))
    strategy.load_shards(model, Path(shards))


def check_saved(model: nn.Module, path: Path | str, saved: dict[str, tuple]) -> None:
    """Stop where the `saved` tensors' keys or shapes (name: shape, dtype) differ from the model's;
    one line where float dtypes differ: loading converts them, and the optimizer's state."""
    expected = {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict().items()}
    problems = [
        f"{key} {_shape(saved[key][0])} in the file, {_shape(shape)} in the model"
        for key, (shape, _) in expected.items()
        if key in saved and saved[key][0] != shape
    ]
    problems += [f"{key} missing from the file" for key in expected if key not in saved]
    problems += [f"{key} not in the model" for key in saved if key not in expected]
    if problems:
        shown = "; ".join(problems[:3]) + ("; …" if len(problems) > 3 else "")
        name = type(model).__name__.removeprefix("FSDP")  # FSDP made its class FSDP<name>
        raise Unusable(
            path,
            f"holds weights of another architecture than {name} ({shown})",
            ". Choose the model= (and its sizes) it was saved with.",
        )
    ours = {dtype for _, dtype in expected.values() if dtype.is_floating_point}
    theirs = {dtype for _, dtype in saved.values() if dtype.is_floating_point}
    if theirs and ours and theirs != ours:
        file, here = (", ".join(sorted(str(d).removeprefix("torch.") for d in s))
                      for s in (theirs, ours))  # fmt: skip
        log.info("Weights converted on load: %s in %s, %s in this run", file, path, here)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


def shards_named(path: Path) -> str | None:
    """The shards folder the checkpoint at `path` names; None if none or unreadable (told later)."""
    try:
        state = _read(path)
    except UserError:
        return None
    return state.get(SHARDS) if isinstance(state, dict) else None


def _copy(source: Path, target: Path) -> None:
    """Copy the checkpoint `source` to `target`, with the shards folder it names, if any."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if shards := shards_named(source):
        shutil.copytree(source.parent / shards, target.parent / shards, dirs_exist_ok=True)
    storage.copy_atomically(source, target)


# What decides which images train and validate, in what order: a resumed run keeps the checkpoint's.
FIXED = ("seed", "data.seed", "data.split_seed", "data.val_size", "data.subset", "data.dataset")
# No line when they change: where files are, the wandb run's name (from the command line).
QUIET = ("paths", "resume", "logger.name", "logger.group")


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
    if before.get("checkpoint.sharded") and not after.get("checkpoint.sharded"):
        raise UserError(
            f"checkpoint.sharded=false, and {path} was saved in shards (checkpoint.sharded=true): "
            "resumed so, it would gather the whole model on rank 0 and leave its shards folder "
            "unnamed. Resume with checkpoint.sharded=true, or start a new run from its weights: "
            f"init_from={path}."
        )
    for key in ("scheduler.interval", *FIXED):
        was, now = before.get(key), after.get(key)
        if key in before and was != now:
            why = (
                f"where its schedule stands is counted in {was}s"
                if key == "scheduler.interval"
                else "it decides which images train and validate, in what order, so it cannot "
                "change in a resumed run"
            )
            raise UserError(
                f"{key}={now}, and {path} was trained with {key}={was}: {why}. Resume with "
                f"{key}={was}, or start a new run from its weights: init_from={path}."
            )
    keys = sorted(before.keys() | after.keys())
    # A group that names another class (parallel=ddp → none): that line alone, not its keys'.
    switched = [k for k in keys if k.endswith("._target_") and before.get(k) != after.get(k)]
    for key in keys:
        if {key, key.split(".")[0]} & set(QUIET) or before.get(key) == after.get(key):
            continue
        under = [target for target in switched if key.startswith(target.removesuffix("_target_"))]
        if not under or under == [key]:  # a switched group's own line, the outermost's alone
            log.info("%s %s → %s from this config", key, before.get(key), after.get(key))


def _flat(config: Any, key: str = "") -> dict[str, Any]:
    """Each leaf of a nested config, by its dotted key."""
    if not isinstance(config, dict):
        return {key: config}
    nested = (_flat(value, f"{key}.{name}" if key else name) for name, value in config.items())
    return {dotted: leaf for leaves in nested for dotted, leaf in leaves.items()}
