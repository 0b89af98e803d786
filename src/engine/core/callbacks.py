"""Callbacks: what a fork adds to the loop as a config list (`callbacks=ema`,
`callbacks=[ema,mine]`, one YAML file each in conf/callbacks/ naming its class by `_target_`),
called at the loop's named points. `Callback` is the class a fork subclasses; `Callbacks` is the
one hook (context.py) that calls them: the engine's own hooks, the ranks' one all-reduce and the
checkpoint stay as they are."""

from __future__ import annotations

import logging
import traceback
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from src.engine.checkpoint import check_part
from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress
from src.engine.errors import UserError, first_line, where

log = logging.getLogger(__name__)


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
    """The config's callbacks, by name, called in order at the hooks' points."""

    def __init__(self, callbacks: dict[str, Callback]):
        self.callbacks, self.parts = callbacks, None
        self.reasons: list[str] = []
        self.loaded: set[str] = set()  # those a checkpoint gave their state back

    def named(self) -> list[tuple[str, Callback]]:
        return list(self.callbacks.items())

    @property
    def stateful(self) -> dict[str, Callback]:
        return {n: c for n, c in self.callbacks.items() if callable(getattr(c, "state_dict", None))}

    def setup(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Each callback's `setup`, then its state checked to round-trip through a checkpoint."""
        for name, callback in self.named():
            self._call(name, callback, "setup", run, model, optimizer)
        for name, callback in self.stateful.items():  # in order: a state_dict may be collective
            check_part(f"callbacks.{name}", callback)

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        self.parts = parts
        missing = [name for name in self.stateful if name not in self.loaded]
        if progress.step and missing and run.process.is_main:
            log.info("The checkpoint holds no state of callbacks.%s (saved without it): it starts "
                     "afresh at step %d.", ", callbacks.".join(missing), progress.step)  # fmt: skip
        return nullcontext()

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        for name, callback in self.named():
            self._call(name, callback, "on_step_end", run, self.parts, progress, loss)

    def epoch_ended(self, run: Run, progress: Progress) -> None:
        for name, callback in self.named():
            self._call(name, callback, "on_epoch_end", run, self.parts, progress)

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        self.reasons = [self._call(n, c, "should_stop", run, progress) for n, c in self.named()]
        return [1.0 if reason else 0.0 for reason in self.reasons]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        for (name, _), reason, votes in zip(self.named(), self.reasons, sums, strict=True):
            if votes and not progress.stopped:
                why = f": {reason}" if reason else f" on {int(votes)} other rank(s)"
                progress.stopped = f"callbacks.{name} stopped training{why}"

    @contextmanager
    def evaluating(self, run: Run, model: nn.Module, split: str) -> Any:
        with ExitStack() as stack:
            for name, callback in self.named():
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
