"""Callbacks the template ships, each named in a file of conf/callbacks/ (`callbacks=ema`). A fork's
own is a class like these (subclassing `Callback`, src/engine/core/context.py) and a YAML file;
docs/layout.md shows one."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from src.engine.core.context import Callback, Parts, Progress, Run
from src.engine.errors import UserError, refuse
from src.engine.parallel import full, unwrap

log = logging.getLogger(__name__)


class EMA(Callback):
    """An exponential moving average of the weights (timm's ModelEmaV3, Lightning's
    EMAWeightAveraging): after each optimizer step `average = decay * average + (1 - decay) *
    weights`, over the parameters and the floating buffers (BatchNorm's statistics), kept beside
    the weights on their device (under FSDP, each rank its shards). Validation and test evaluate
    the average (`evaluate: raw`, the weights themselves), so it picks best.pt; it is saved in
    last.pt and best.pt and resumed exactly."""

    def __init__(self, decay: float = 0.999, evaluate: str = "average"):
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay < 1:
            refuse("callbacks.ema.decay", decay, "a number from 0 up to below 1 (0.999 is usual)")
        if evaluate not in ("average", "raw"):
            refuse("callbacks.ema.evaluate", evaluate, "average or raw (the weights themselves)")
        self.decay, self.evaluate = float(decay), evaluate
        self.model: nn.Module | None = None
        self.live: dict[str, torch.Tensor] = {}  # the model's own tensors, by state_dict name
        self.average: dict[str, torch.Tensor] = {}

    def setup(self, run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = unwrap(model)
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        self.live = {name: t.detach() for name, t in tensors if t.is_floating_point()}
        self.average = {name: t.clone() for name, t in self.live.items()}
        if run.process.is_main:
            weights = "the weights themselves" if self.evaluate == "raw" else "the average"
            log.info(
                f"callbacks.ema: an average of the weights, decay {self.decay}; validation and "
                f"test evaluate {weights} (callbacks.ema.evaluate={self.evaluate})"
            )

    @torch.no_grad()
    def on_step_end(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        # One fused update per kind of tensor: FSDP's sharded parameters beside plain buffers.
        for kind in {type(t) for t in self.live.values()}:
            names = [name for name, t in self.live.items() if type(t) is kind]
            averages, weights = [self.average[n] for n in names], [self.live[n] for n in names]
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)

    @contextmanager
    def evaluating(self, run: Run, model: nn.Module, split: str) -> Iterator[None]:
        """The average in the model's tensors while `split` is evaluated, the weights put back."""
        if self.evaluate == "raw" or not self.live:  # raw, or not trained here (train=false)
            yield
            return
        if split == "test" and run.process.is_main:
            log.info("The test evaluates callbacks.ema's average of these weights (decay %s)",
                     self.decay)  # fmt: skip
        weights = {name: t.clone() for name, t in self.live.items()}
        self._put(self.average)
        try:
            yield
        finally:
            self._put(weights)

    @torch.no_grad()
    def _put(self, values: dict[str, torch.Tensor]) -> None:
        for name, tensor in self.live.items():
            tensor.copy_(values[name])
        for module in self.model.modules():  # FSDP keeps its root's weights gathered after a
            if callable(getattr(module, "reshard", None)):  # forward: gathered anew from these
                module.reshard()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole average on every rank (gathered from FSDP's shards), on the CPU."""
        return {name: full(t).detach().cpu() for name, t in self.average.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        ours = {name: tuple(t.shape) for name, t in self.average.items()}  # FSDP's: whole
        theirs = {name: tuple(t.shape) for name, t in state.items()}
        if ours != theirs:
            differ = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
            raise UserError(
                f"The checkpoint's callbacks.ema averages other weights than this model's "
                f"({', '.join(differ[:3])}{', …' if len(differ) > 3 else ''}): resume with the "
                "model it was saved with, or start from its weights with init_from=PATH."
            )
        for name, average in self.average.items():
            whole = state[name].to(average.device, average.dtype)
            if hasattr(average, "device_mesh"):  # FSDP: this rank's shards of it
                from torch.distributed.tensor import distribute_tensor

                whole = distribute_tensor(whole, average.device_mesh, average.placements)
            average.copy_(whole)
