"""The parallel modes, one strategy each, and the `Process` a strategy sets up (this rank: its
device, its collectives). A strategy's fields are its mode's keys (`conf/parallel/<mode>.yaml`);
what differs between modes is one of its methods, so the loop, the checkpoint and the data ask it,
never the mode's name. `Strategy` is one process on one device; other modes override it. What
every mode does alike is a function here: unwrapping a model, a sharded tensor's parts, the device
a process trains on."""

import importlib
import os
import pkgutil
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from src.engine.errors import Checked, UserError


@dataclass(frozen=True)
class Process:
    """Where this process stands: its rank in a process group (if any) and its device."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    in_group: bool = False  # one rank of a process group; outside one the collectives do nothing

    @property
    def is_main(self) -> bool:
        """The one process that logs, writes files and talks to wandb."""
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order; also a barrier."""
        gathered: list[Any] = [obj] * self.world_size  # outside a group: this one's alone
        if self.in_group:
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
        box = [obj]
        if self.in_group:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with rank 0's."""
        for tensor in tensors if self.in_group else ():
            dist.broadcast(tensor, src=0)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (in float64, so counts stay exact)."""
        if not self.in_group:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()


@dataclass
class Strategy(Checked):
    """One process on one device (parallel=none), and the protocol every mode answers."""

    section = "parallel"
    name: ClassVar[str] = "none"  # how messages and logs call the mode
    in_group: ClassVar[bool] = False  # a process per device in a process group (torchrun's)
    # Each rank holds a part of every parameter (FSDP): evaluation's forwards are collective (as
    # many on each rank), the drift guard has no copies to compare, and checkpoint.sharded=true
    # writes each rank's part (the mode's save_shards, load_shards and saved_tensors).
    sharded: ClassVar[bool] = False

    def check(self, settings: Any) -> None:
        """Refuse, in one sentence, what this mode cannot do with the other sections' settings."""
        if settings.checkpoint.sharded and not self.sharded:
            raise UserError(
                "checkpoint.sharded=true writes each FSDP rank's shards, and parallel="
                f"{self.name} holds whole weights: use parallel=fsdp, or leave it false."
            )

    def setup(self, device: str, trainer: Any) -> Process:
        """This process, on `device` (auto: the best this machine has), refused under torchrun."""
        if (world_size := int(os.environ.get("WORLD_SIZE", 1))) > 1:
            raise UserError(
                f"torchrun started {world_size} processes, but parallel={self.name} trains in "
                f"one. Add parallel=ddp (or fsdp), or run python train.py parallel={self.name} "
                "without torchrun."
            )
        found = pick_device(device)
        if found.type == "mps" and trainer.precision == "64":
            raise UserError(
                "trainer.precision=64, but mps has no float64: use device=cpu, or "
                "trainer.precision=32."
            )
        if found.type == "cuda" and found.index is not None:
            torch.cuda.set_device(found)  # else the CUDA context and pinned-memory thread use GPU 0
        return Process(device=found)

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        """The model as this mode trains it: compiled where `trainer.compile` asks (a mode wraps
        what this gives, or gives this its sharded model)."""
        if not trainer.compile:
            return model
        mode = None if trainer.compile is True else trainer.compile
        # CUDA graphs record one per batch shape: static shapes, compiled in the warm-up, not
        # mid-epoch.
        return torch.compile(model, mode=mode, dynamic=False if mode == "reduce-overhead" else None)

    def evaluated(self, model: nn.Module) -> nn.Module:
        """The model each rank evaluates its share of a split with."""
        return model

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Backward passes keeping gradients on this rank: a step's micro-batches but its last."""
        return nullcontext()

    def scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """float16's loss scaler (disabled: a no-op)."""
        return torch.amp.GradScaler(device.type, enabled=enabled)

    def seed_devices(self, seed: int) -> None:
        """Seed what this mode draws random numbers on beyond the default generators."""


# What the loop, the checkpoint and the launcher call: a class that lacks one is refused.
PROTOCOL = tuple(
    name
    for name, value in vars(Strategy).items()
    if not name.startswith("_") and (callable(value) or name in Strategy.__annotations__)
)


def strategies() -> list[type[Strategy]]:
    """The engine's strategies: the one of each module of this package named for its mode."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        classes = vars(importlib.import_module(f"{__name__}.{module.name}")).values()
        found += [c for c in classes if isinstance(c, type) and issubclass(c, Strategy)]
    return [c for c in found if c.__module__.endswith(f".{c.name}")]


def own_keys(cls: type[Strategy], keys: dict[str, Any]) -> dict[str, Any]:
    """`keys` for the mode `cls`, less DDP's that it lacks: false (a ddp command line moved over),
    they change nothing; true, one sentence says what this mode does instead."""
    if cls.in_group and not cls.sharded:  # ddp's own keys (or a fork's mode's)
        return keys
    lacks = ("sync_batchnorm", "find_unused_parameters") if cls.sharded else ("sync_batchnorm",)
    for key in [key for key in lacks if keys.get(key)]:
        if not cls.in_group:
            raise UserError(
                "parallel.sync_batchnorm=true syncs BatchNorm's statistics across DDP processes, "
                f"and parallel={cls.name} trains in one: use parallel=ddp, or leave it false."
            )
        if key == "sync_batchnorm":
            raise UserError(
                f"parallel.sync_batchnorm=true is DDP's: parallel={cls.name} normalises each "
                "rank's share by its own statistics. Use parallel=ddp for SyncBatchNorm, or leave "
                "it false."
            )
        raise UserError(
            "parallel.find_unused_parameters=true is DDP's: FSDP needs no search for parameters "
            f"without a gradient. Leave it false with parallel={cls.name}."
        )
    return {key: value for key, value in keys.items() if key not in lacks}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside what a strategy's `wrap` made of it (FSDP's shards it in place)."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


# A DTensor (FSDP's sharded parameter) is told by its methods: DTensor itself is not imported.
def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor; a whole one as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective); a whole one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def teardown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_device(requested: str, allow_mps: bool = True) -> torch.device:
    """`auto` is the first of cuda, mps, cpu that this machine has; anything else is checked."""
    if requested == "auto":
        mps = allow_mps and torch.backends.mps.is_available()
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(
            f"device={requested} is not a device. Use auto, cpu, cuda, cuda:N or mps."
        ) from None
    absent = {"cuda": "no CUDA GPU is visible", "mps": "MPS is not available"}.get(device.type)
    backend = torch.cuda if device.type == "cuda" else torch.backends.mps
    if absent and not backend.is_available():
        raise UserError(f"device={requested}, but {absent}. Use device=auto or device=cpu.")
    if device.type == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise UserError(
            f"device={requested}, but this machine shows {count} GPU(s), cuda:0 to "
            f"cuda:{count - 1}. Pick one of them, or device=auto."
        )
    return device


def rank_gpu(local_rank: int, count: int, visible: str | None) -> int:
    """`local_rank`'s GPU of the `count` visible: its own, or the one a cluster shows each rank."""
    if local_rank < count:
        return local_rank
    if count == 1 and visible is not None and "," not in visible:
        return 0
    raise UserError(
        f"torchrun started more processes on this machine than the {count} GPUs it sees "
        f"(local rank {local_rank}). Use --nproc_per_node={count} or fewer."
    )
