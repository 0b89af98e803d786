"""Train a classifier on MNIST on one device, with DataParallel, or with DDP under torchrun.

    python train.py                                           # one device
    python train.py parallel=dp                               # nn.DataParallel over the GPUs
    torchrun --nproc_per_node=4 train.py parallel=ddp         # DistributedDataParallel, 4 processes
    python train.py -m optimizer.lr=0.1,0.01 model=mlp,cnn    # a Hydra sweep

Every knob is in conf/; `python train.py --help` lists them.
"""

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from src import distributed
from src.logger import open_logger
from src.training import build_scheduler, check_config, fit, seed_everything, set_deterministic

log = logging.getLogger("train")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    check_config(cfg)
    set_deterministic(cfg.trainer.deterministic)
    proc = distributed.setup(cfg)  # one process, or one rank of a DDP group
    try:
        run_dir = distributed.shared_run_dir(proc)
        log.info("Run folder: %s", run_dir)
        with open_logger(cfg, run_dir, proc) as logger:  # finishes wandb on every exit
            data = instantiate(cfg.data)
            data.setup(proc)

            seed_everything(cfg.seed)  # the same initial weights on every rank
            model = distributed.wrap(instantiate(cfg.model).to(proc.device), cfg, proc)
            optimizer = instantiate(cfg.optimizer, model.parameters())
            total_steps = data.steps_per_epoch * cfg.trainer.epochs
            total_steps = min(total_steps, cfg.trainer.max_steps or total_steps)
            scheduler = build_scheduler(cfg, optimizer, total_steps)
            seed_everything(cfg.seed + proc.rank)  # each rank its own dropout stream

            metrics = fit(model, optimizer, scheduler, data, proc, cfg, logger, run_dir)
        proc.barrier()  # no rank tears the process group down while another still uses it
    finally:
        distributed.teardown()
    return metrics.get("test/acc")  # what a sweeper would maximise


if __name__ == "__main__":
    # The repository root anchors data/ and outputs/, wherever train.py is started from.
    os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))
    sys.argv = distributed.hydra_argv(sys.argv)
    main()  # on failure, Hydra exits non-zero from inside
    if distributed.under_torchrun():
        distributed.exit_worker()
