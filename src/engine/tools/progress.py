"""What each epoch's training shows: its progress bar, on a terminal (the main process only), and
its speed (images of all ranks per second) and memory, printed and logged."""

from __future__ import annotations

import logging
import resource
import sys
import threading
import time
from itertools import chain

import torch
from tqdm import tqdm

from src.engine.core.context import Hook, Parts, Progress, Run
from src.engine.parallel import local

log = logging.getLogger(__name__)

# One process draws: a thread lock will do (tqdm's multiprocessing lock leaks in a DDP worker).
tqdm.set_lock(threading.RLock())


class ProgressBar(Hook):
    """tqdm's bar over the epoch's steps, from where a resumed epoch stands."""

    def epoch_started(self, run: Run, progress: Progress) -> None:
        step, steps = progress.epoch_step, run.data.steps_per_epoch
        hidden = not (run.process.is_main and sys.stdout.isatty())
        self.bar = tqdm(
            initial=step, total=steps, desc=f"epoch {progress.epoch}", leave=False, disable=hidden
        )

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        self.bar.update()

    def epoch_ended(self, run: Run, parts: Parts, progress: Progress) -> None:
        self.bar.close()


class Speed(Hook):
    """Times each epoch's training steps, from the first to the last (not its validation)."""

    def epoch_started(self, run: Run, progress: Progress) -> None:
        if run.process.device.type == "cuda":  # this epoch's peak, not an earlier evaluation's
            torch.cuda.reset_peak_memory_stats(run.process.device)
        self.started, self.skipped = time.perf_counter(), progress.epoch_step * run.data.batch_size

    def epoch_ended(self, run: Run, parts: Parts, progress: Progress) -> None:
        data, device = run.data, run.process.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - self.started
        # The images of the global batches trained: the epoch's last one may be smaller.
        images = min(progress.epoch_step * data.batch_size, data.size("train")) - self.skipped
        speed = {"time/train_s": seconds, "time/images_per_s": images / seconds}
        speed["memory/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if device.type == "cuda":
            speed["memory/peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        speed["memory/state_mb"] = state = state_mb(parts)
        peak = speed.get("memory/peak_cuda_mb", speed["memory/peak_rss_mb"])
        epoch = progress.epoch
        if epoch % run.trainer.log_every_n_epochs == 0 or epoch == run.trainer.epochs:
            log.info(  # metrics.jsonl gets every epoch's
                f"epoch {epoch} trained in {seconds:.2f} s ({images / seconds:.0f} "
                f"{'images' if data.is_image else 'samples'}/s), peak "
                f"memory {peak:.0f} MB (weights, gradients and optimizer state {state:.1f} MB)"
            )
        if run.logger:
            run.logger.log({**progress.record, **speed})


def state_mb(parts: Parts) -> float:
    """MiB of this rank's weights, gradients and optimizer state (1/N of them under FSDP)."""
    grads = [p.grad for p in parts.model.parameters() if p.grad is not None]
    moments = [v for s in parts.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = map(local, chain(parts.model.parameters(), grads, moments))
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20
