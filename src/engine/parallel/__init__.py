"""The parallel modes, one strategy each, and the `Process` a strategy sets up (this rank: its
device, its collectives). A strategy's fields are its mode's keys (`conf/parallel/<mode>.yaml`);
what differs between modes is one of its methods, so the loop, the checkpoint and the data ask it,
never the mode's name. `Strategy` is one process on one device; other modes override it."""

import importlib
import pkgutil
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from src.engine.errors import Checked, UserError
from src.engine.parallel.devices import one_device


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
    replicated: ClassVar[bool] = True  # every rank holds the whole model (the drift guard checks)
    even_eval: ClassVar[bool] = False  # evaluation's forwards are collective: as many on each rank
    shards_checkpoints: ClassVar[bool] = False  # sharded: save_shards, load_shards, saved_tensors
    drift_every: ClassVar[int | str | None] = None  # the drift guard's checks (ddp's key)
    syncs_batchnorm: ClassVar[bool] = False  # takes parallel.sync_batchnorm=true
    sync_batchnorm: bool = False  # DDP only: BatchNorm statistics over all ranks' shares (CUDA)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync_batchnorm and not self.syncs_batchnorm:
            raise UserError(
                "parallel.sync_batchnorm=true syncs BatchNorm's statistics across DDP processes, "
                f"and parallel={self.name} trains in one: use parallel=ddp, or leave it false."
            )

    def check(self, settings: Any) -> None:
        """Refuse, in one sentence, what this mode cannot do with the other sections' settings."""
        if settings.checkpoint.sharded and not self.shards_checkpoints:
            raise UserError(
                "checkpoint.sharded=true writes each FSDP rank's shards, and parallel="
                f"{self.name} holds whole weights: use parallel=fsdp, or leave it false."
            )

    def setup(self, device: str, trainer: Any) -> Process:
        """This process, on `device` (auto: the best this machine has)."""
        return Process(device=one_device(device, trainer, self.name))

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        """The model as this mode trains it (compiled where `trainer.compile` asks)."""
        return compiled(model, trainer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside what `wrap` made of it."""
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule

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

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a sharded tensor."""
        return tensor

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a sharded tensor (a collective)."""
        return tensor

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The plain model's whole `state_dict` (on the main process; every rank calls it)."""
        return self.unwrap(model).state_dict()

    def load_model_state(self, model: nn.Module, state: dict, process: Process) -> None:
        """Load the whole `state_dict` the main process holds ({} on the others) on every rank."""
        model = self.unwrap(model)
        if process.is_main:
            model.load_state_dict(state)
        process.broadcast_tensors(model.state_dict().values())

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict:
        """`optimizer.state_dict()` as one process's optimizer holds it."""
        return optimizer.state_dict()

    def load_optimizer_state(self, model: nn.Module, optimizer: Optimizer, state: dict) -> None:
        """Load what `optimizer_state` gave."""
        optimizer.load_state_dict(state)


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


def compiled(model: nn.Module, trainer: Any) -> nn.Module:
    """The model compiled as `trainer.compile` asks."""
    if not trainer.compile:
        return model
    mode = None if trainer.compile is True else trainer.compile
    # CUDA graphs record one per batch shape: static shapes, compiled in the warm-up, not mid-epoch.
    return torch.compile(model, mode=mode, dynamic=False if mode == "reduce-overhead" else None)


def teardown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
