"""parallel=dp: `nn.DataParallel`, one process splitting each batch over the visible GPUs."""

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from src.engine.errors import UserError
from src.engine.parallel import Process, Strategy

log = logging.getLogger(__name__)


@dataclass
class DP(Strategy):
    name: ClassVar[str] = "dp"
    device_ids: list[int] | None = None  # GPUs to split each batch over; null = all visible GPUs
    output_device: int | None = None  # GPU that gathers the outputs: null = the first of device_ids

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ids: list[int] = []  # the GPUs setup found; none: one device

    def setup(self, device: str, trainer: Any) -> Process:
        """The GPUs to split over, the data on the first; one device where there is no GPU."""
        found = super().setup(device, trainer).device
        if found.type != "cuda":
            log.warning("parallel=dp needs CUDA GPUs; training on %s alone instead.", found)
            return Process(device=found)
        count = torch.cuda.device_count()
        self.ids = list(self.device_ids or range(count))
        output = self.ids[0] if self.output_device is None else self.output_device
        check_data_parallel(self.ids, output, count, trainer.compile, trainer.precision)
        return Process(device=torch.device("cuda", output))

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        model = super().wrap(model, trainer)
        if not self.ids:  # no GPU: one device
            return model
        device = torch.device("cuda", self.ids[0])  # DataParallel's: the model's, the outputs'
        return nn.DataParallel(model.to(device), device_ids=self.ids, output_device=device)

    def seed_devices(self, seed: int) -> None:
        """Replicas draw their own dropout masks, as DDP's ranks (manual_seed seeds GPUs alike)."""
        for i, index in enumerate(self.ids[1:], start=1):
            torch.cuda.default_generators[index].manual_seed(seed + i)


def check_data_parallel(
    ids: list[int], output: int, count: int, compile: bool | str, precision: str
) -> None:
    """Refuse what nn.DataParallel over `ids` (of `count` visible GPUs) gets wrong in this torch."""
    absent = [i for i in [*ids, output] if not 0 <= i < count]
    if absent or output != ids[0]:
        raise UserError(
            f"parallel.device_ids={ids} / parallel.output_device={output} name GPUs {absent} that "
            f"do not exist: {count} are visible, 0 to {count - 1}. Pick ids among them."
            if absent
            else f"parallel.output_device={output} is not the first of parallel.device_ids={ids}, "
            "where DataParallel keeps the model: leave parallel.output_device=null."
        )
    if len(ids) > 1 and compile:
        raise UserError(
            f"parallel=dp over {len(ids)} GPUs cannot run a torch.compile'd model (its replicas "
            "overwrite it). Use parallel=ddp with trainer.compile, or trainer.compile=false."
        )
    if len(ids) > 1 and precision != "32":
        why = "DataParallel autocasts to float16 in its threads, without loss scaling"
        if precision == "64":
            why = "DataParallel's float64 path is untested here (the GPU tests run ddp in float64)"
        raise UserError(
            f"trainer.precision={precision} with parallel=dp over {len(ids)} GPUs: {why}. Use "
            "parallel=ddp or one GPU, or trainer.precision=32."
        )
