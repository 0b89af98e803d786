"""SIGTERM and Ctrl-C (pre-emption, torchrun shutting down): during training they ask it to stop
at a step, which saves `last.pt` and prints the command that resumes; outside training they
interrupt, and the run says where it stopped and what is kept."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from torch import nn

from src.engine.checkpoint import Checkpointer
from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress
from src.engine.errors import Stopped
from src.engine.parallel import Process


class StopSignals(Hook):
    """SIGTERM and SIGINT ask training to stop: one process after a step, DDP at the next check."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed_to_stop = False

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return [bool(self.received)]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        self.agreed_to_stop = self.agreed_to_stop or bool(sums[0])

    def wants_stop(self, run: Run) -> bool:  # alone, a process stops at once: no rank to agree with
        return self.agreed_to_stop or (run.process.world_size == 1 and bool(self.received))

    def stop(self, run: Run, progress: Progress) -> NoReturn:
        """End the run with the command that resumes it."""
        saver, step = run.checkpointer, progress.step
        if not run.process.is_main:
            sys.exit(1)  # quietly: rank 0 tells the user
        if not saver.policy.save:
            raise Stopped(f"Stopped by a signal after step {step} (checkpoint.save=false).")
        raise Stopped(
            f"Stopped by a signal after step {step}; {saver.last} is saved. "
            f"Run the same command with hydra.run.dir={saver.run_dir} to resume."
        )


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Outside training, SIGTERM interrupts as Ctrl-C does, so the run can say where it stopped
    (`interrupted`). Python handles signals in the main thread only: elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(process: Process, when: str) -> Stopped:
    """The sentence for a signal outside training (`when`: where the run was, and what is kept)."""
    if not process.is_main:
        sys.exit(1)  # quietly, as at a stop during training
    return Stopped(f"Stopped by a signal {when}.")


def during_the_test(step: int, checkpointer: Checkpointer) -> str:
    """Where a signal during the test finds a run that trained to `step`, and what is kept."""
    kept = "checkpoint.save=false kept no weights"
    if checkpointer.policy.save:
        kept = f"{checkpointer.run_dir}/checkpoints holds its weights (test one with train=false "
        kept += "ckpt_path=...)"
    return f"after training ended at step {step}, during the test; {kept}"
