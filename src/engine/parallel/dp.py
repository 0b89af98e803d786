"""parallel=dp: `nn.DataParallel`, one process splitting each batch over the visible GPUs."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from src.engine.errors import UserError
from src.engine.parallel import Process, Strategy
from src.engine.parallel.devices import one_device

log = logging.getLogger(__name__)


@dataclass
class DP(Strategy):
    """DataParallel over `device_ids`, the model and the outputs on the first of them."""

    name: ClassVar[str] = "dp"
    device_ids: list[int] | None = None  # GPUs to split each batch over; null = all visible GPUs
    output_device: int | None = None  # GPU that gathers the outputs: null = the first of device_ids

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ids: list[int] = []  # the GPUs setup found; none: one device

    def setup(self, device: str, trainer: Any) -> Process:
        """The GPUs to split over, the data on the first; one device where there is no GPU."""
        found = one_device(device, trainer, self.name)
        if found.type != "cuda":
            log.warning("parallel=dp needs CUDA GPUs; training on the single device %s instead.",
                        found)  # fmt: skip
            return Process(device=found)
        count = torch.cuda.device_count()
        ids = list(self.device_ids or range(count))
        output = ids[0] if self.output_device is None else self.output_device
        check_data_parallel(ids, output, count, trainer.compile, trainer.precision)
        self.ids = ids
        return Process(device=torch.device("cuda", output))

    def wrap(self, model: nn.Module, trainer: Any) -> nn.Module:
        model = super().wrap(model, trainer)
        if not self.ids:  # no GPU: one device
            return model
        # DataParallel wants the model on its first GPU, and gives the outputs there.
        device = torch.device("cuda", self.ids[0])
        return nn.DataParallel(model.to(device), device_ids=self.ids, output_device=device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return super().unwrap(model.module if isinstance(model, nn.DataParallel) else model)

    def seed(self, seed: int) -> None:
        """Each GPU's replica draws its own dropout masks, as DDP's ranks do; the first keeps
        `seed`, as one process on it would (torch.manual_seed seeds every GPU alike)."""
        for i, index in enumerate(self.ids[1:], start=1):
            torch.cuda.default_generators[index].manual_seed(seed + i)


def check_data_parallel(
    ids: list[int], output: int, count: int, compile: bool | str, precision: str
) -> None:
    """Refuse what nn.DataParallel over `ids` (of `count` visible GPUs) gets wrong in this torch:
    replicas of a torch.compile'd model overwrite the original (its wrapper passes attribute
    writes through), its worker threads autocast to float16 whatever dtype was asked, and
    outputs gathered away from `ids[0]` meet the model and its optimizer state there."""
    absent = [i for i in [*ids, output] if not 0 <= i < count]
    if absent:
        raise UserError(
            f"parallel.device_ids={ids} / parallel.output_device={output} name GPUs {absent} that "
            f"do not exist: {count} are visible, 0 to {count - 1}. Pick ids among them."
        )
    if output != ids[0]:
        raise UserError(
            f"parallel.output_device={output} is not the first of parallel.device_ids={ids}, "
            "where DataParallel keeps the model: leave parallel.output_device=null."
        )
    if len(ids) > 1 and compile:
        raise UserError(
            f"parallel=dp over {len(ids)} GPUs cannot run a torch.compile'd model (DataParallel's "
            "replicas overwrite it). Use parallel=ddp with trainer.compile, or "
            "trainer.compile=false."
        )
    if len(ids) > 1 and precision == "64":
        raise UserError(
            f"trainer.precision=64 with parallel=dp over {len(ids)} GPUs: DataParallel's float64 "
            "path is not among what this template proves (its GPU tests run ddp in float64). "
            "Use parallel=ddp, or one GPU."
        )
    if len(ids) > 1 and precision != "32":
        raise UserError(
            f"parallel=dp over {len(ids)} GPUs autocasts to float16 in its threads, whatever "
            f"trainer.precision={precision} asks (and without float16's loss scaling). Use "
            "parallel=ddp for mixed precision, or trainer.precision=32."
        )
