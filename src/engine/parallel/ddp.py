"""parallel=ddp: DistributedDataParallel, one process per device, each holding the whole model and
all-reducing the gradients of its share of every batch."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from src.engine.errors import UserError, above, refuse
from src.engine.parallel import compiled
from src.engine.parallel.group import GroupStrategy


@dataclass
class DDP(GroupStrategy):
    """`nn.parallel.DistributedDataParallel` around the (compiled) model."""

    name: ClassVar[str] = "ddp"
    syncs_batchnorm: ClassVar[bool] = True
    # Search each step for parameters that got no gradient (slower).
    find_unused_parameters: bool = False
    bucket_cap_mb: float = above(0, 25)  # MiB of gradients all-reduced together in one bucket
    gradient_as_bucket_view: bool = False  # gradients alias the all-reduce buckets (less memory)
    static_graph: bool = False  # promise the same parameters are used every step (optimisations)
    # BatchNorm with batch statistics over all ranks' shares (nn.SyncBatchNorm; CUDA only).
    sync_batchnorm: bool = False
    # The drift guard: compare the ranks' parameters (a checksum); stop at the first that differs.
    # eval = before each validation and save; N = also every N steps; null = never.
    check_sync_every_n_steps: Any = "eval"

    def __post_init__(self) -> None:
        super().__post_init__()
        every = self.check_sync_every_n_steps
        steps = isinstance(every, int) and not isinstance(every, bool) and every >= 1
        if not (steps or every in (None, "eval")):
            refuse("parallel.check_sync_every_n_steps", every, "eval (before each validation and "
                   "save), N of 1 or more (also every N steps) or null")  # fmt: skip

    @property
    def drift_every(self) -> int | str | None:
        return self.check_sync_every_n_steps

    def check(self, settings: Any) -> None:
        super().check(settings)
        if self.static_graph and settings.trainer.accumulate_grad_batches > 1:
            raise UserError(
                "parallel.static_graph=true cannot skip the all-reduce of accumulated "
                "micro-batches (DDP's no_sync asserts, pytorch/pytorch#143580): use "
                "parallel.static_graph=false with trainer.accumulate_grad_batches."
            )
        on_cpu = str(settings.device).startswith(("cpu", "mps"))
        if self.sync_batchnorm and (on_cpu or not torch.cuda.is_available()):
            raise UserError(
                "parallel.sync_batchnorm=true needs CUDA GPUs: PyTorch's SyncBatchNorm runs only "
                "there. Leave it false on CPUs (each rank then normalises by its own share's "
                "statistics)."
            )

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        if self.sync_batchnorm:  # BatchNorm's statistics over all ranks' shares
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        device = next(model.parameters()).device
        return nn.parallel.DistributedDataParallel(
            compiled(model, trainer),
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
        return super().unwrap(model.module if wrapped else model)

    def evaluated(self, model: nn.Module) -> nn.Module:
        """The model inside: DDP's forward may broadcast buffers, a collective that ranks with
        different numbers of evaluation batches would hang in."""
        return model.module

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync()
