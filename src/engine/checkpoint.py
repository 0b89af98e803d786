"""Checkpoints: plain dicts of tensors and Python values, written atomically by the main process.

A checkpoint holds the unwrapped model's `state_dict` (no `module.` prefix), so it loads into any
parallel mode, and nothing but tensors and plain Python types, so `torch.load(weights_only=True)`
reads it. It also holds where training stood (epoch, batches of it done, optimizer step), the
optimizer and scheduler, and every rank's random state, so a resumed run continues exactly.
It also holds `best`: which evaluation was best by `checkpoint.monitor`, the one `best.pt` holds.
"""

from __future__ import annotations

import functools
import logging
import pickle
import random
import re
import shutil
import uuid
import zipfile
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from src.engine import fsdp, storage
from src.engine.core.state import Parts, Progress
from src.engine.distributed import Process, unwrap
from src.engine.errors import UserError
from src.engine.settings import Checkpointing, Settings

log = logging.getLogger(__name__)

# What wrappers prepend to parameter names: DataParallel/DDP, and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
TRAINING_KEYS = ("model", "optimizer", "scheduler", "epoch", "epoch_step", "step", "rng")
SHARDS = "shards"  # checkpoint.sharded=true: the folder beside the file with the model's and the
# optimizer's shards, which the file holds instead of them


class Checkpointer:
    """What is saved, and when: `last.pt` after every epoch (and every `every_n_steps` steps,
    and when training stops early), `best.pt` when an epoch's validation is the best so far by
    `monitor`. With `save=false` nothing is written, but the best epoch is still tracked."""

    def __init__(
        self,
        policy: Checkpointing,
        run_dir: Path,
        process: Process,
        parts: Parts,
        config: dict[str, Any],
        wandb_id: str | None,
    ):
        self.policy, self.run_dir, self.process, self.parts = policy, run_dir, process, parts
        self.config, self.wandb_id = config, wandb_id
        self.last, self.best = (
            run_dir / "checkpoints" / "last.pt",
            run_dir / "checkpoints" / "best.pt",
        )
        self.kept: tuple[Path, int] | None = None  # the last checkpoint written, and its step

    def save(self, progress: Progress) -> None:
        """`last.pt`, as training stands now."""
        if self.policy.save:
            self._save(self.last, progress)
            self.kept = (self.last, progress.step)

    def due(self, progress: Progress, epoch_steps: int) -> bool:
        """Whether `last.pt` is due after this step: every `every_n_steps` steps within an epoch
        (the epoch's end saves anyway)."""
        every = self.policy.every_n_steps
        return bool(
            self.policy.save
            and every
            and progress.step % every == 0
            and progress.epoch_step < epoch_steps
        )

    def epoch_done(self, progress: Progress) -> None:
        """After an epoch and its validation: `best.pt` if it is the best so far, and `last.pt`."""
        best = progress.best
        if not (best and best.update(progress.metrics, progress.epoch)):
            self.save(progress)
        elif self.policy.save:
            # best.pt first: a kill between the two writes leaves last.pt behind it, and the
            # resumed run redoes this epoch and writes the same best.pt again.
            self._save(self.best, progress)
            self._save(self.last, progress, copy_of=self.best)
            self.kept = (self.last, progress.step)

    def stopped(self, fault: storage.Fault, step: int | None) -> storage.StorageFull:
        """What stops the run when the storage refused a write: with the checkpoint still intact."""
        return storage.stopped(fault, self.run_dir, step, self.kept)

    def _save(self, path: Path, progress: Progress, copy_of: Path | None = None) -> None:
        """Write `path` (a copy of the checkpoint `copy_of`, if given); stop every rank, with what
        is intact, if the storage refuses it."""
        if copy_of:
            fault = storage.on_main(self.process, lambda: storage.copy_atomically(copy_of, path))
        else:
            fault = save(path, self.process, self.parts, progress, self.config, self.wandb_id,
                         self.policy.sharded)  # fmt: skip
        if fault:
            raise self.stopped(fault, progress.step)
        if self.policy.sharded and self.process.is_main:
            remove_unnamed_shards(path.parent)


def shards_named(path: Path) -> str | None:
    """The shards folder the checkpoint at `path` names (checkpoint.sharded=true), if any; None
    also for a file that cannot be read, which is reported when it is loaded."""
    try:
        state = _read(path)
    except UserError:
        return None
    return state.get(SHARDS) if isinstance(state, dict) else None


def remove_unnamed_shards(folder: Path) -> None:
    """Remove the shard folders that neither last.pt nor best.pt names any more."""
    named = {shards_named(f) for f in (folder / "last.pt", folder / "best.pt") if f.is_file()}
    for shards in folder.glob("shards-*"):
        if shards.name not in named:
            shutil.rmtree(shards, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy, torch CPU and CUDA), as plain lists."""
    numpy_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available()
        else [],
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


def save(
    path: Path,
    process: Process,
    parts: Parts,
    progress: Progress,
    config: dict[str, Any],
    wandb_id: str | None,
    sharded: bool = False,
) -> storage.Fault | None:
    """Write a checkpoint to `path` from the main process, atomically; every rank waits for it,
    and returns the storage's refusal if there was one (a full disk), on every rank.

    `parts` are the model (its plain `state_dict` is saved), the optimizer, the scheduler and the
    gradient scaler. Each rank's random state is kept (dropout differs per rank), gathered to the
    main process. The file is written beside its final name and renamed over it, so a kill
    during the write, or a refused one, leaves the previous checkpoint whole. `sharded`: see
    `save_shards`.
    """
    rng = process.all_gather_object(rng_state())
    if sharded:
        shards, fault = save_shards(path, process, parts)
        if fault:
            return fault
        weights = {SHARDS: shards.name}
    else:
        model = model_state(parts.model)
        weights = {"model": model, "optimizer": optimizer_state(parts.model, parts.optimizer)}

    def write() -> None:
        state = {
            **weights,
            "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict(),  # {} unless trainer.precision=16
            "epoch": progress.epoch,
            "epoch_step": progress.epoch_step,
            "step": progress.step,
            "best": progress.best and asdict(progress.best),  # None without a validation split
            "rng": rng,
            "config": config,
            "wandb_id": wandb_id,
            "metrics": progress.metrics,
        }
        # Not parents=True: a run folder deleted during the run is reported, not made anew.
        path.parent.mkdir(exist_ok=True)
        storage.write_atomically(path, lambda file: torch.save(state, file))

    return storage.on_main(process, write, path)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's whole `state_dict`: under FSDP gathered from the ranks (every rank calls
    it), onto the main process."""
    model = unwrap(model)
    return fsdp.model_state(model) if fsdp.is_sharded(model) else model.state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()`, whole: under FSDP gathered as `model_state` is."""
    model = unwrap(model)
    if fsdp.is_sharded(model):
        return fsdp.optimizer_state(model, optimizer)
    return optimizer.state_dict()


def save_shards(path: Path, process: Process, parts: Parts) -> tuple[Path, storage.Fault | None]:
    """checkpoint.sharded=true (FSDP): every rank writes its shards of the model and the optimizer
    into a new folder beside `path` (torch.distributed.checkpoint's format), which the file at
    `path` then names instead of holding them: written after every shard, it replaces the
    previous file, whose folder stays whole until then. Returns the folder, and the storage's
    refusal on any rank, on every rank."""
    shards = path.parent / process.broadcast_object(f"shards-{uuid.uuid4().hex[:12]}")
    model = unwrap(parts.model)
    # Rank 0's BatchNorm statistics on every rank, as the plain checkpoint saves them: the
    # shards' writer takes an unsharded tensor from whichever rank it picks.
    process.broadcast_tensors(model.buffers())

    def make() -> None:  # not parents=True: a run folder deleted meanwhile is reported
        path.parent.mkdir(exist_ok=True)
        shards.mkdir(exist_ok=True)

    # The folder first, on every rank, so that no rank waits in the writer's collectives for one
    # that could not make it.
    if fault := storage.agree(process, storage.attempt(make, shards)):
        return shards, fault
    write = functools.partial(fsdp.save_sharded, model, parts.optimizer, shards)
    return shards, storage.agree(process, storage.attempt(write, shards))


def _copy(source: Path, target: Path) -> None:
    """Copy the checkpoint `source` to `target`, with the shards folder it names, if any."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if shards := shards_named(source):
        shutil.copytree(source.parent / shards, target.parent / shards, dirs_exist_ok=True)
    storage.copy_atomically(source, target)


def find_resume(settings: Settings, run_dir: Path, process: Process) -> tuple[Path, dict] | None:
    """The checkpoint training continues from, and its contents; None to start fresh.

    `resume=auto` takes `checkpoints/last.pt` of the run folder if there is one, a path names a
    checkpoint, null never resumes. Rank 0 decides, so every rank resumes from the same file.
    """
    paths = settings.paths
    if not settings.train or paths.resume is None:
        return None
    path = Path(paths.resume).expanduser()
    if paths.resume == "auto":
        last = run_dir / "checkpoints" / "last.pt"
        path = process.broadcast_object(last if last.is_file() else None)
        if path is None:
            return None
    log.info("Resuming from %s", path)
    if paths.init_from:
        log.info("init_from=%s is not used: the resumed weights replace it.", paths.init_from)
    state = load(path, process)
    state["best"] = _best_pt_beside((path, state["step"]), run_dir, state.get("best"), process)
    return path, state


def _best_pt_beside(
    resumed: tuple[Path, int], run_dir: Path, best: dict[str, Any] | None, process: Process
) -> dict[str, Any] | None:
    """The record of its best epoch that the `resumed` checkpoint (path, step) holds, with that
    epoch's best.pt in this run's folder: copied from beside the resumed file when that lies
    elsewhere. Without a best.pt the record is dropped, and the best so far starts afresh."""
    if not best or best["epoch"] is None:
        return best
    target, found, fault = run_dir / "checkpoints" / "best.pt", None, None
    if process.is_main:
        source = resumed[0].parent / "best.pt"
        if source.is_file() and source.resolve() != target.resolve():
            fault = storage.attempt(lambda: _copy(source, target), target)
        found = target.is_file()
        if not found:
            log.warning(
                "%s records its best epoch (%d), but no best.pt lies beside it: the best so far "
                "starts afresh.",
                resumed[0],
                best["epoch"],
            )
    found, fault = process.broadcast_object((found, fault))
    if fault:
        raise storage.stopped(fault, run_dir, None, resumed)
    return best if found else None


def load_best(model: nn.Module, run_dir: Path, process: Process) -> None:
    """Load `checkpoints/best.pt` of the run folder into `model`. Rank 0 reads it (the run folder
    is rank 0's, which other machines may not see) and every other rank receives its weights."""
    path, model, error, state = run_dir / "checkpoints" / "best.pt", unwrap(model), None, {}
    if process.is_main:
        try:
            state = _checked(path, weights_only=True)
            if SHARDS not in state:
                state["model"] = load_model(model, path, state)
        except UserError as err:
            error = str(err)
    errors = [e for e in process.all_gather_object(error) if e]
    if errors:
        raise UserError(errors[0])
    if shards := process.broadcast_object(state.get(SHARDS)):  # each rank reads its own
        load_shards(model, path, shards)
    elif fsdp.is_sharded(model):  # each rank receives its shards of rank 0's weights
        fsdp.load_model_state(model, state.get("model", {}), process.is_main)
    else:
        process.broadcast_tensors(model.state_dict().values())


def find_weights(settings: Settings, process: Process) -> tuple[Path, dict] | None:
    """The file the model's first weights come from: `ckpt_path` to evaluate (train=false),
    `init_from` to fine-tune; None for fresh weights."""
    name = settings.paths.init_from if settings.train else settings.paths.ckpt_path
    if name is None:
        return None
    path = Path(name).expanduser()
    return path, load(path, process, weights_only=True)


def load(path: Path, process: Process, weights_only: bool = False) -> dict[str, Any]:
    """A checkpoint of this template, read by every rank into CPU memory.

    Loading copies the weights onto the model's device, and the optimizer places its state by
    PyTorch's own rule (Adam's `step` counters stay on the CPU, where reading them costs no device
    sync); a `map_location` of the GPU would keep them there.

    With `weights_only`, a bare `state_dict` (from anyone's `torch.save(model.state_dict())`)
    is accepted too, as {"model": state_dict}. Unreadable files stop every rank with one sentence.
    """
    error, state = None, None
    try:
        state = _checked(path, weights_only)
    except UserError as err:
        error = str(err)
    errors = [e for e in process.all_gather_object(error) if e]
    if errors:
        raise UserError(errors[0])
    if SHARDS in state and process.mode != "fsdp":
        raise UserError(
            f"{path} holds its weights in shards (checkpoint.sharded=true), which parallel=fsdp "
            "reads, with any number of processes: add parallel=fsdp."
        )
    return state


def _checked(path: Path, weights_only: bool) -> dict[str, Any]:
    """The checkpoint at `path`, read into CPU memory; a UserError if it is not one of ours."""
    state = _read(path)
    if weights_only and _is_state_dict(state):
        state = {"model": state}
    needed = ("model",) if weights_only else TRAINING_KEYS
    if isinstance(state, dict) and SHARDS in state:  # checkpoint.sharded=true: beside the file
        needed = tuple(key for key in needed if key not in ("model", "optimizer"))
        state[SHARDS] = str(path.parent / state[SHARDS])
        if not (Path(state[SHARDS]) / ".metadata").is_file():
            raise UserError(
                f"{path} keeps its weights in the folder {state[SHARDS]}, which is missing or "
                "incomplete: copy that folder beside the file with it, or use an intact "
                "checkpoint (best.pt is a second one)."
            )
    missing = [key for key in needed if not isinstance(state, dict) or key not in state]
    if missing:
        raise UserError(
            f"{path} is not a checkpoint of this template: it has no {', '.join(missing)}. "
            "Give a last.pt or best.pt from a run folder's checkpoints/"
            + (", or a model's state_dict." if weights_only else ".")
        )
    return state


def _read(path: Path) -> Any:
    if not path.is_file():
        raise UserError(
            f"{path}: no such checkpoint file. Check the path (relative to {Path.cwd()})."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if not unsafe:
            raise _corrupt(path, "not a file torch.save wrote") from None
        raise UserError(
            f"{path} holds Python objects ({unsafe.group(1)}), not only tensors and plain values; "
            "torch.load(weights_only=True) refuses to unpickle them, as that can run arbitrary "
            "code. If you trust the file, load it yourself and save its model's state_dict()."
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise _corrupt(path, str(err).strip().split(". ")[0]) from None


def _corrupt(path: Path, detail: str) -> UserError:
    return UserError(
        f"{path} is not a readable checkpoint: truncated or corrupt ({detail}). "
        "Use an intact copy (best.pt is a second one), or start without it."
    )


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(v, torch.Tensor) for v in obj.values())
    )


def load_model(model: nn.Module, path: Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Load the weights of checkpoint `state` (read from `path`) into the plain `model`, whatever
    wrapper they were saved from; returns them, as the model names them. (A model FSDP sharded
    is only checked: it receives them from rank 0, in `load_best`.)

    Prefixes that DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) add are removed.
    A checkpoint of another architecture stops with the first keys and shapes that differ.
    """
    state_dict = OrderedDict(state["model"])
    for prefix in WRAPPER_PREFIXES:
        consume_prefix_in_state_dict_if_present(state_dict, prefix)
    check_architecture(model, path, {key: tuple(t.shape) for key, t in state_dict.items()})
    check_finite(path, state_dict)
    note_conversion(model, path, {key: t.dtype for key, t in state_dict.items()})
    if not fsdp.is_sharded(model):
        model.load_state_dict(state_dict)
    return state_dict


def check_finite(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Stop on weights that hold NaN or infinite values: a run from them would report a diverged
    loss, and an evaluation of them chance-level figures, for a cause that is the file's."""
    bad = [k for k, t in state_dict.items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:
        named = ", ".join(bad[:3]) + (", …" if len(bad) > 3 else "")
        raise UserError(
            f"{path} holds weights that are not finite (NaN or infinite values in {named}): "
            "nothing can be trained from them or evaluated. Use an earlier checkpoint (best.pt "
            "is a second one), or start without it."
        )


def load_shards(model: nn.Module, path: Path, shards: str) -> None:
    """Load the model's weights from the `shards` folder that the checkpoint at `path` names
    into the model FSDP sharded (every rank calls it, and reads its own parts)."""
    saved = fsdp.saved_tensors(Path(shards))
    check_architecture(model, path, {name: shape for name, (shape, _) in saved.items()})
    note_conversion(model, path, {name: dtype for name, (_, dtype) in saved.items()})
    fsdp.load_sharded(model, Path(shards))


def check_architecture(model: nn.Module, path: Path, saved: dict[str, tuple[int, ...]]) -> None:
    """Stop with the first keys and shapes that differ between the `saved` tensors' shapes (of
    the checkpoint at `path`) and the model's own."""
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    problems = [
        f"{key} {_shape(saved[key])} in the file, {_shape(shape)} in the model"
        for key, shape in expected.items()
        if key in saved and saved[key] != shape
    ]
    problems += [f"{key} missing from the file" for key in expected if key not in saved]
    problems += [f"{key} not in the model" for key in saved if key not in expected]
    if problems:
        shown = "; ".join(problems[:3]) + ("; …" if len(problems) > 3 else "")
        name = type(model).__name__
        if fsdp.is_sharded(model):  # FSDP made its class FSDP<name>
            name = name.removeprefix("FSDP")
        raise UserError(
            f"{path} holds weights of another architecture than {name} ({shown}). "
            "Choose the model= (and its sizes) it was saved with."
        )


def note_conversion(model: nn.Module, path: Path, saved: dict[str, torch.dtype]) -> None:
    """One line where the file's float weights (`saved` dtypes) are of another dtype than the
    model's: a float32 checkpoint continued in float64 (trainer.precision=64), or the other way.
    Loading converts them, and the optimizer's state with them."""
    ours = {t.dtype for t in model.state_dict().values() if t.is_floating_point()}
    theirs = {dtype for dtype in saved.values() if dtype.is_floating_point}
    if theirs and ours and theirs != ours:
        file, here = (
            ", ".join(sorted(str(d).removeprefix("torch.") for d in s)) for s in (theirs, ours)
        )
        log.info("Weights converted on load: %s in %s, %s in this run", file, path, here)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


def restore(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    process: Process,
) -> bool:
    """Continue the optimizer's state, the loss scale and this rank's random streams from
    `state` (the schedule is this config's, stepped to where it stood: `resume.replan`).

    Returns False when the random streams could not continue (another number of processes).
    """
    model = unwrap(model)
    if SHARDS in state:  # checkpoint.sharded=true: each rank reads its own parts
        fsdp.load_sharded(model, Path(state[SHARDS]), optimizer)  # the model's: build_model
    elif fsdp.is_sharded(model):  # each rank keeps its shards of the whole state
        fsdp.load_optimizer_state(model, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    if state.get("scaler"):  # {} from a run without float16's loss scaling: start a fresh scale
        scaler.load_state_dict(state["scaler"])
    if len(state["rng"]) != process.world_size:
        log.warning(
            "The checkpoint was saved by %d processes and this run has %d: weights, optimizer, "
            "schedule and sample order continue, dropout's random streams start afresh.",
            len(state["rng"]),
            process.world_size,
        )
        return False
    set_rng_state(state["rng"][process.rank])
    return True
