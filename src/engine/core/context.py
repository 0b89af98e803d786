"""What a run's functions share: the run (`Run`: its process, settings, data, where results go,
and its hooks), the training state (what training changes and a checkpoint saves, each part with
its own `state_dict` and `load_state_dict`: the schedule, the progress; the model, the optimizer
and the scaler are torch's own, or adapted in src/engine/checkpoint.py), and the named points
where the guards and the tools plug into the loop (`Hook`; docs/layout.md has each one's when). A
check (`votes`, then `agreed`) puts every hook's values into one all-reduce, so a hook that raises
stops every rank at once. `Callback` is the class a fork's callbacks subclass: what a fork adds to
the loop as a config list (`callbacks=ema`, `callbacks=[ema,mine]`, one YAML file each in
conf/callbacks/ naming its class by `_target_`); `Callbacks` is the one hook that calls them."""

from __future__ import annotations

import logging
import math
import traceback
import warnings
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from src.engine.checkpoint import Checkpointer, check_part
from src.engine.config import Settings, Trainer
from src.engine.core.task import Task
from src.engine.data import Data
from src.engine.errors import UserError, first_line, where
from src.engine.logger import MetricsLogger
from src.engine.parallel import Process, Strategy

log = logging.getLogger(__name__)


@dataclass
class Best:
    """The best validation so far by `monitor`: the weights best.pt holds."""

    monitor: str  # a metric of the validation split: val/acc or val/loss
    mode: str  # max or min: whether a higher or a lower value is better
    value: float | None = None
    epoch: int | None = None
    stale: int = 0  # validations since the best one, which early stopping counts

    def update(self, metrics: dict[str, float], epoch: int) -> bool:
        """Count in the validation of `epoch`; True if it is the new best (ties keep the first)."""
        value = metrics[self.monitor]
        if self.value is None or (value > self.value if self.mode == "max" else value < self.value):
            self.value, self.epoch, self.stale = value, epoch, 0
            return True
        self.stale += 1
        return False

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """The record a checkpoint saved, if it watched the same monitor; else this fresh one."""
        if saved and (saved["monitor"], saved["mode"]) == (self.monitor, self.mode):
            vars(self).update(saved)
        elif saved:
            log.warning("The checkpoint picked its best epoch by %s (%s), this run by %s (%s): "
                        "the best so far starts afresh.", saved["monitor"], saved["mode"],
                        self.monitor, self.mode)  # fmt: skip


@dataclass
class Progress:
    """Where training stands: the part of the checkpoint a resumed run continues from."""

    epoch: int = 1  # the epoch training is in, from 1
    epoch_step: int = 0  # its batches done
    step: int = 0  # optimizer steps done in all
    metrics: dict[str, Any] = field(default_factory=dict)  # the last validation's
    best: Best | None = None  # the best validation so far; None without a validation split
    batch_size: int = 1  # the global batch epoch_step counts (data.batch_size)
    stopped: str = ""  # why a callback stopped training, which ends it for a resumed run too
    # Not saved: the images of an epoch (the data's).
    train_size: int = field(default=0, metadata={"saved": False})

    def state_dict(self) -> dict[str, Any]:
        """Every field (a field added is saved and loaded too), `best` as a plain dict."""
        saved = [f.name for f in fields(self) if f.metadata.get("saved", True)]
        state = {name: getattr(self, name) for name in saved}
        return state | {"best": self.best and asdict(self.best)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the checkpoint stood: at the same image of its epoch (under any batch
        size that divides the images done), in the next epoch if it was saved at an epoch's end."""
        saved, batches = state.get("batch_size") or self.batch_size, state["epoch_step"]
        for name, value in state.items():  # the batch size and the best: this run's, below
            if name not in ("batch_size", "best") and hasattr(self, name):
                setattr(self, name, value)
        self.epoch_step = self.rebatched(batches, saved)
        if self.best:
            self.best.load_state_dict(state.get("best"))
        if self.epoch_step >= math.ceil(self.train_size / self.batch_size):  # an epoch's end
            self.epoch, self.epoch_step = self.epoch + 1, 0
        log.info("Resuming at epoch %d, after %d of its batches, step %d",
                 self.epoch, self.epoch_step, self.step)  # fmt: skip

    def rebatched(self, batches: int, saved: int) -> int:
        """The checkpoint's `batches` of `saved` images into the epoch, in this run's batches:
        refused where they do not end on one of them."""
        if saved == self.batch_size:
            return batches
        done = min(batches * saved, self.train_size)
        if done == self.train_size:  # saved at the end of an epoch
            return math.ceil(self.train_size / self.batch_size)
        if done % self.batch_size:
            sizes = [d for d in range(1, done + 1) if done % d == 0]
            near = sorted(sorted(sizes, key=lambda d: (abs(d - self.batch_size), d))[:3])
            raise UserError(
                f"The checkpoint stands {done} images into epoch {self.epoch} ({batches} "
                f"batches of {saved}), which data.batch_size={self.batch_size} does not divide: "
                f"resume with one that does ({', '.join(map(str, near))}), or from a checkpoint "
                "at the end of an epoch."
            )
        log.info("The checkpoint's %d batches of %d into epoch %d are %d batches of %d",
                 batches, saved, self.epoch, done // self.batch_size, self.batch_size)  # fmt: skip
        return done // self.batch_size

    @property
    def record(self) -> dict[str, int]:
        """What a logged line says of where training stands."""
        return {"step": self.step, "epoch": self.epoch}

    @property
    def about(self) -> str:
        return f"epoch {self.epoch}, step {self.step}"

    @property
    def ended_in(self) -> int:
        """The last epoch trained in: this one if it has begun, else the one before."""
        return self.epoch if self.epoch_step else self.epoch - 1


@dataclass
class Schedule:
    """The learning-rate scheduler, stepped after each optimizer step or epoch; checkpointed."""

    scheduler: torch.optim.lr_scheduler.LRScheduler
    every_step: bool = False

    def after(self, step: bool) -> None:
        """Step the scheduler after an optimizer `step` (else an epoch), if it counts those."""
        if step == self.every_step:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This config's plan (its epochs, max_steps, batch size) stepped as far as the checkpoint's
        had been: a fresh run's rate there (the checkpoint's own, where the plan is the same)."""
        steps = state["last_epoch"]
        total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR cannot step past it
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(min(steps, total) if total else steps):
                self.scheduler.step()


class Parts(NamedTuple):
    """What training changes, and a checkpoint saves and restores."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler  # float16's loss scale; disabled (a no-op) for other precisions


class Hook:
    """A guard or a tool; each point does nothing unless a subclass overrides it."""

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        return nullcontext()

    def epoch_started(self, run: Run, progress: Progress) -> None:
        pass

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        pass

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return []

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        pass

    def epoch_ended(self, run: Run, parts: Parts, progress: Progress) -> None:
        pass


class Hooks(list[Hook]):
    """The run's hooks, called in order at each point; and a stop signal (SIGTERM, SIGINT: from
    pre-emption, torchrun, Ctrl-C) that its handler records during training, which the loop checks
    after each step: one process stops at once, a process group once a check agreed on it."""

    signal = 0  # the signal this process got during training
    signalled = False  # the ranks agreed at a check to stop at a signal

    def active(self, run: Run, parts: Parts, progress: Progress) -> ExitStack:
        stack = ExitStack()
        for hook in self.overriding("active"):  # each entered before the next is made
            stack.enter_context(hook.active(run, parts, progress))
        return stack

    def call(self, point: str, *args: Any) -> None:
        """Each hook's `point` (epoch_started, after_step, epoch_ended), in order."""
        for hook in self.overriding(point):
            getattr(hook, point)(*args)

    def overriding(self, point: str) -> list[Hook]:
        """The hooks that do something at `point` (whose class overrides Hook's), in order."""
        return [hook for hook in self if getattr(type(hook), point) is not getattr(Hook, point)]

    def check(
        self, run: Run, progress: Progress, loss: float = 0.0, weights: nn.Module | None = None
    ) -> float:
        """One all-reduce for this rank's `loss`, its stop signal and every hook's votes; each hook
        then reads the ranks' sums of its own. Returns the loss averaged over the ranks."""
        votes = [hook.votes(run, progress, weights) for hook in self]
        values = [loss, bool(self.signal), *(v for own in votes for v in own)]
        sums = run.process.sum_over_ranks(values)
        self.signalled = self.signalled or bool(sums[1])
        at = 2
        for hook, own in zip(self, votes, strict=True):
            hook.agreed(run, progress, sums[at : at + len(own)], weights)
            at += len(own)
        return sums[0] / run.process.world_size

    def received(self, signum: int, _frame: Any) -> None:
        """The handler of the stop signals during training: the request, kept for the loop."""
        self.signal = signum

    def stopping(self, run: Run) -> bool:
        """Whether a signal stops training after this step (alone, a process has no rank to
        agree with)."""
        return self.signalled or (run.process.world_size == 1 and bool(self.signal))

    @property
    def callbacks(self) -> Callbacks:
        """The config's callbacks among the hooks (none where a run was built without them)."""
        return next((hook for hook in self if isinstance(hook, Callbacks)), Callbacks({}))


@dataclass
class Run:
    """What one run's functions share: where this process stands, the checked settings, the data,
    where results go, and the hooks the loop calls. `logger` is None off the main process."""

    process: Process
    settings: Settings
    data: Data
    logger: MetricsLogger | None = None
    checkpointer: Checkpointer | None = None
    hooks: Hooks = field(default_factory=Hooks)
    run_dir: Path | None = None
    # The settings the loop reads most, as names of their own.
    trainer: Trainer = field(init=False)
    task: Task = field(init=False)
    strategy: Strategy = field(init=False)

    def __post_init__(self) -> None:
        self.trainer, self.task = self.settings.trainer, self.settings.task
        self.strategy = self.settings.parallel

    def autocast(self) -> AbstractContextManager:
        """Mixed precision on this process's device for bf16 or 16; nothing for 32 and 64."""
        dtype = self.trainer.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(self.process.device.type, dtype)


class Callback:
    """A fork's addition to the loop. Each method is called on every rank; each does nothing unless
    overridden. Log with `run.logger` (None off the main process):
    `run.logger.log({**progress.record, "mine/x": x})` reaches metrics.jsonl and wandb. A callback
    with `state_dict` and `load_state_dict` is saved in last.pt and best.pt under
    `callbacks.<name>`, and resumed."""

    def setup(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Before training, the model wrapped (and holding a resumed run's weights), before a
        resumed state of this callback is loaded."""

    def on_step_end(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        """After each optimizer step: the model and optimizer (`parts`), this rank's loss (still
        on the device: `.item()` waits for it)."""

    def on_epoch_end(self, run: Run, parts: Parts, progress: Progress) -> None:
        """After an epoch's last step (or a stop's), before its validation and save."""

    def evaluating(self, run: Run, model: nn.Module, split: str) -> AbstractContextManager:
        """A context around each evaluation of `split` (val, test): the weights it evaluates."""
        return nullcontext()

    def should_stop(self, run: Run, progress: Progress) -> str:
        """A reason to stop training now, or "": asked at each of the loop's checks (logging steps,
        before a validation or a save); one rank's reason stops every rank, after this step."""
        return ""


class Callbacks(Hook):
    """The config's callbacks, by name, called in order at the hooks' points; evaluation enters
    their `evaluating` itself."""

    def __init__(self, callbacks: dict[str, Callback]):
        self.callbacks, self.reasons = callbacks, []
        self.stateful = {
            n: c for n, c in callbacks.items() if callable(getattr(c, "state_dict", None))
        }
        self.loaded: set[str] = set()  # those a checkpoint gave their state back

    def setup(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Each callback's `setup`, then its state checked to round-trip through a checkpoint."""
        for name, callback in self.callbacks.items():
            self._call(name, callback, "setup", run, model, optimizer)
        for name, callback in self.stateful.items():  # in order: a state_dict may be collective
            check_part(f"callbacks.{name}", callback)

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        missing = [name for name in self.stateful if name not in self.loaded]
        if progress.step and missing and run.process.is_main:
            log.info("The checkpoint holds no state of callbacks.%s (saved without it): it starts "
                     "afresh at step %d.", ", callbacks.".join(missing), progress.step)  # fmt: skip
        return nullcontext()

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        for name, callback in self.callbacks.items():
            self._call(name, callback, "on_step_end", run, parts, progress, loss)

    def epoch_ended(self, run: Run, parts: Parts, progress: Progress) -> None:
        for name, callback in self.callbacks.items():
            self._call(name, callback, "on_epoch_end", run, parts, progress)

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        named = self.callbacks.items()
        self.reasons = [self._call(n, c, "should_stop", run, progress) for n, c in named]
        return [1.0 if reason else 0.0 for reason in self.reasons]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        for name, reason, votes in zip(self.callbacks, self.reasons, sums, strict=True):
            if votes and not progress.stopped:
                why = f": {reason}" if reason else f" on {int(votes)} other rank(s)"
                progress.stopped = f"callbacks.{name} stopped training{why}"

    @contextmanager
    def evaluating(self, run: Run, model: nn.Module, split: str) -> Any:
        """Around an evaluation of `split`: which weights it evaluates (an average's, say)."""
        with ExitStack() as stack:
            for name, callback in self.callbacks.items():
                stack.enter_context(self._call(name, callback, "evaluating", run, model, split))
            yield

    def state_dict(self) -> dict[str, Any]:
        return {name: callback.state_dict() for name, callback in self.stateful.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, callback in self.stateful.items():
            if name in state:
                callback.load_state_dict(state[name])
                self.loaded.add(name)

    def _call(self, name: str, callback: Callback, method: str, *args: Any) -> Any:
        """`callback.method(*args)`; what it raises is one sentence naming it, on every rank that
        meets it (a check stops the others: they wait for this rank in the next collective)."""
        try:
            return getattr(callback, method)(*args)
        except (UserError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:  # noqa: BLE001 - whatever a fork's code raises, told in one line
            frame = traceback.extract_tb(err.__traceback__)[-1]
            raise UserError(
                f"callbacks.{name} ({type(callback).__name__}, {where(type(callback))}) failed in "
                f"{method} with {type(err).__name__}: {first_line(err)} (at {frame.filename}:"
                f"{frame.lineno}). Fix the callback, or leave it out of callbacks=."
            ) from None
