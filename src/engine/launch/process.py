"""This process's device and process group: one device, DataParallel's GPUs, or one rank of a
DDP or FSDP group that torchrun (or train.py) started, from the typed parallel settings."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig

from src.engine.distributed import Process
from src.engine.errors import UserError, first_line
from src.engine.launch import (
    TORCHRUN_VARIABLES,
    attempt_store,
    check_port_free,
    check_rendezvous,
    legacy_launcher_used,
    restart_anchor,
    under_torchrun,
)
from src.engine.settings import PROCESS_GROUP_MODES, Parallel, Trainer

log = logging.getLogger(__name__)


def setup(parallel: Parallel, trainer: Trainer) -> Process:
    """Pick the device for `parallel.mode`; under ddp or fsdp, join the process group."""
    mode = parallel.mode
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if mode not in PROCESS_GROUP_MODES:
        if world_size > 1:
            raise UserError(
                f"torchrun started {world_size} processes, but parallel={mode} trains in one. "
                f"Add parallel=ddp (or fsdp), or run python train.py parallel={mode} without "
                "torchrun."
            )
        return _single_process(parallel, trainer)

    variables = TORCHRUN_VARIABLES
    present = [name for name in variables if name in os.environ]
    needed = variables if parallel.init_method == "env://" else variables[:3]
    missing = [name for name in needed if name not in os.environ]
    if missing:
        raise UserError(
            f"parallel={mode} found a partial distributed environment: {', '.join(present)} "
            f"set but {', '.join(missing)} missing. Launch with torchrun, which sets them all."
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(parallel.device, allow_mps=False)
    if device.type not in ("cpu", "cuda"):
        raise UserError(
            f"parallel={mode} trains on CUDA GPUs or CPUs, not {device}. Use device=auto."
        )
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", rank_gpu(local_rank, torch.cuda.device_count(), visible))
        torch.cuda.set_device(device)
    backend = parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(
            f"parallel.backend=nccl needs CUDA GPUs, but this run is on {device}. "
            "Use parallel.backend=gloo (or auto) on CPUs."
        )
    timeout = timedelta(seconds=parallel.timeout)
    init_method = parallel.init_method
    check_rendezvous(init_method)
    # Rank 0 hosts the rendezvous store, but for env:// under torchrun: that one is torchrun's.
    torchrun_store = init_method == "env://" and under_torchrun()
    if rank == 0 and not torchrun_store:
        check_port_free(init_method)
    try:
        if torchrun_store:
            store = attempt_store(rank, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)  # fmt: skip
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timeout)  # fmt: skip
    except dist.DistNetworkError as err:  # the message then dumps up to 50 C++ frames
        raise UserError(
            f"Rank {rank} could not join the rendezvous ({init_method}): "
            f"{first_line(err).rstrip('.')}. Check that rank 0 runs at that address and that "
            f"this machine reaches it (parallel.timeout={parallel.timeout} s is the wait)."
        ) from None
    process = Process(mode, rank, local_rank, world_size, device)
    if not process.is_main:
        _quiet_logging(rank)
    if legacy_launcher_used() and process.is_main:
        log.warning(
            "torch.distributed.launch is deprecated; launch with torchrun instead: "
            "torchrun --nproc_per_node=N train.py parallel=ddp"
        )
    log.info(
        "%s: %d processes, backend %s, this is rank %d on %s with %d CPU threads",
        mode.upper(), world_size, backend, rank, device, torch.get_num_threads(),
    )  # fmt: skip
    return process


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_device(requested: str, allow_mps: bool = True) -> torch.device:
    """`auto` is the first of cuda, mps, cpu that this machine has; anything else is checked."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if allow_mps and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise UserError(
            f"device={requested} is not a device. Use auto, cpu, cuda, cuda:N or mps."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"device={requested}, but no CUDA GPU is visible. Use device=auto or device=cpu."
        )
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= count:
        raise UserError(
            f"device={requested}, but this machine shows {count} GPU(s), cuda:0 to "
            f"cuda:{count - 1}. Pick one of them, or device=auto."
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(
            f"device={requested}, but MPS is not available. Use device=auto or device=cpu."
        )
    return device


def rank_gpu(local_rank: int, count: int, visible: str | None) -> int:
    """The GPU of the DDP rank `local_rank` among the `count` this process sees: its own index,
    or the one GPU a cluster shows each rank (CUDA_VISIBLE_DEVICES naming a single GPU)."""
    if local_rank < count:
        return local_rank
    if count == 1 and visible is not None and "," not in visible:
        return 0
    raise UserError(
        f"torchrun started more processes on this machine than the {count} GPUs it sees "
        f"(local rank {local_rank}). Use --nproc_per_node={count} or fewer."
    )


def _single_process(parallel: Parallel, trainer: Trainer) -> Process:
    """parallel=none: one device. parallel=dp: the GPUs to split over, data on the output one."""
    device = pick_device(parallel.device)
    if device.type == "mps" and trainer.precision == "64":
        raise UserError(
            "trainer.precision=64 on mps: Apple's GPUs have no float64. Use device=cpu for "
            "float64, or trainer.precision=32."
        )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # else the CUDA context and pinned-memory thread use GPU 0
    if parallel.mode != "dp":
        return Process(mode="none", device=device)
    if device.type != "cuda":
        log.warning(
            "parallel=dp needs CUDA GPUs; training on the single device %s instead.", device
        )
        return Process(mode="none", device=device)
    count = torch.cuda.device_count()
    ids = list(parallel.device_ids or range(count))
    output = ids[0] if parallel.output_device is None else parallel.output_device
    check_data_parallel(ids, output, count, trainer.compile, trainer.precision)
    return Process(mode="dp", device=torch.device("cuda", output), device_ids=tuple(ids))


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


def shared_run_dir(process: Process, run_dir: Path | None = None) -> Path:
    """Rank 0's run folder (the one Hydra made, unless given), which every rank uses."""
    run_dir = str(run_dir or HydraConfig.get().runtime.output_dir)
    if process.is_main and (anchor := restart_anchor()):
        anchor.write_text(run_dir)
    return Path(process.broadcast_object(run_dir))


def _quiet_logging(rank: int) -> None:
    """Ranks other than 0 print warnings and errors only, prefixed with their rank."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(
            logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        )
