"""SIGTERM and Ctrl-C (pre-emption, torchrun): during training they ask it to stop at a step, saving
`last.pt` and printing the command that resumes; outside it they interrupt, telling what is kept."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NoReturn

from torch import nn

from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress
from src.engine.errors import Stopped
from src.engine.parallel import Process


class StopSignals(Hook):
    """SIGTERM and SIGINT ask training to stop: one process after a step, DDP at the next check."""

    received: int | None = None  # the signal this process got
    agreed_to_stop = False  # the ranks agreed at a check

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        return handling(self._handle, signal.SIGTERM, signal.SIGINT)

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return [bool(self.received)]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        self.agreed_to_stop = self.agreed_to_stop or bool(sums[0])

    def wants_stop(self, run: Run) -> bool:  # alone, a process stops at once: no rank to agree with
        return self.agreed_to_stop or (run.process.world_size == 1 and bool(self.received))

    def stop(self, run: Run, progress: Progress) -> NoReturn:
        """End the run with the command that resumes it (rank 0 tells it)."""
        saver, when = run.checkpointer, f"after step {progress.step}"
        if not saver.policy.save:
            raise interrupted(run.process, f"{when} (checkpoint.save=false)")
        resume = f"Run the same command with hydra.run.dir={saver.run_dir} to resume"
        raise interrupted(run.process, f"{when}; {saver.last} is saved. {resume}")


@contextmanager
def handling(handler: Callable[[int, Any], None], *signums: int) -> Iterator[None]:
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


class Interrupts(AbstractContextManager):
    """Outside training, SIGTERM interrupts as Ctrl-C does (Python's main thread only gets them),
    and either ends the run with a sentence of where it was (`when`) and what is kept."""

    def __init__(self, process: Process, when: str) -> None:
        self.process, self.when, self.handling = process, when, nullcontext()
        if threading.current_thread() is threading.main_thread():
            self.handling = handling(signal.default_int_handler, signal.SIGTERM)

    def __enter__(self) -> Interrupts:
        self.handling.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.handling.__exit__(None, None, None)
        if exc_type is KeyboardInterrupt:
            raise interrupted(self.process, self.when) from None


def interrupted(process: Process, when: str) -> Stopped:
    """The sentence for a signal (`when`: where the run was, and what is kept); quiet off rank 0."""
    if not process.is_main:
        sys.exit(1)  # quietly: rank 0 tells the user
    return Stopped(f"Stopped by a signal {when}.")
