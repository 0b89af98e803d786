"""A parallel mode of a fork's, outside src/: DDP whose gradients travel through a communication
hook of its own (a file, and tests/conf/parallel/hooked_ddp.yaml naming it). It averages each
bucket over the ranks, as DDP's default all-reduce does, so it trains what one process trains."""

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from src.engine.parallel.ddp import DDP

log = logging.getLogger(__name__)


@dataclass
class HookedDDP(DDP):
    """DDP with `average` registered as its communication hook."""

    name: ClassVar[str] = "hooked_ddp"
    announce: bool = True  # say, at the first bucket, that the hook reduces the gradients

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        wrapped = super().wrap(model, trainer)
        wrapped.register_comm_hook(state={"announce": self.announce}, hook=average)
        return wrapped


def average(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean over the ranks, all-reduced asynchronously."""
    if state.pop("announce", False):
        log.info("hooked_ddp: the gradients are averaged by its own communication hook")
    tensor = bucket.buffer().div_(dist.get_world_size())
    reduced = dist.all_reduce(tensor, async_op=True).get_future()
    return reduced.then(lambda future: future.value()[0])


class Unfinished:
    """A strategy written from scratch that answers only part of the protocol."""

    name = "unfinished"

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        return model


@dataclass
class Untyped(DDP):
    """A variant of DDP with a setting declared without a type: no field, so no key."""

    hook = "fp16"
