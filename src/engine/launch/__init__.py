"""Starting DDP workers (`elastic_launch`, what torchrun runs), each failure reported once in
torchrun's error file; then the torchrun/Hydra plumbing, each workaround with its upstream issue."""

import importlib
import json
import logging.config
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler

from src.engine.errors import Stopped, UserError

log = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LEGACY_LOCAL_RANK = re.compile(r"--local[-_]rank=(\d+)")
legacy_launcher = False  # this worker was started by the deprecated torch.distributed.launch
_self_launched = False  # a worker of `start_workers`, whose failure its parent reports


class WorkerFailed(CompactHydraException):
    """A DDP worker failed; the message carries its own error (Hydra prints the message alone)."""


def start_workers(train: Callable[[DictConfig, Path], Any], cfg: DictConfig, nproc: int) -> Any:
    """`train(cfg, run_dir)` in `nproc` processes here, in this job's run folder: rank 0's result.
    Workers import `train` by name: submitit may have pickled it by value, which says no module."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logs = Path(tempfile.mkdtemp(prefix="train-workers-"))  # error files (torch's default stays)
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"train-{uuid.uuid4()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone picks
        max_restarts=0,
    )  # each worker a fresh interpreter (torch's start_method="spawn")
    log.info("Starting %d processes", nproc)
    # This process's logging (the launcher's: torch.distributed.elastic, torch.multiprocessing)
    # quietened while workers run (each has its own): failures are told once below, signals by them.
    was = logging.root.manager.disable  # the level logging.disable had set, put back below
    logging.disable(logging.CRITICAL)
    try:
        return elastic_launch(config, _worker)(
            importable_name(train),
            OmegaConf.to_container(cfg, resolve=True),
            HydraConfig.get().runtime.output_dir,
            OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True),
            max(1, (os.cpu_count() or 1) // nproc),
        )[0]
    except SignalException:  # SIGTERM or Ctrl-C: passed on to the workers, which stopped at a
        raise SystemExit(1) from None  # step, saved, and said so (rank 0's stop sentence)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # an exception: its traceback, recorded by the worker
            message = f"rank {rank} failed:\n{message['extraInfo']['py_callstack'].rstrip()}"
        elif failure.exitcode < 0:  # a signal
            message = f"rank {rank}: {message}. The other processes were stopped."
        raise WorkerFailed(message) from None
    finally:
        logging.disable(was)
        shutil.rmtree(logs, ignore_errors=True)


def _worker(train: tuple, config: dict, run_dir: str, job_logging: dict, threads: int) -> Any:
    """One self-launched DDP process, in torchrun's environment: `train` (module, name) on it."""
    global _self_launched
    _self_launched = True
    if os.environ["RANK"] == "0":
        logging.config.dictConfig(job_logging)
    else:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    torch.set_num_threads(threads)  # the machine's cores shared between the processes
    function = getattr(importlib.import_module(train[0]), train[1])
    return run_worker(function, OmegaConf.create(config), Path(run_dir))


def importable_name(function: Callable[..., Any]) -> tuple[str, str]:
    """(module, name) by which a new process imports `function`; refused for one it cannot."""
    module, name = function.__module__, function.__qualname__
    if module == "__main__" or "<" in name:
        raise ValueError(
            f"DDP processes import the training function by module and name, and {module}.{name} "
            "is not importable: define it at the top level of a module (as src/engine/app.py does)."
        )
    return module, name


def run_worker(train: Callable[..., Any], *args: Any) -> Any:
    """`train(*args)` in a DDP worker: a failure exits with 1, written to torchrun's error file (a
    user's mistake as its message, else its traceback) for the launcher to report once."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):  # none (a log_dir of os.devnull: empty)
        return train(*args)
    try:
        return train(*args)
    except CompactHydraException as err:
        # Said here, after the run's log: torchrun's report, which quotes it at its end, is 30
        # lines and more (Stopped: torchrun, stopped too, reports nothing); a self-launched
        # worker's, by its launcher.
        tell = isinstance(err, Stopped) or not _self_launched
        fail_worker(str(err), getattr(err, "every_rank", False), tell)
    except SystemExit as err:  # a quiet end (a rank other than 0 stopped by a signal): no teardown
        if isinstance(err.code, str):
            print(err.code, file=sys.stderr)
        exit_worker(0 if err.code is None else err.code if isinstance(err.code, int) else 1)
    except Exception:  # noqa: BLE001 - recorded with its traceback, for the launcher to show
        ErrorHandler().record_exception(sys.exc_info()[1])
    # Via the teardown, giving the launcher time to report a killed peer, often the crash's cause.
    logging.shutdown()
    sys.exit(1)


def fail_worker(message: str, every_rank: bool, tell: bool = True) -> NoReturn:
    """Exit a torchrun worker with 1 on a user's mistake, `message` written to torchrun's error file
    for its report to quote, and printed where `tell`. One that every rank makes is told by local
    rank 0 alone (torchrun quotes each failed rank): the others record being stopped, after rank
    0's failure, the root cause; not stopped in 5 s, they record it too."""

    def fail(said: str) -> NoReturn:  # recorded, then exit with 1 as recorded (`exit_worker`)
        record = json.dumps({"message": said, "timestamp": int(time.time())})
        Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(record)
        exit_worker(1)

    others = every_rank and os.environ.get("LOCAL_RANK", "0") != "0"
    if tell and not others:
        print(message, file=sys.stderr)
    if others:
        stop = "stopped: local rank 0 failed first, with the same mistake (the root cause)"
        signal.signal(signal.SIGTERM, lambda *_: fail(stop))
        time.sleep(5.0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fail(message)


def refuse_command_line(message: str) -> NoReturn:
    """Exit 1 on a mistake on the command line, which every rank makes alike: under torchrun told
    once per machine and quoted by torchrun's report, else said as sys.exit says it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        fail_worker(message, every_rank=True)
    sys.exit(message if os.environ.get("LOCAL_RANK", "0") == "0" else 1)


def hydra_argv(argv: list[str]) -> list[str]:
    """The command line for Hydra, without the legacy launcher's `--local-rank=N`, which it rejects
    (facebookresearch/fairseq#4164; can go with that launcher). Ranks other than 0 write no run
    folder, `.hydra/` or log and use rank 0's (`${now:...}` differs: facebookresearch/hydra#2070,
    ashleve/lightning-hydra-template#393); can go when Hydra resolves one folder per job."""
    global legacy_launcher
    args = [arg for arg in argv if not LEGACY_LOCAL_RANK.fullmatch(arg)]
    if legacy := [arg for arg in argv if arg not in args]:
        legacy_launcher = True
        os.environ.setdefault("LOCAL_RANK", LEGACY_LOCAL_RANK.fullmatch(legacy[0]).group(1))
    if ("-m" in args or "--multirun" in args) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        refuse_command_line(
            "Hydra multirun cannot run inside torchrun: every rank would start its own sweep. Run "
            "it without torchrun (each job starts its DDP processes): python train.py -m ..."
        )
    if int(os.environ.get("RANK", 0)) > 0:
        args += ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]
    elif (anchor := restart_anchor()) and anchor.is_file():
        # a torchrun restart: rank 0 takes up the first attempt's folder (resume=auto finds last.pt)
        args.append(f"hydra.run.dir='{anchor.read_text()}'")
    return args


def restart_anchor() -> Path | None:
    """A file of this torchrun invocation that outlives its worker restarts, in each of which Hydra
    would make a new run folder (facebookresearch/hydra#2070); can go with that issue."""
    # {log dir}/{run id}_{suffix}/attempt_{N}/{local rank}/error.json: the anchor beside attempt_{N}
    attempt = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "")).parent.parent
    return attempt.parent / "run_dir" if attempt.name.startswith("attempt_") else None


def check_rendezvous(init_method: str, hosts: bool = False) -> None:
    """Refuse an unknown tcp:// host, a missing file:// folder: init_process_group won't say it;
    where this process `hosts` the store, a taken port (another run's, or torchrun's own) before
    init_process_group's traceback does."""
    url = urlsplit(init_method)
    if url.scheme == "tcp":
        try:
            socket.getaddrinfo(url.hostname, url.port)
        except socket.gaierror as err:
            raise UserError(
                f"parallel.init_method={init_method}: host {url.hostname} is not known "
                f"({err.strerror}). Give the address of rank 0's machine."
            ) from None
    elif url.scheme == "file" and not (folder := Path(url.path).parent).is_dir():
        raise UserError(
            f"parallel.init_method={init_method}: folder {folder} does not exist. Give a file in a "
            "folder every process sees (across machines, a shared file system)."
        )
    if not hosts or url.scheme == "file":  # a file's store has no port
        return
    env = url.scheme == "env"
    port = int(os.environ["MASTER_PORT"]) if env else url.port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            if under_torchrun() and str(port) == os.environ.get("MASTER_PORT"):
                raise UserError(
                    f"Port {port} of parallel.init_method={init_method} is torchrun's own "
                    "rendezvous (--master_port): under torchrun leave parallel.init_method=env://, "
                    "which joins it."
                ) from None
            where = f"{init_method}, MASTER_PORT" if env else f"parallel.init_method={init_method}"
            pick = ", or torchrun --standalone" if env else " in it, or parallel.init_method=env://"
            raise UserError(
                f"Port {port} of the rendezvous ({where}) is in use, probably by another run. "
                f"Choose a free port{pick} (which picks one)."
            ) from None


def attempt_store(rank: int, timeout: timedelta) -> dist.Store:
    """torchrun's store (one for all restarts) under this attempt's prefix: an earlier one's gloo
    addresses join a restarted group to dead processes (torch 2.14, pytorch/pytorch#135712)."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:  # one agent, one machine
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    else:  # an agent also restarts uncounted
        attempt = store.add(f"train.py/attempts/rank{rank}", 1)
    return dist.PrefixStore(f"train.py/attempt{attempt}", store)


def shared_run_dir(process: Any, run_dir: Path | None = None) -> Path:
    """Rank 0's run folder (the one Hydra made, unless given), which every rank uses."""
    run_dir = str(run_dir or HydraConfig.get().runtime.output_dir)
    if process.is_main and (anchor := restart_anchor()):
        anchor.write_text(run_dir)
    return Path(process.broadcast_object(run_dir))


def quiet_logging(rank: int) -> None:
    """Ranks other than 0 print warnings and errors only, prefixed with their rank."""
    logging.root.setLevel(logging.WARNING)
    formatter = logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    for handler in logging.root.handlers:
        handler.setFormatter(formatter)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or the legacy launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def exit_worker(status: int = 0) -> None:
    """End a DDP worker with `status`, output flushed, without the teardown where torch 2.14's gloo
    can SIGABRT ("terminate called without an active exception", 1 in 10 runs of 3 ranks on 2 busy
    cores): its threads outlive finalization (pytorch/pytorch#179291); can go when that is fixed."""
    # On success, local rank 0 removes torchrun's temporary folder if only the anchor is in it.
    anchor = restart_anchor() if status == 0 and os.environ.get("LOCAL_RANK") == "0" else None
    folder = anchor.parents[1] if anchor else Path()  # {folder}/{run id}_{suffix}/run_dir
    ours = folder.parent == Path(tempfile.gettempdir()) and folder.name.startswith("torchelastic_")
    if ours and all(path == anchor or path.is_dir() for path in folder.rglob("*")):
        shutil.rmtree(folder, ignore_errors=True)
    if "wandb" in sys.modules:  # what its atexit hook does: wait for its files, stop its service
        sys.modules["wandb"].teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
