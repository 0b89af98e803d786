"""`trainer.profile=N`: a torch.profiler trace of the run's first N training steps, after one to
warm up, one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto; then
where it is, and torch.profiler's table of the ten costliest operations (rank 0's)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from src.engine.core.context import Hook, Parts, Progress, Run

log = logging.getLogger(__name__)


class Profiler(Hook):
    @contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no "gpuGetDeviceCount failed" on a CPU
        folder, cuda = run.run_dir / "profile", run.process.device.type == "cuda"
        self.profile = profile(
            activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
            schedule=schedule(wait=0, warmup=1, active=run.trainer.profile, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(folder), f"rank{run.process.rank}"),
            record_shapes=True,
        )
        with self.profile:
            yield
        if run.process.is_main:
            sort = f"self_{'cuda' if cuda else 'cpu'}_time_total"
            costliest = self.profile.key_averages().table(sort_by=sort, row_limit=10)
            log.info(f"Trace of {run.trainer.profile} steps in {folder}/, a file per rank; rank "
                     f"0's costliest operations:\n{costliest}")  # fmt: skip

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        self.profile.step()
