"""`trainer.profile=N`: a torch.profiler trace of the run's first N training steps, after one to
warm up, one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto; then
where it is, and torch.profiler's table of the ten costliest operations (rank 0's)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress

log = logging.getLogger(__name__)


class Profiler(Hook):
    @contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "gpuGetDeviceCount failed" on a CPU
        cuda = run.process.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        trace = tensorboard_trace_handler(str(run.run_dir / "profile"), f"rank{run.process.rank}")
        steps = schedule(wait=0, warmup=1, active=run.trainer.profile, repeat=1)
        self.profile = profile(
            activities=activities, schedule=steps, on_trace_ready=trace, record_shapes=True
        )
        with self.profile:
            yield
        if run.process.is_main:
            costliest = self.profile.key_averages().table(
                sort_by=f"self_{'cuda' if cuda else 'cpu'}_time_total", row_limit=10
            )
            folder = run.run_dir / "profile"
            log.info("Trace of %d steps in %s/, a file per rank; rank 0's costliest operations:"
                     "\n%s", run.trainer.profile, folder, costliest)  # fmt: skip

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.profile.step()
