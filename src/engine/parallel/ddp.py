"""parallel=ddp: DistributedDataParallel, a process per device all-reducing its gradients."""

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.engine.errors import UserError, above, refuse
from src.engine.parallel.group import GroupStrategy


@dataclass
class DDP(GroupStrategy):
    name: ClassVar[str] = "ddp"
    sync_batchnorm: bool = False  # BatchNorm statistics over all ranks' shares (CUDA GPUs only)
    find_unused_parameters: bool = False  # search each step for parameters with no grad (slower)
    bucket_cap_mb: float = above(0, 25)  # MiB of gradients all-reduced together in one bucket
    gradient_as_bucket_view: bool = False  # gradients alias the all-reduce buckets (less memory)
    static_graph: bool = False  # promise the same parameters are used every step (optimisations)
    check_sync_every_n_steps: Any = "eval"  # when the drift guard compares the ranks' parameters

    def __post_init__(self) -> None:
        super().__post_init__()
        every = self.check_sync_every_n_steps
        said = "eval (before each validation and save), N >= 1 (also every N steps) or null"
        if not (every in (None, "eval") or (type(every) is int and every >= 1)):  # not a bool
            refuse("parallel.check_sync_every_n_steps", every, said)

    def check(self, settings: Any) -> None:
        super().check(settings)
        if self.static_graph and settings.trainer.accumulate_grad_batches > 1:
            raise UserError(
                "parallel.static_graph=true cannot skip the all-reduce of accumulated "
                "micro-batches (DDP's no_sync asserts, pytorch/pytorch#143580): leave it false."
            )
        on_cpu = str(settings.device).startswith(("cpu", "mps"))
        if self.sync_batchnorm and (on_cpu or not torch.cuda.is_available()):
            raise UserError(
                "parallel.sync_batchnorm=true needs CUDA GPUs: PyTorch's SyncBatchNorm runs only "
                "there. Leave it false on CPUs (each rank normalises by its own share)."
            )

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if self.sync_batchnorm else model
        device = next(model.parameters()).device
        return DistributedDataParallel(
            super().wrap(model, trainer),  # compiled inside DDP
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )

    def evaluated(self, model: nn.Module) -> nn.Module:
        """The inner model: DDP's forward may broadcast buffers, a hang for uneven evaluations."""
        return model.module

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync()
