"""The modes that train one process per device, in a process group (ddp, fsdp): their shared keys,
and joining the group torchrun (or train.py, as torchrun does) started this process in."""

import logging
import os
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from src.engine import launch
from src.engine.errors import UserError, above, first_line, least, one_of, refuse
from src.engine.parallel import Process, Strategy, pick_device, rank_gpu

log = logging.getLogger(__name__)


@dataclass
class GroupStrategy(Strategy):
    in_group: ClassVar[bool] = True
    # Processes `python train.py` starts (null = one per GPU, or 2 on a CPU); torchrun sets its own.
    nproc_per_node: int | None = least(1, None, nullable=True)
    backend: str = one_of("auto", "nccl", "gloo", default="auto")  # auto: nccl with CUDA, else gloo
    init_method: str = "env://"  # env:// (torchrun's variables), tcp://HOST:PORT or file:///PATH
    timeout: float = above(0, 1800)  # seconds a collective waits for the other ranks, then fails

    def __post_init__(self) -> None:
        super().__post_init__()
        key, value = "parallel.init_method", self.init_method
        if not value.startswith(("env://", "tcp://", "file://")):
            refuse(key, value, "env:// (torchrun's variables), tcp://HOST:PORT or file:///PATH")
        url, port = urlsplit(value), None
        with suppress(ValueError):  # url.port raises for a port above 65535
            port = url.port
        if url.scheme == "tcp" and not (url.hostname and port):
            refuse(key, value, "tcp://HOST:PORT, with rank 0's host and a port from 1 to 65535")
        if url.scheme == "file" and (url.netloc or not url.path.startswith("/")):
            refuse(key, value, "file:///PATH, a file's absolute path on a folder all processes see")

    def processes(self, device: str) -> int:
        """Processes `python train.py` starts here: `nproc_per_node`, else one per GPU, or 2."""
        gpus = torch.cuda.device_count()
        if self.nproc_per_node is None:
            return gpus or 2
        if self.nproc_per_node > gpus > 0 and device in ("auto", "cuda"):
            raise UserError(
                f"parallel.nproc_per_node={self.nproc_per_node}, but {gpus} GPUs are visible: one "
                f"process per GPU. Use parallel.nproc_per_node={gpus} or fewer, or device=cpu."
            )
        return self.nproc_per_node

    def setup(self, device: str, trainer: Any) -> Process:
        """Join the process group as the rank torchrun's variables say, on its own device."""
        mode, variables = self.name, launch.TORCHRUN_VARIABLES
        present = [name for name in variables if name in os.environ]
        needed = variables if self.init_method == "env://" else variables[:3]
        if not present:  # run.train called in a process that no launcher started as a rank
            raise UserError(
                f"parallel={mode} trains in one process per device, and none of torchrun's "
                f"variables ({', '.join(needed)}) is set: launch with torchrun, or through "
                "src.engine.app.main (as train.py does), which starts the processes itself."
            )
        if missing := [name for name in needed if name not in os.environ]:
            raise UserError(
                f"parallel={mode} found a partial distributed environment: {', '.join(present)} "
                f"set but {', '.join(missing)} missing. Launch with torchrun, which sets them all."
            )
        rank, local_rank, world = (int(os.environ[name]) for name in variables[:3])
        device = pick_device(device, allow_mps=False)
        if device.type not in ("cpu", "cuda"):
            raise UserError(
                f"parallel={mode} trains on CUDA GPUs or CPUs, not {device}. Use device=auto."
            )
        if device.type == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            device = torch.device("cuda", rank_gpu(local_rank, torch.cuda.device_count(), visible))
            torch.cuda.set_device(device)
        auto = "nccl" if device.type == "cuda" else "gloo"
        backend = auto if self.backend == "auto" else self.backend
        if backend == "nccl" and device.type != "cuda":
            raise UserError(
                f"parallel.backend=nccl needs CUDA GPUs, but this run is on {device}. "
                "Use parallel.backend=gloo (or auto) on CPUs."
            )
        timeout, init_method = timedelta(seconds=self.timeout), self.init_method
        # Rank 0 hosts the rendezvous store, but for env:// under torchrun: that one is torchrun's.
        torchrun_store = init_method == "env://" and launch.under_torchrun()
        launch.check_rendezvous(init_method, hosts=rank == 0 and not torchrun_store)
        try:
            store = launch.attempt_store(rank, timeout) if torchrun_store else None
            where = {"init_method": init_method} if store is None else {"store": store}
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **where)
        except dist.DistNetworkError as err:  # the message then dumps up to 50 C++ frames
            raise UserError(
                f"Rank {rank} could not join the rendezvous ({init_method}): "
                f"{first_line(err).rstrip('.')}. Check that rank 0 runs at that address and that "
                f"this machine reaches it (parallel.timeout={self.timeout} s is the wait)."
            ) from None
        process = Process(rank, local_rank, world, device, in_group=True)
        if not process.is_main:
            launch.quiet_logging(rank)
        if launch.legacy_launcher and process.is_main:
            log.warning(
                "torch.distributed.launch is deprecated; launch with torchrun instead: "
                "torchrun --nproc_per_node=N train.py parallel=ddp"
            )
        here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if self.nproc_per_node not in (None, here) and process.is_main:  # torchrun's count rules
            log.warning(
                f"parallel.nproc_per_node={self.nproc_per_node} is not used: the launcher started "
                f"{here} processes on this machine (torchrun --nproc_per_node sets their number)."
            )
        shown = (mode.upper(), world, backend, rank, device, torch.get_num_threads())
        log.info("%s: %d processes, backend %s, this is rank %d on %s with %d CPU threads", *shown)
        return process
