"""`trainer.profile=N`: a torch.profiler trace of the run's first N training steps, after one to
warm up, one file per rank in `profile/` of the run folder, for TensorBoard or Perfetto."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress


class Profiler(Hook):
    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        cuda = run.process.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        trace = tensorboard_trace_handler(str(run.run_dir / "profile"), f"rank{run.process.rank}")
        steps = schedule(wait=0, warmup=1, active=run.trainer.profile, repeat=1)
        self.profile = profile(
            activities=activities, schedule=steps, on_trace_ready=trace, record_shapes=True
        )
        return self.profile

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.profile.step()
