"""parallel=fsdp: PyTorch's fully sharded data parallel (FSDP2, `fully_shard`), and its state dicts.

Each rank holds 1/N of every parameter, gradient and optimizer state. Checkpoints stay plain
(what one process would save, gathered onto rank 0), so they load into every mode;
`checkpoint.sharded=true` writes each rank's part with `torch.distributed.checkpoint` instead.
FSDP and that module are imported where used: their 0.75 s would slow every other mode's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from src.engine.errors import UserError
from src.engine.parallel import Process, compiled
from src.engine.parallel.group import GroupStrategy


@dataclass
class FSDP(GroupStrategy):
    """FSDP2's `fully_shard`: a rank gathers a unit's weights for its forward and backward only."""

    name: ClassVar[str] = "fsdp"
    replicated: ClassVar[bool] = False
    even_eval: ClassVar[bool] = True
    shards_checkpoints: ClassVar[bool] = True
    # Module classes (by name) sharded as units of their own; the rest of the model is one more.
    shard_modules: list[str] = field(default_factory=lambda: ["Linear", "Conv2d"])
    # Free a unit's weights after its forward, gather them again for the backward: less memory.
    reshard_after_forward: bool = True
    find_unused_parameters: bool = False  # DDP's: true is refused here (FSDP needs no search)

    def __post_init__(self) -> None:
        if self.sync_batchnorm:
            raise UserError(
                "parallel.sync_batchnorm=true is DDP's: parallel=fsdp normalises each rank's "
                "share by its own statistics. Use parallel=ddp for SyncBatchNorm, or leave it "
                "false."
            )
        if self.find_unused_parameters:
            raise UserError(
                "parallel.find_unused_parameters=true is DDP's: FSDP needs no search for "
                "parameters without a gradient. Leave it false with parallel=fsdp."
            )
        super().__post_init__()

    def check(self, settings: Any) -> None:
        super().check(settings)
        if settings.trainer.channels_last:
            raise UserError(
                "trainer.channels_last=true with parallel=fsdp: this torch's FSDP shards "
                "contiguous parameters only, and channels-last convolution weights are not. Use "
                "parallel=ddp for channels-last, or trainer.channels_last=false."
            )

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        """Sharded, then compiled around FSDP's hooks (which gather each unit's weights)."""
        device = next(model.parameters()).device
        units, dtype = list(self.shard_modules), trainer.autocast_dtype
        return compiled(shard(model, units, self.reshard_after_forward, dtype, device), trainer)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model = self.unwrap(model)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """Each rank sees part of the gradients: this scaler agrees with the others on overflows."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)

    # A DTensor is told by its methods: DTensor itself is not imported for this.
    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.unwrap(model), options=_gathered_on_rank_0())

    def load_model_state(
        self, model: nn.Module, state: dict[str, torch.Tensor], process: Process
    ) -> None:
        """Each rank receives its shards of the full `state` from rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        state = dict(state) if process.is_main else {}
        set_model_state_dict(self.unwrap(model), state, options=options)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer_state(self.unwrap(model), optimizer)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        load_optimizer_state(self.unwrap(model), optimizer, state)

    def save_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Write each rank's shards of the model and the optimizer into the existing `folder`. A
        write the storage refused on any rank is raised as that OSError, on every rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.unwrap(model), optimizer)
        try:
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)
        except dcp.api.CheckpointException as err:
            refused = [e for e, _ in err.failures.values() if isinstance(e, OSError)]
            if refused:
                raise refused[0] from None
            raise

    def load_shards(
        self, model: nn.Module, folder: Path, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Load the model's shards from `folder` (or, given the `optimizer`, its shards only),
        saved with any number of ranks: each rank reads the parts of its own shards."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as dsd

        model = self.unwrap(model)
        if optimizer is None:
            state = {"model": dsd.get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=folder)
            dsd.set_model_state_dict(model, state["model"])
        else:
            state = {"optimizer": dsd.get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=folder)
            dsd.set_optimizer_state_dict(model, optimizer, state["optimizer"])

    def saved_tensors(self, folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The model's tensors that the shards in `folder` hold, by name: whole shape and dtype."""
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(folder).read_metadata().state_dict_metadata
        return {
            name.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
            for name, meta in saved.items()
            if name.startswith("model.") and hasattr(meta, "size")
        }


def shard(
    model: nn.Module,
    units: list[str],
    reshard_after_forward: bool,
    dtype: torch.dtype | None,
    device: torch.device,
) -> nn.Module:
    """Shard each module whose class `units` names as a unit, then the rest as the root one. `dtype`
    (bf16, float16) runs the forward and backward; weights, optimizer and reduction stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    found = {type(m).__name__ for m in model.modules()}
    if units and not found & set(units):
        raise UserError(
            f"parallel.shard_modules={list(units)} names no module of {type(model).__name__}, "
            f"whose classes are {', '.join(sorted(found))}: name its blocks, or [] to shard it "
            "as one unit."
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # not the GPU of a CPU run
    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    # BatchNorm in float32, as autocast runs it: a low-precision weight beside its stats is refused.
    batch_norm = MixedPrecisionPolicy(param_dtype=torch.float32)
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    for module in reversed(list(model.modules())[1:]):  # a unit's inner units first
        if dtype and isinstance(module, nn.modules.batchnorm._BatchNorm):
            fully_shard(module, mp_policy=batch_norm, **options)
        elif type(module).__name__ in units:
            fully_shard(module, mp_policy=low, **options)
    return fully_shard(model, mp_policy=low, **options)


def _gathered_on_rank_0() -> Any:
    """Gather onto rank 0's CPU only ({} elsewhere): no device holds two copies, rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full `optimizer.state_dict()` on rank 0 ({} on the others), its parameters numbered as a
    plain optimizer's (PyTorch gathers them by name), so that it loads anywhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_gathered_on_rank_0())
    if not state:
        return state
    names = [name for group in state["param_groups"] for name in group["params"]]
    return _rekeyed(state, {name: number for number, name in enumerate(names)})


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a plain `optimizer.state_dict()`, which every rank holds, into the sharded `model`'s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state["state"]:  # a stateless optimizer (SGD without momentum): its settings only
        optimizer.load_state_dict(state)
        return
    names = {id(p): name for name, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = _rekeyed(state, ordered)
    # Group keys this optimizer lacks (the saved schedule's initial_lr, built after this) are left
    # out: the settings are this config's anyway (resume.apply_settings), the moments continue.
    state["param_groups"] = [
        {k: v for k, v in saved.items() if k in group or k == "params"}
        for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
    ]
    # Not strict: parameters that never had a gradient have no state, as in a plain optimizer.
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _rekeyed(state: dict[str, Any], key: Any) -> dict[str, Any]:
    """`state` with each parameter's key `k` replaced by `key[k]` (numbers for names, or back)."""
    return {
        "state": {key[k]: value for k, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [key[k] for k in group["params"]]}
            for group in state["param_groups"]
        ],
    }
