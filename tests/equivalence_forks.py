"""What a fork adds that `debug=equivalence` must judge rightly (tests/test_debug_equivalence.py):
two parallel modes that train something else than one process does, through a DDP communication
hook (tests/conf/parallel/scaled_ddp.yaml and bf16_ddp.yaml name them), and a task with state
that changes its loss, which each layout must build afresh."""

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from src.engine.parallel.ddp import DDP
from src.tasks import Classification


@dataclass
class ScaledDDP(DDP):
    """DDP whose communication hook averages each bucket over the ranks, then scales it by
    `scale`: a bug in a fork's reduction, every gradient 1% too large."""

    name: ClassVar[str] = "scaled_ddp"
    scale: float = 1.01  # what each averaged gradient is multiplied by

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        wrapped = super().wrap(model, trainer)
        wrapped.register_comm_hook(state=self.scale, hook=scaled_average)
        return wrapped


def scaled_average(scale: float, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """The bucket's mean over the ranks times `scale`, all-reduced asynchronously."""
    tensor = bucket.buffer().mul_(scale / dist.get_world_size())
    reduced = dist.all_reduce(tensor, async_op=True).get_future()
    return reduced.then(lambda future: future.value()[0])


@dataclass
class Bf16DDP(DDP):
    """DDP whose gradients travel in bfloat16 (PyTorch's `bf16_compress_hook`): each gradient
    rounded to 8 bits of mantissa, a real difference from one process's, whatever the precision
    training runs in."""

    name: ClassVar[str] = "bf16_ddp"

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        wrapped = super().wrap(model, trainer)
        wrapped.register_comm_hook(state=None, hook=bf16_compress_hook)
        return wrapped


class HalvesItsSmoothing(Classification):
    """A task with state of its own that changes its training loss: the label smoothing halves
    after each evaluation (a curriculum), and the checkpoint holds how many there were. Layouts
    that shared one such task would each start where the one before left it."""

    def __init__(self, label_smoothing: float = 0.2) -> None:
        super().__init__(label_smoothing)
        self.evaluations = 0

    def loss(self, outputs: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        smoothing = self.label_smoothing / 2**self.evaluations
        return F.cross_entropy(outputs, targets, reduction="sum", label_smoothing=smoothing)

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        self.evaluations += 1
        return super().metrics(sums)

    def state_dict(self) -> dict:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict) -> None:
        self.evaluations = state["evaluations"]
