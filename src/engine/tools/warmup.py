"""`trainer.warmup_steps=N`: what is slow the first time (compilation, autotuning, CUDA graph
capture) done before training, then undone, so training goes on exactly as without it."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from itertools import chain, islice

import torch

from src.engine import checkpoint
from src.engine.core.context import Hook, Run
from src.engine.core.evaluate import evaluate
from src.engine.core.state import Parts, Progress
from src.engine.core.step import train_step

log = logging.getLogger(__name__)


class WarmUp(Hook):
    """Warms up as training starts (not when a resumed run has nothing left to train)."""

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        warm_up(run, parts, progress.step)
        yield


def warm_up(run: Run, parts: Parts, step: int) -> None:
    """`trainer.warmup_steps=N`: train N steps (at least 2) on the first batches of an epoch and
    two on its last (often smaller) batch, evaluate once, then undo it all: the weights, the
    optimizer, the scaler and the random generators are put back as they were, so training goes
    on exactly as without it. What stays is what is slow the first time: torch.compile's
    compilation (once per batch shape), cuDNN's autotuning, CUDA graph capture (on a shape's
    second run), the allocator's pools. Logs its seconds.
    """
    started = time.perf_counter()
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    data, process, trainer = run.data, run.process, run.trainer
    plain = run.strategy.unwrap(model)
    saved = copy.deepcopy((plain.state_dict(), optimizer.state_dict(), scaler.state_dict()))
    generators = checkpoint.rng_state()
    # Each batch shape at least twice: CUDA graph trees run a new graph once, then record it.
    steps, last = min(max(trainer.warmup_steps, 2), data.steps_per_epoch), data.steps_per_epoch - 1
    model.train()
    batches = chain(
        islice(data.train_batches(1), steps),
        data.train_batches(1, skip=last),  # the last batch, often smaller: another shape
        data.train_batches(1, skip=last),
    )
    for batch in batches:
        train_step(run, parts, batch)
    evaluate(run, model, "val" if data.size("val") else "test")  # its metrics dropped
    plain.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    scaler.load_state_dict(saved[2])
    checkpoint.set_rng_state(generators)
    if process.device.type == "cuda":
        torch.cuda.synchronize(process.device)
    seconds = time.perf_counter() - started
    log.info("Warm-up (compilation, autotuning; its steps undone): %.2f s", seconds)
    if run.logger:
        run.logger.log({"step": step, "time/warmup_s": seconds})
