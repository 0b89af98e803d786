"""`trainer.profile=N`: a torch.profiler trace of N training steps, one file per rank."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress
from src.engine.parallel import Process


class Profiler(Hook):
    """Profiles the first training steps of the run (after one to warm up)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        with profiler(self.steps, run.run_dir, run.process) as self.profile:
            yield

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.profile.step()


def profiler(steps: int, run_dir: Path, process: Process) -> AbstractContextManager:
    """`trainer.profile=N`: a torch.profiler trace of N training steps (after one to warm up),
    one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto."""
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if process.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir / "profile"), f"rank{process.rank}"),
        record_shapes=True,
    )
