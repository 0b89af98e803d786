"""`trainer.warmup_steps=N`: what is slow the first time (compilation, autotuning, CUDA graph
capture) done before training, then undone, so training goes on exactly as without it."""

from __future__ import annotations

import copy
import logging
import time
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, islice

import torch

from src.engine import checkpoint
from src.engine.core.context import Hook, Parts, Progress, Run
from src.engine.core.evaluate import evaluate
from src.engine.core.loop import train_step
from src.engine.parallel import unwrap

log = logging.getLogger(__name__)


class WarmUp(Hook):
    """Warms up as training starts (not when a resumed run has nothing left to train)."""

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        """Train `trainer.warmup_steps` steps (at least 2) on an epoch's first batches and two on
        its last, evaluate once, then put back the weights, optimizer, scaler and random
        generators."""
        started = time.perf_counter()
        undone = (unwrap(parts.model), parts.optimizer, parts.scaler)
        saved, rng = copy.deepcopy([part.state_dict() for part in undone]), checkpoint.rng_state()
        # Each batch shape at least twice: CUDA graph trees run a new graph once, then record it.
        steps = min(max(run.trainer.warmup_steps, 2), run.data.steps_per_epoch)
        last = run.data.steps_per_epoch - 1  # the last batch, often smaller: another shape
        parts.model.train()
        twice_last = (run.data.train_batches(1, skip=last) for _ in range(2))
        for batch in chain(islice(run.data.train_batches(1), steps), *twice_last):
            train_step(run, parts, batch)
        evaluate(run, parts.model, "val" if run.data.size("val") else "test")  # its metrics dropped
        for part, state in zip(undone, saved, strict=True):
            part.load_state_dict(state)
        checkpoint.set_rng_state(rng)
        if run.process.device.type == "cuda":
            torch.cuda.synchronize(run.process.device)
        seconds = time.perf_counter() - started
        log.info("Warm-up (compilation, autotuning; its steps undone): %.2f s", seconds)
        if run.logger:
            run.logger.log({"step": progress.step, "time/warmup_s": seconds})
        return nullcontext()
