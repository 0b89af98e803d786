"""Starting DDP workers: `python train.py parallel=ddp` launches them itself, through PyTorch's own
launcher API (`elastic_launch`, the code torchrun runs), and every DDP worker, self-launched or
started by torchrun, reports a failure the same way: once, in torchrun's error file.
"""

from __future__ import annotations

import importlib
import json
import logging
import logging.config
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler

from src.distributed import TORCHRUN_VARIABLES
from src.errors import UserError
from src.training import Stopped

log = logging.getLogger(__name__)


class WorkerFailed(CompactHydraException):
    """A DDP worker failed; the message carries its own error (Hydra prints the message alone)."""


def spawns(cfg: DictConfig) -> bool:
    """parallel=ddp started without torchrun: this process launches the workers."""
    return cfg.parallel.mode == "ddp" and not any(v in os.environ for v in TORCHRUN_VARIABLES)


def nproc_per_node(cfg: DictConfig) -> int:
    """`parallel.nproc_per_node`, or one process per visible GPU, or 2 on a CPU-only machine."""
    nproc, gpus = cfg.parallel.nproc_per_node, torch.cuda.device_count()
    if nproc is None:
        return gpus or 2
    if nproc < 1:
        raise UserError(f"parallel.nproc_per_node={nproc}: use 1 or more (or null for automatic).")
    if nproc > gpus > 0 and cfg.device in ("auto", "cuda"):
        raise UserError(
            f"parallel.nproc_per_node={nproc}, but {gpus} GPUs are visible: one process per GPU. "
            f"Use parallel.nproc_per_node={gpus} or fewer (or device=cpu for CPU processes)."
        )
    return nproc


def spawn(train: Callable[[DictConfig, Path], Any], cfg: DictConfig) -> Any:
    """Run `train(cfg, run_dir)` in `parallel.nproc_per_node` DDP processes on this machine and
    return rank 0's result.

    The workers get the config already composed and resolved, and this job's run folder, so a
    multirun job's workers train that job. They log as torchrun's would: rank 0 like this process
    (console and train.log), the others warnings only. Each imports `train` by its module and name:
    the function object itself may have reached this process pickled by value (submitit does
    that to train.py's functions), and nothing it carries says where its code lives.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    target = importable_name(train)
    nproc = nproc_per_node(cfg)
    hydra = HydraConfig.get()
    config = LaunchConfig(
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
    log.info("Starting %d DDP processes", nproc)
    args = (
        target,
        OmegaConf.to_container(cfg, resolve=True),
        hydra.runtime.output_dir,
        OmegaConf.to_container(hydra.job_logging, resolve=True),
        max(1, (os.cpu_count() or 1) // nproc),
    )
    # The launcher logs each failure with its own traceback; the first one is reported below.
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level, elastic_log.level = elastic_log.level, logging.CRITICAL
    try:
        results = elastic_launch(config, _worker)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # an exception: its traceback, recorded by the worker
            message = f"rank {rank} failed:\n{message['extraInfo']['py_callstack'].rstrip()}"
        elif failure.exitcode < 0:  # a signal
            message = f"rank {rank}: {message}. The other processes were stopped."
        raise WorkerFailed(message) from None
    finally:
        elastic_log.setLevel(level)
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
            "src/, as src/run.py defines train."
        )
    return module, name


def run_worker(train: Callable[..., Any], *args: Any) -> Any:
    """`train(*args)` in a DDP worker: a failure exits with status 1 and is written to torchrun's
    error file, from where torchrun (or `spawn`) reports the first failing rank, once.

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
        record = {"message": str(err), "timestamp": int(time.time())}
        Path(error_file).write_text(json.dumps(record))
    except Exception:  # noqa: BLE001 - recorded with its traceback, for the launcher to show
        ErrorHandler().record_exception(sys.exc_info()[1])
    logging.shutdown()
    sys.exit(1)
