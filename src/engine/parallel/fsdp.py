"""parallel=fsdp: FSDP2's `fully_shard`, each rank holding 1/N of every parameter, gradient and
optimizer state, gathering a unit's weights for its forward and backward only. Checkpoints stay
plain (gathered onto rank 0) and load into every mode; with `checkpoint.sharded=true` each rank
writes its part with DCP. FSDP and DCP are imported where used: 0.75 s on other modes' start."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer

from src.engine.errors import UserError
from src.engine.parallel import Process, compiled
from src.engine.parallel.group import GroupStrategy

# Whole state dicts on rank 0's CPU only ({} elsewhere): no device holds two copies, rank 0 writes.
GATHERED = {"full_state_dict": True, "cpu_offload": True}


@dataclass
class FSDP(GroupStrategy):
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
        for key, why in {
            "sync_batchnorm": "parallel=fsdp normalises each rank's share by its own statistics. "
            "Use parallel=ddp for SyncBatchNorm, or leave it false.",
            "find_unused_parameters": "FSDP needs no search for parameters without a gradient. "
            "Leave it false with parallel=fsdp.",
        }.items():
            if getattr(self, key):
                raise UserError(f"parallel.{key}=true is DDP's: {why}")
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
        self.unwrap(model).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.unwrap(model).set_requires_gradient_sync(True)

    def scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """Each rank sees part of the gradients: this scaler agrees with the others on overflows."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)

    # A DTensor is told by its methods: DTensor itself is not imported for this.
    def local(self, tensor: Tensor) -> Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def full(self, tensor: Tensor) -> Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    def model_state(self, model: nn.Module) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.unwrap(model), options=StateDictOptions(**GATHERED))

    def load_model_state(self, model: nn.Module, state: dict, process: Process) -> None:
        """Each rank receives its shards of the full `state` from rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        state = dict(state) if process.is_main else {}
        set_model_state_dict(self.unwrap(model), state, options=options)

    def optimizer_state(self, model: nn.Module, optimizer: Optimizer) -> dict:
        return optimizer_state(self.unwrap(model), optimizer)

    def load_optimizer_state(self, model: nn.Module, optimizer: Optimizer, state: dict) -> None:
        load_optimizer_state(self.unwrap(model), optimizer, state)

    def save_shards(self, model: nn.Module, optimizer: Optimizer, folder: Path) -> None:
        """Each rank writes its shards into `folder`; an OSError on any rank is raised on all."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.unwrap(model), optimizer)
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

        model = self.unwrap(model)
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


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` whole on rank 0 ({} elsewhere), numbered as a plain optimizer's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**GATHERED))
    names = [name for group in state.get("param_groups", []) for name in group["params"]]
    return _rekeyed(state, {name: number for number, name in enumerate(names)}) if state else state


def load_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a plain `optimizer.state_dict()`, which every rank holds, into the sharded `model`'s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state["state"]:  # a stateless optimizer (SGD without momentum): its settings only
        optimizer.load_state_dict(state)
        return
    names = {id(p): name for name, p in model.named_parameters()}
    state = _rekeyed(state, [names[id(p)] for g in optimizer.param_groups for p in g["params"]])
    # Group keys this optimizer lacks (the saved schedule's initial_lr, built after this) are left
    # out: the settings are this config's anyway (checkpoint.OptimizerState.settings_kept), the
    # moments continue.
    state["param_groups"] = [
        {k: v for k, v in saved.items() if k in group or k == "params"}
        for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
    ]
    # Not strict: parameters that never had a gradient have no state, as in a plain optimizer.
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def _rekeyed(state: dict[str, Any], key: Any) -> dict[str, Any]:
    """`state` with each parameter's key `k` replaced by `key[k]` (numbers for names, or back)."""
    groups = [{**g, "params": [key[k] for k in g["params"]]} for g in state["param_groups"]]
    return {"state": {key[k]: v for k, v in state["state"].items()}, "param_groups": groups}
