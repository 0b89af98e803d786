"""Process setup: one device, DataParallel over GPUs, or one rank of a torchrun DDP group.

Rank handling lives here and nowhere else. The rest of the code asks the `Process` it is given:
`proc.is_main` before any side effect, `proc.device` for tensors, and its collectives (which do
nothing in a single process).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn

from src.errors import UserError
from src.settings import Trainer

log = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LEGACY_LOCAL_RANK = re.compile(r"--local[-_]rank=(\d+)")
_legacy_launcher = False


@dataclass(frozen=True)
class Process:
    """Where this process stands: its parallel mode, its rank among the DDP ranks, its device."""

    mode: str = "none"  # none | dp | ddp
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_ids: tuple[int, ...] = ()  # parallel=dp: the GPUs each batch is split over

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
        if self.mode != "ddp":
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if self.mode != "ddp":
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with rank 0's."""
        if self.mode != "ddp":
            return
        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.mode == "ddp":
            dist.barrier()

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (in float64, so counts stay exact)."""
        if self.mode != "ddp":
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()


def hydra_argv(argv: list[str]) -> list[str]:
    """The command line to hand Hydra, fixed up for the launcher. Runs before Hydra parses it.

    - The legacy `python -m torch.distributed.launch` appends `--local-rank=N`, which Hydra would
      reject: take it out (its value is also in the LOCAL_RANK variable).
    - Ranks other than 0 write nothing: no `.hydra/` folder and no log file, and no run folder of
      their own (each rank resolving `${now:...}` itself would make one per rank when ranks start in
      different seconds). They learn rank 0's run folder in `shared_run_dir`.
    """
    global _legacy_launcher
    args = []
    for arg in argv:
        match = LEGACY_LOCAL_RANK.fullmatch(arg)
        if match:
            _legacy_launcher = True
            os.environ.setdefault("LOCAL_RANK", match.group(1))
        else:
            args.append(arg)
    if ("-m" in args or "--multirun" in args) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        sys.exit(
            "Hydra multirun cannot run inside torchrun: every rank would start its own sweep. "
            "Run it without torchrun; each job starts its DDP processes itself: "
            "python train.py -m parallel=ddp parallel.nproc_per_node=N ..."
        )
    if int(os.environ.get("RANK", 0)) > 0:
        args += ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]
    elif (anchor := _restart_anchor()) and anchor.is_file():
        # torchrun restarted the workers: rank 0 takes up the first attempt's run folder, where
        # resume=auto finds its last.pt.
        args.append(f"hydra.run.dir='{anchor.read_text()}'")
    return args


def _restart_anchor() -> Path | None:
    """A file that belongs to this torchrun invocation and outlives its worker restarts.

    torchrun keeps each attempt's error files in {log dir}/{run id}_{suffix}/attempt_{N}/{local
    rank}/error.json; the folder above attempt_{N} is the same for every attempt.
    """
    error_file = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if not error_file.parent.parent.name.startswith("attempt_"):
        return None
    return error_file.parents[2] / "run_dir"


def setup(cfg: DictConfig, trainer: Trainer) -> Process:
    """Pick the device for `cfg.parallel.mode`; under ddp, join the process group."""
    mode = cfg.parallel.mode
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if mode != "ddp":
        if world_size > 1:
            raise UserError(
                f"torchrun started {world_size} processes, but parallel={mode} trains in one. "
                f"Add parallel=ddp, or run python train.py parallel={mode} without torchrun."
            )
        return _single_process(cfg, trainer)

    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    needed = TORCHRUN_VARIABLES if cfg.parallel.init_method == "env://" else TORCHRUN_VARIABLES[:3]
    missing = [name for name in needed if name not in os.environ]
    if missing:
        raise UserError(
            f"parallel=ddp found a partial distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with torchrun, which sets them all."
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(cfg.device, allow_mps=False)
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"parallel=ddp trains on CUDA GPUs or CPUs, not {device}. Use device=auto.")
    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", rank_gpu(local_rank, torch.cuda.device_count(), visible))
        torch.cuda.set_device(device)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(
            f"parallel.backend=nccl needs CUDA GPUs, but this run is on {device}. "
            "Use parallel.backend=gloo (or auto) on CPUs."
        )
    timeout = timedelta(seconds=cfg.parallel.timeout)
    if rank == 0 and not under_torchrun():  # then rank 0 hosts the rendezvous store itself
        _check_port_free(cfg.parallel.init_method)
    if cfg.parallel.init_method == "env://" and under_torchrun():
        store = _attempt_store(rank, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip
    else:
        dist.init_process_group(backend, init_method=cfg.parallel.init_method, rank=rank,
                                world_size=world_size, timeout=timeout)  # fmt: skip
    proc = Process("ddp", rank, local_rank, world_size, device)
    if not proc.is_main:
        _quiet_logging(rank)
    if _legacy_launcher and proc.is_main:
        log.warning(
            "torch.distributed.launch is deprecated; launch with torchrun instead: "
            "torchrun --nproc_per_node=N train.py parallel=ddp"
        )
    log.info(
        "DDP: %d processes, backend %s, this is rank %d on %s with %d CPU threads",
        world_size, backend, rank, device, torch.get_num_threads(),
    )  # fmt: skip
    return proc


def _check_port_free(init_method: str) -> None:
    """Stop before the rendezvous if its port is taken (by another run, most often)."""
    url = urlsplit(init_method)
    port = int(os.environ["MASTER_PORT"]) if url.scheme == "env" else url.port
    if port is None:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            raise UserError(
                f"Port {port} of the rendezvous ({init_method}, MASTER_PORT) is in use, "
                "probably by another run. Choose a free port, or let torchrun choose one: "
                "torchrun --standalone ... or --rdzv-endpoint=localhost:0."
            ) from None


def _attempt_store(rank: int, timeout: timedelta) -> dist.Store:
    """torchrun's key-value store at MASTER_ADDR:MASTER_PORT, under a prefix of this attempt's own.

    torchrun keeps one store for all restarts of a worker group, and the keys an earlier attempt
    left there (each rank's gloo address) make a restarted group connect to dead processes
    (torch 2.14, pytorch/pytorch#135712). With one torchrun agent, the attempt is its restart
    count, the same for every rank (a rank killed before it counted anything cannot fall behind).
    Across machines each agent counts its own restarts (one also restarts, uncounted, when another
    machine's workers fail), so there each rank counts its attempts in the store.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:  # one agent, one machine
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    else:
        attempt = store.add(f"train.py/attempts/rank{rank}", 1)
    return dist.PrefixStore(f"train.py/attempt{attempt}", store)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or the legacy launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def exit_worker() -> None:
    """End a torchrun worker whose work is done and flushed, skipping the interpreter's teardown.

    With the gloo backend, PyTorch can abort a process while the interpreter tears down
    ("terminate called without an active exception", SIGABRT), which torchrun reports as a failed
    run although every rank finished. Seen here with torch 2.14 in about 1 of 10 runs of 3 ranks
    on 2 busy cores, also with no DDP and no destroy_process_group; never with this exit.
    """
    if "wandb" in sys.modules:  # what its atexit hook does: wait for its files, stop its service
        sys.modules["wandb"].teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def seed_dp_replicas(proc: Process, seed: int) -> None:
    """Under parallel=dp each GPU's replica draws its own dropout masks, as DDP's ranks do; the
    first GPU keeps `seed`, as one process on it would (torch.manual_seed seeds every GPU alike)."""
    for i, index in enumerate(proc.device_ids[1:], start=1):
        torch.cuda.default_generators[index].manual_seed(seed + i)


def _single_process(cfg: DictConfig, trainer: Trainer) -> Process:
    """parallel=none: one device. parallel=dp: the GPUs to split over, data on the output one."""
    device = pick_device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # else the CUDA context and pinned-memory thread use GPU 0
    if cfg.parallel.mode != "dp":
        return Process(mode="none", device=device)
    if device.type != "cuda":
        log.warning(
            "parallel=dp needs CUDA GPUs; training on the single device %s instead.", device
        )
        return Process(mode="none", device=device)
    count = torch.cuda.device_count()
    ids = list(cfg.parallel.device_ids or range(count))
    output = ids[0] if cfg.parallel.output_device is None else cfg.parallel.output_device
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
    if len(ids) > 1 and precision != "32":
        raise UserError(
            f"parallel=dp over {len(ids)} GPUs autocasts to float16 in its threads, whatever "
            f"trainer.precision={precision} asks (and without float16's loss scaling). Use "
            "parallel=ddp for mixed precision, or trainer.precision=32."
        )


def wrap(model: nn.Module, cfg: DictConfig, proc: Process) -> nn.Module:
    """The model as the parallel mode trains it: plain, DataParallel or DistributedDataParallel."""
    parallel = cfg.parallel
    if proc.mode == "ddp":
        return nn.parallel.DistributedDataParallel(
            model,
            device_ids=[proc.device.index] if proc.device.type == "cuda" else None,
            find_unused_parameters=parallel.find_unused_parameters,
            bucket_cap_mb=parallel.bucket_cap_mb,
            gradient_as_bucket_view=parallel.gradient_as_bucket_view,
            static_graph=parallel.static_graph,
        )
    if proc.mode == "dp":
        # DataParallel wants the model on its first GPU; outputs (and the loss) on proc.device.
        model = model.to(torch.device("cuda", proc.device_ids[0]))
        return nn.DataParallel(model, device_ids=list(proc.device_ids), output_device=proc.device)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DataParallel or DDP wrapper, and inside torch.compile's."""
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


def shared_run_dir(proc: Process, run_dir: Path | None = None) -> Path:
    """Rank 0's run folder (the one Hydra made, unless given), which every rank uses."""
    run_dir = str(run_dir or HydraConfig.get().runtime.output_dir)
    if proc.is_main and (anchor := _restart_anchor()):
        anchor.write_text(run_dir)
    return Path(proc.broadcast_object(run_dir))


def _quiet_logging(rank: int) -> None:
    """Ranks other than 0 print warnings and errors only, prefixed with their rank."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(
            logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        )
