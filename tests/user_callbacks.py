"""A fork's own callback, outside src/ (tests/conf/callbacks/watch.yaml names it, found through
hydra.searchpath with tests/ on PYTHONPATH): it keeps state, logs a metric, and can vote to stop
or fail on one rank only, as a callback's bug would; or sleep, a run that holds its folder a while
without computing."""

import time

import torch

from src.engine.core.context import Callback


class Watch(Callback):
    def __init__(
        self,
        stop_at: int | None = None,
        fail_at: int | None = None,
        on_rank: int = 0,
        forgets_its_state: bool = False,
        sleep_at_epoch_end: float = 0.0,
    ):
        self.stop_at, self.fail_at, self.on_rank = stop_at, fail_at, on_rank
        self.forgets_its_state, self.steps = forgets_its_state, 0
        self.sleep_at_epoch_end = sleep_at_epoch_end

    def on_step_end(self, run, parts, progress, loss: torch.Tensor) -> None:
        self.steps += 1
        if self.steps == self.fail_at and run.process.rank == self.on_rank:
            raise RuntimeError(f"a bug at step {self.steps}")

    def on_epoch_end(self, run, parts, progress) -> None:
        time.sleep(self.sleep_at_epoch_end)
        if run.logger:
            run.logger.log({**progress.record, "watch/steps": self.steps})

    def should_stop(self, run, progress) -> str:
        mine = run.process.rank == self.on_rank
        return (
            f"{self.steps} steps seen"
            if mine and self.stop_at and self.steps >= self.stop_at
            else ""
        )

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["count" if self.forgets_its_state else "steps"]
