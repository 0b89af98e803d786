"""Train a classifier on MNIST on one device, with DataParallel, or with DDP or FSDP under torchrun.

    python train.py                                           # one device
    python train.py parallel=dp                               # nn.DataParallel over the GPUs
    torchrun --nproc_per_node=4 train.py parallel=ddp         # DistributedDataParallel, 4 processes
    python train.py parallel=ddp parallel.nproc_per_node=4    # the same, processes started here
    torchrun --nproc_per_node=4 train.py parallel=fsdp        # FSDP: the model sharded over 4
    python train.py -m optimizer.lr=0.1,0.01 model=mlp,cnn    # a Hydra sweep
    python train.py train=false ckpt_path=PATH                # evaluate a checkpoint
    python train.py debug=equivalence model=cnn               # does DDP train it as one process?

Every knob is in conf/; `python train.py --help` lists them. This file picks how the run is
launched; the run itself, top to bottom, is `train` in src/engine/run.py.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from src.engine import launch
from src.engine.build import read_settings
from src.engine.data import check_shares
from src.engine.run import train
from src.engine.tools import equivalence


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    if (cfg.debug or {}).get("equivalence"):  # debug=equivalence: compare, don't train
        return equivalence.check(cfg)
    if launch.under_torchrun():  # a worker: failures go to torchrun's error file
        return launch.run_worker(train, cfg)
    settings = read_settings(cfg)  # the config's values checked before any work
    parallel = settings.parallel
    if launch.starts_workers_here(parallel.in_group):  # ddp, fsdp: the processes start here
        check_shares(cfg.data.batch_size, nproc := parallel.processes(cfg.device))  # before them
        return launch.start_workers(train, cfg, nproc)
    return train(cfg, settings=settings)


if __name__ == "__main__":
    # The repository root anchors data/ and outputs/, wherever train.py is started from, and
    # processes started for this run (submitit's SLURM jobs) import src/ from it.
    root = str(Path(__file__).resolve().parent)
    os.environ.setdefault("PROJECT_ROOT", root)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    # cuBLAS reads this at its first call only, so a deterministic job after another in the same
    # process (a sweep) needs it set now; it costs about 24 MiB of GPU memory, no speed.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sys.argv = launch.hydra_argv(sys.argv)
    main()  # on failure, Hydra exits non-zero from inside
    if launch.under_torchrun():
        launch.exit_worker()
