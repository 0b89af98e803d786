"""What a rank is, and the model's parallel wrappers: plain, DataParallel, DDP or FSDP.

What a rank is lives here (its setup is `src/engine/launch/process.py`). The rest of the code
asks the `Process` it is given: `process.is_main` before any side effect, `process.device` for
tensors, and its collectives (which do nothing in a single process).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from src.engine import fsdp
from src.engine.settings import PROCESS_GROUP_MODES, Parallel, Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Process:
    """Where this process stands: its parallel mode, its rank among the DDP (or FSDP) ranks, its
    device."""

    mode: str = "none"  # none | dp | ddp | fsdp
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_ids: tuple[int, ...] = ()  # parallel=dp: the GPUs each batch is split over

    @property
    def in_group(self) -> bool:
        """One rank of a process group (ddp, fsdp): the collectives below talk to the others."""
        return self.mode in PROCESS_GROUP_MODES

    @property
    def is_main(self) -> bool:
        """The one process that logs, writes files and talks to wandb."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """The one process per machine that prepares machine-local things (the dataset files)."""
        return self.local_rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order; also a barrier."""
        if not self.in_group:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (the same shape on each), in rank order."""
        if not self.in_group:
            return [tensor]
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if not self.in_group:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with rank 0's."""
        if not self.in_group:
            return
        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.in_group:
            dist.barrier()

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (in float64, so counts stay exact)."""
        if not self.in_group:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()


def seed_dp_replicas(process: Process, seed: int) -> None:
    """Under parallel=dp each GPU's replica draws its own dropout masks, as DDP's ranks do; the
    first GPU keeps `seed`, as one process on it would (torch.manual_seed seeds every GPU alike)."""
    for i, index in enumerate(process.device_ids[1:], start=1):
        torch.cuda.default_generators[index].manual_seed(seed + i)


def wrap(model: nn.Module, parallel: Parallel, process: Process, trainer: Trainer) -> nn.Module:
    """The model as the parallel mode trains it: plain, DataParallel, DistributedDataParallel,
    or sharded by FSDP."""
    if process.mode == "fsdp":
        units, dtype = list(parallel.shard_modules), trainer.autocast_dtype
        return fsdp.shard(model, units, parallel.reshard_after_forward, dtype, process.device)
    if process.mode == "ddp":
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=[process.device.index] if process.device.type == "cuda" else None,
            find_unused_parameters=parallel.find_unused_parameters,
            bucket_cap_mb=parallel.bucket_cap_mb,
            gradient_as_bucket_view=parallel.gradient_as_bucket_view,
            static_graph=parallel.static_graph,
        )
    if process.mode == "dp":
        # DataParallel wants the model on its first GPU; outputs (and the loss) on process.device.
        model = model.to(torch.device("cuda", process.device_ids[0]))
        return nn.DataParallel(
            model, device_ids=list(process.device_ids), output_device=process.device
        )
    return model


@contextmanager
def local_gradients(model: nn.Module, process: Process, local: bool = True) -> Iterator[None]:
    """While `local`, backward passes add to this rank's gradients without reducing them over
    the ranks (DDP's `no_sync`, FSDP's `set_requires_gradient_sync(False)`): the micro-batches
    before the last of an accumulated step."""
    if not local or not process.in_group:
        yield
    elif process.mode == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DataParallel or DDP wrapper, and inside torch.compile's. (FSDP
    wraps none: the model is its own, with sharded parameters.)"""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
