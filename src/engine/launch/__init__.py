"""Starting DDP workers: `python train.py parallel=ddp` launches them itself, through PyTorch's own
launcher API (`elastic_launch`, the code torchrun runs), and every DDP worker, self-launched or
started by torchrun, reports a failure the same way: once, in torchrun's error file.

Also the plumbing between torchrun and Hydra (at the end): the command line each worker hands
Hydra, the run folder a restarted worker group takes up, the rendezvous store of each restart,
the worker's exit. Each workaround names the upstream issue it works around, and when it can go.
"""

from __future__ import annotations

import importlib
import json
import logging
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
    """A mode of a process group (ddp, fsdp) started without torchrun: this process launches
    the workers."""
    return in_group and not any(v in os.environ for v in TORCHRUN_VARIABLES)


def start_workers(train: Callable[[DictConfig, Path], Any], cfg: DictConfig, nproc: int) -> Any:
    """Run `train(cfg, run_dir)` in `nproc` processes of a process group on this machine and
    return rank 0's result.

    The workers get the config already composed and resolved, and this job's run folder, so a
    multirun job's workers train that job. They log as torchrun's would: rank 0 like this process
    (console and train.log), the others warnings only. Each imports `train` by its module and name:
    the function object itself may have reached this process pickled by value (submitit does
    that to train.py's functions), and nothing it carries says where its code lives.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    target = importable_name(train)
    hydra = HydraConfig.get()
    # The workers' error files, in a folder removed after them (torch's own default, a
    # torchelastic_* folder in the temporary directory, is left behind).
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
        monitor_interval=0.1,
        start_method="spawn",
    )
    log.info("Starting %d processes", nproc)
    args = (
        target,
        OmegaConf.to_container(cfg, resolve=True),
        hydra.runtime.output_dir,
        OmegaConf.to_container(hydra.job_logging, resolve=True),
        max(1, (os.cpu_count() or 1) // nproc),
    )
    # The launcher logs each failure with its own traceback, and a signal it passes on; the
    # first failure is reported below, and the workers say what a signal did. Each of its modules
    # sets its own logger's level, so each is quietened.
    elastic = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
    ]
    levels = [logger.level for logger in elastic]
    for logger in elastic:
        logger.setLevel(logging.CRITICAL)
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
        for logger, level in zip(elastic, levels, strict=True):
            logger.setLevel(level)
        shutil.rmtree(logs, ignore_errors=True)
    return results[0]


def _worker(
    train: tuple[str, str],
    config: dict[str, Any],
    run_dir: str,
    job_logging: dict[str, Any],
    threads: int,
) -> Any:
    """One self-launched DDP process (the environment torchrun would set is set): runs the
    function `train` names (module, function) on the config."""
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
    """`train(*args)` in a DDP worker: a failure exits with status 1 and is written to torchrun's
    error file, from where torchrun (or `start_workers`) reports the first failing rank, once.

    A user's mistake is recorded as its message alone, anything else with its traceback. Only a
    stop on a signal is also printed here: torchrun, stopped by the signal too, reports nothing.
    """
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
        record = {"message": str(err), "timestamp": int(time.time())}
        Path(error_file).write_text(json.dumps(record))
        exit_worker(1)  # as recorded: the interpreter's teardown could make it a SIGABRT
    except Exception:  # noqa: BLE001 - recorded with its traceback, for the launcher to show
        ErrorHandler().record_exception(sys.exc_info()[1])
    # A crash, often a collective that lost a killed peer: through the teardown, which leaves
    # the launcher time to find the peer's death first and report that, the cause.
    logging.shutdown()
    sys.exit(1)


def leave_it_to_local_rank_0(error_file: Path, wait: float = 5.0) -> None:
    """A mistake every rank finds alike is told by local rank 0: torchrun quotes every failed
    rank's error, so the others wait for the launcher to stop them once rank 0 has failed, and
    record only that (after rank 0's failure: its stays torchrun's root cause). If it does not
    come within `wait` seconds, they tell the mistake themselves."""

    def stopped(*_: Any) -> None:
        message = "stopped: local rank 0 failed first, with the same mistake (the root cause)"
        error_file.write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
        exit_worker(1)

    signal.signal(signal.SIGTERM, stopped)
    time.sleep(wait)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Launcher plumbing: what torchrun and Hydra need from each other.


def hydra_argv(argv: list[str]) -> list[str]:
    """The command line to hand Hydra, fixed up for the launcher. Runs before Hydra parses it.

    - The legacy `python -m torch.distributed.launch` appends `--local-rank=N`, which Hydra would
      reject: take it out (its value is also in the LOCAL_RANK variable). Hydra reads every
      argument as an override (the failure seen in facebookresearch/fairseq#4164); this can go
      when PyTorch removes the deprecated launcher.
    - Ranks other than 0 write nothing: no `.hydra/` folder and no log file, and no run folder of
      their own (each rank resolving `${now:...}` itself would make one per rank when ranks start in
      different seconds: facebookresearch/hydra#2070, ashleve/lightning-hydra-template#393). They
      learn rank 0's run folder in `shared_run_dir`. This can go when Hydra hands one resolved
      run folder to every process of a job.
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
    elif (anchor := restart_anchor()) and anchor.is_file():
        # torchrun restarted the workers: rank 0 takes up the first attempt's run folder, where
        # resume=auto finds its last.pt.
        args.append(f"hydra.run.dir='{anchor.read_text()}'")
    return args


def restart_anchor() -> Path | None:
    """A file that belongs to this torchrun invocation and outlives its worker restarts.

    torchrun keeps each attempt's error files in {log dir}/{run id}_{suffix}/attempt_{N}/{local
    rank}/error.json; the folder above attempt_{N} is the same for every attempt. A restarted
    worker is a new process, in which Hydra would make a new run folder (facebookresearch/hydra#2070
    again); the anchor can go with that issue.
    """
    error_file = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))
    if not error_file.parent.parent.name.startswith("attempt_"):
        return None
    return error_file.parents[2] / "run_dir"


def legacy_launcher_used() -> bool:
    """Whether this worker was started by the deprecated `python -m torch.distributed.launch`."""
    return _legacy_launcher


def check_port_free(init_method: str) -> None:
    """Stop before the rendezvous if its port is taken (by another run, most often).

    Not a workaround, a message: without it, a taken port surfaces as a DistNetworkError
    traceback from deep inside init_process_group."""
    url = urlsplit(init_method)
    port = int(os.environ["MASTER_PORT"]) if url.scheme == "env" else url.port
    if port is None:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            where, fix = (
                (f"{init_method}, MASTER_PORT", "Choose a free port, or let torchrun choose one: "
                 "torchrun --standalone ... or --rdzv-endpoint=localhost:0.")
                if url.scheme == "env"
                else (f"parallel.init_method={init_method}", "Choose a free port in it, or leave "
                      "parallel.init_method at env:// (a free port is picked).")
            )  # fmt: skip
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
    """torchrun's key-value store at MASTER_ADDR:MASTER_PORT, under a prefix of this attempt's own.

    torchrun keeps one store for all restarts of a worker group, and the keys an earlier attempt
    left there (each rank's gloo address) make a restarted group connect to dead processes
    (torch 2.14, pytorch/pytorch#135712). With one torchrun agent, the attempt is its restart
    count, the same for every rank (a rank killed before it counted anything cannot fall behind).
    Across machines each agent counts its own restarts (one also restarts, uncounted, when another
    machine's workers fail), so there each rank counts its attempts in the store. This can go
    when torchrun gives each restart a store of its own.
    """
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
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(
            logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        )


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or the legacy launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def remove_torchrun_folder() -> None:
    """Remove torchrun's folder of the workers' error files (torchelastic_* in the temporary
    directory, where no --log-dir names another), which torchrun leaves behind, once this
    machine's run succeeded: local rank 0 does, where the folder holds nothing of torchrun's (an
    earlier attempt's error, --redirects' logs), only this run's restart anchor."""
    if os.environ.get("LOCAL_RANK") != "0" or not (anchor := restart_anchor()):
        return
    folder = anchor.parents[1]  # {folder}/{run id}_{suffix}/run_dir
    torchruns = folder.name.startswith("torchelastic_")  # by default, under the temporary directory
    if (
        torchruns
        and folder.parent == Path(tempfile.gettempdir())
        and all(path == anchor or path.is_dir() for path in folder.rglob("*"))
    ):
        shutil.rmtree(folder, ignore_errors=True)


def exit_worker(status: int = 0) -> None:
    """End a DDP worker whose work is done (or whose failure is recorded) with `status`, its
    output flushed, skipping the interpreter's teardown.

    With the gloo backend, PyTorch can abort a process while the interpreter tears down
    ("terminate called without an active exception", SIGABRT), which torchrun reports as a failed
    run although every rank finished. Seen here with torch 2.14 in about 1 of 10 runs of 3 ranks
    on 2 busy cores, also with no DDP and no destroy_process_group; never with this exit. Gloo's
    threads outlive the interpreter's finalization (pytorch/pytorch#179291 proposed destroying
    process groups at exit and was abandoned in 2026); this can go when a release does that.
    """
    if status == 0:
        remove_torchrun_folder()
    if "wandb" in sys.modules:  # what its atexit hook does: wait for its files, stop its service
        sys.modules["wandb"].teardown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
