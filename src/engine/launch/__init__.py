"""Starting DDP workers through PyTorch's launcher API (`elastic_launch`, what torchrun runs), and
reporting a worker's failure once, in torchrun's error file, whoever started it. At the end, the
plumbing between torchrun and Hydra: each workaround names its upstream issue and when it can go."""

from __future__ import annotations

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
from typing import Any
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
_legacy_launcher = False


class WorkerFailed(CompactHydraException):
    """A DDP worker failed; the message carries its own error (Hydra prints the message alone)."""


def starts_workers_here(in_group: bool) -> bool:
    """Whether this process starts the workers: a process group's mode (ddp, fsdp), no torchrun."""
    return in_group and not any(v in os.environ for v in TORCHRUN_VARIABLES)


def start_workers(train: Callable[[DictConfig, Path], Any], cfg: DictConfig, nproc: int) -> Any:
    """Run `train(cfg, run_dir)` in `nproc` processes on this machine, in this job's run folder, and
    return rank 0's result. The workers import `train` by module and name: submitit may have
    pickled it by value, and then nothing it carries says where its code lives."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    hydra = HydraConfig.get()
    # The workers' error files, in a folder removed after them (torch's default is left behind).
    logs = Path(tempfile.mkdtemp(prefix="train-workers-"))
    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=str(logs)),
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"train-{uuid.uuid4()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as torchrun --standalone picks
        max_restarts=0,
        start_method="spawn",
    )
    log.info("Starting %d processes", nproc)
    args = (
        importable_name(train),
        OmegaConf.to_container(cfg, resolve=True),
        hydra.runtime.output_dir,
        OmegaConf.to_container(hydra.job_logging, resolve=True),
        max(1, (os.cpu_count() or 1) // nproc),
    )
    # Quieten the launcher (each module sets its own level), which logs each failure's traceback
    # and each signal it passes on: the first failure is reported below, a signal by the workers.
    levels = {
        name: logging.getLogger(name).level
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
    }
    for name in levels:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _worker)(*args)
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
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        shutil.rmtree(logs, ignore_errors=True)
    return results[0]


def _worker(
    train: tuple[str, str], config: dict, run_dir: str, job_logging: dict, threads: int
) -> Any:
    """One self-launched DDP process, in torchrun's environment: runs the function `train` names
    (module, function) on the config."""
    if os.environ["RANK"] == "0":
        logging.config.dictConfig(job_logging)
    else:
        logging.basicConfig(stream=sys.stdout, level=logging.INFO)
    torch.set_num_threads(threads)  # the machine's cores shared between the processes
    module, name = train
    function = getattr(importlib.import_module(module), name)
    return run_worker(function, OmegaConf.create(config), Path(run_dir))


def importable_name(function: Callable[..., Any]) -> tuple[str, str]:
    """(module, name) by which a new process imports `function`; refused for one it cannot."""
    module, name = function.__module__, function.__qualname__
    if module == "__main__" or "<" in name:
        raise ValueError(
            f"DDP processes import the training function by module and name, and {name} of "
            f"{module} has none they could import. Define it at the top level of a module under "
            "src/, as src/engine/run.py defines train."
        )
    return module, name


def run_worker(train: Callable[..., Any], *args: Any) -> Any:
    """`train(*args)` in a DDP worker: a failure exits with 1 and is written to torchrun's error
    file (a user's mistake as its message, anything else with its traceback), for the launcher to
    report once. A stop on a signal is also printed: torchrun, stopped too, reports nothing."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return train(*args)
    try:
        return train(*args)
    except CompactHydraException as err:
        if isinstance(err, Stopped):
            print(err, file=sys.stderr)
        if getattr(err, "every_rank", False) and os.environ.get("LOCAL_RANK", "0") != "0":
            leave_it_to_local_rank_0(Path(error_file))
        _fail(Path(error_file), str(err))
    except Exception:  # noqa: BLE001 - recorded with its traceback, for the launcher to show
        ErrorHandler().record_exception(sys.exc_info()[1])
    # A crash, often a collective that lost a killed peer: through the teardown, which leaves
    # the launcher time to find the peer's death first and report that, the cause.
    logging.shutdown()
    sys.exit(1)


def leave_it_to_local_rank_0(error_file: Path, wait: float = 5.0) -> None:
    """A mistake every rank finds alike is told by local rank 0 alone (torchrun quotes every failed
    rank's error): the others wait `wait` seconds for the launcher to stop them and record only
    that, after rank 0's failure, which stays the root cause. Else they tell it themselves."""
    message = "stopped: local rank 0 failed first, with the same mistake (the root cause)"
    signal.signal(signal.SIGTERM, lambda *_: _fail(error_file, message))
    time.sleep(wait)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _fail(error_file: Path, message: str) -> None:
    """Record `message` as this worker's failure and exit with 1, as recorded (`exit_worker`)."""
    error_file.write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    exit_worker(1)


# Launcher plumbing: what torchrun and Hydra need from each other.


def hydra_argv(argv: list[str]) -> list[str]:
    """The command line to hand Hydra, fixed up before it parses it. The legacy launcher's
    `--local-rank=N` is taken out, or Hydra rejects it (facebookresearch/fairseq#4164); can go with
    that launcher. Ranks other than 0 write no `.hydra/`, log or run folder (`${now:...}` makes one
    per rank: facebookresearch/hydra#2070, ashleve/lightning-hydra-template#393) and use rank 0's
    (`shared_run_dir`); can go when Hydra gives every process of a job one resolved run folder."""
    global _legacy_launcher
    args = []
    for arg in argv:
        if match := LEGACY_LOCAL_RANK.fullmatch(arg):
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
    elif (anchor := restart_anchor()) and anchor.is_file():
        # a torchrun restart: rank 0 takes up the first attempt's folder (resume=auto finds last.pt)
        args.append(f"hydra.run.dir='{anchor.read_text()}'")
    return args


def restart_anchor() -> Path | None:
    """A file of this torchrun invocation that outlives its worker restarts, in each of which Hydra
    would make a new run folder (facebookresearch/hydra#2070); can go with that issue."""
    # {log dir}/{run id}_{suffix}/attempt_{N}/{local rank}/error.json: the anchor beside attempt_{N}
    error_file = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if not error_file.parent.parent.name.startswith("attempt_"):
        return None
    return error_file.parents[2] / "run_dir"


def legacy_launcher_used() -> bool:
    """Whether this worker was started by the deprecated `python -m torch.distributed.launch`."""
    return _legacy_launcher


def check_port_free(init_method: str) -> None:
    """Stop before the rendezvous if its port is taken (by another run, most often): a message,
    not a workaround, instead of a DistNetworkError traceback from inside init_process_group."""
    url = urlsplit(init_method)
    env = url.scheme == "env"
    port = int(os.environ["MASTER_PORT"]) if env else url.port
    if port is None:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            where = f"{init_method}, MASTER_PORT" if env else f"parallel.init_method={init_method}"
            fix = (
                "Choose a free port, or let torchrun choose one: torchrun --standalone ... or "
                "--rdzv-endpoint=localhost:0."
                if env
                else "Choose a free port in it, or leave parallel.init_method at env:// (a free "
                "port is picked)."
            )
            raise UserError(
                f"Port {port} of the rendezvous ({where}) is in use, probably by another run. {fix}"
            ) from None


def check_rendezvous(init_method: str) -> None:
    """The host of a tcp:// rendezvous is known, the folder of a file:// one exists: else
    init_process_group fails deep inside, or waits without a word (file://)."""
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


def attempt_store(rank: int, timeout: timedelta) -> dist.Store:
    """torchrun's key-value store at MASTER_ADDR:MASTER_PORT, under a prefix of this attempt's own:
    torchrun keeps one for all restarts, and an earlier attempt's keys (each rank's gloo address)
    make a restarted group connect to dead processes (torch 2.14, pytorch/pytorch#135712); can go
    when each restart gets a store of its own. The attempt is the one agent's restart count, or,
    across machines (where an agent also restarts uncounted), each rank's own count in the store."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:  # one agent, one machine
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    else:
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


def remove_torchrun_folder() -> None:
    """Once this machine's run succeeded, local rank 0 removes the folder of error files torchrun
    leaves behind (torchelastic_* in the temporary directory, with no --log-dir), if it holds
    nothing of torchrun's (an earlier attempt's error, --redirects' logs), only the anchor."""
    if os.environ.get("LOCAL_RANK") != "0" or not (anchor := restart_anchor()):
        return
    folder = anchor.parents[1]  # {folder}/{run id}_{suffix}/run_dir
    if (
        folder.name.startswith("torchelastic_")
        and folder.parent == Path(tempfile.gettempdir())
        and all(path == anchor or path.is_dir() for path in folder.rglob("*"))
    ):
        shutil.rmtree(folder, ignore_errors=True)


def exit_worker(status: int = 0) -> None:
    """End a finished (or failed, and recorded) DDP worker with `status`, its output flushed but the
    interpreter's teardown skipped: there, with gloo, torch 2.14 can SIGABRT ("terminate called
    without an active exception"; 1 in 10 runs of 3 ranks on 2 busy cores, never with this exit),
    which torchrun reports as a failure. Gloo's threads outlive finalization (abandoned fix:
    pytorch/pytorch#179291); can go when a release destroys process groups at exit."""
    if status == 0:
        remove_torchrun_folder()
    if "wandb" in sys.modules:  # what its atexit hook does: wait for its files, stop its service
        sys.modules["wandb"].teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
