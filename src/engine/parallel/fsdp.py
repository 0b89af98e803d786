"""parallel=fsdp: FSDP2's `fully_shard`, each rank holding 1/N of every parameter, gradient and
optimizer state, gathering a unit's weights for its forward and backward only. Checkpoints stay
plain (gathered onto rank 0 by src/engine/checkpoint.py, as in every mode) and load into every
mode; with `checkpoint.sharded=true` each rank writes its part with DCP. FSDP and DCP are imported
where used: 0.75 s on other modes' start."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer

from src.engine.errors import UserError
from src.engine.parallel import unwrap
from src.engine.parallel.group import GroupStrategy


@dataclass
class FSDP(GroupStrategy):
    name: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True
    # Module classes (by name) sharded as units of their own; the rest of the model is one more.
    shard_modules: list[str] = field(default_factory=lambda: ["Linear", "Conv2d"])
    # Free a unit's weights after its forward, gather them again for the backward: less memory.
    reshard_after_forward: bool = True

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
        return super().wrap(shard(model, units, self.reshard_after_forward, dtype, device), trainer)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        unwrap(model).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            unwrap(model).set_requires_gradient_sync(True)

    def scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """Each rank sees part of the gradients: this scaler agrees with the others on overflows."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)

    def save_shards(self, model: nn.Module, optimizer: Optimizer, folder: Path) -> None:
        """Each rank writes its shards into `folder`; an OSError on any rank is raised on all."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(unwrap(model), optimizer)
        try:
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)
        except dcp.api.CheckpointException as err:
            if refused := [e for e, _ in err.failures.values() if isinstance(e, OSError)]:
                raise refused[0] from None
            raise

    def load_shards(
        self, model: nn.Module, folder: Path, optimizer: Optimizer | None = None
    ) -> None:
        """The model's shards (given `optimizer`, its shards only), saved by any number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as dsd

        model = unwrap(model)
        part, own = ("model", [model]) if optimizer is None else ("optimizer", [model, optimizer])
        state = {part: getattr(dsd, f"get_{part}_state_dict")(*own)}  # get_model_state_dict...
        dcp.load(state, checkpoint_id=folder)
        getattr(dsd, f"set_{part}_state_dict")(*own, state[part])

    def saved_tensors(self, folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The model's tensors that the shards in `folder` hold, by name: whole shape and dtype."""
        from torch.distributed.checkpoint import FileSystemReader

        return {
            name.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
            for name, meta in FileSystemReader(folder).read_metadata().state_dict_metadata.items()
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
