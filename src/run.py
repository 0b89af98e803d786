"""One run, from a composed config to its metrics: the table of contents of the template.

`train(cfg)` sets up this process (alone, or one rank of a DDP group), builds the data, the model
and the optimizer, trains (validating after every epoch) and evaluates the test split once. It
lives in an importable module, not in `train.py`, so that DDP processes started for a job import
it by name, however the job itself reached its process (submitit and other launchers pickle
`train.py`'s functions by value).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src import checkpoint, distributed, plots
from src.logger import open_logger
from src.training import (
    Fitted,
    build_scheduler,
    check_config,
    evaluate_and_log,
    fit,
    seed_everything,
    set_deterministic,
    speed_up,
    test,
)

log = logging.getLogger("train")


def train(cfg: DictConfig, run_dir: Path | None = None) -> float | None:
    """One training run (or evaluation) in this process: alone, or one rank of a DDP group.

    Returns the best validation value of `checkpoint.monitor` (what a sweeper optimises), or
    None without a validation split. `run_dir` defaults to the folder Hydra made for the run.
    """
    check_config(cfg)
    set_deterministic(cfg.trainer.deterministic)
    proc = distributed.setup(cfg)  # one process, or one rank of a DDP group
    try:
        run_dir = distributed.shared_run_dir(proc, run_dir)
        log.info("Run folder: %s", run_dir)
        if proc.is_main:  # the config as this run uses it, interpolations resolved
            config = OmegaConf.to_yaml(cfg, resolve=True)
            log.info("Config:\n%s", config)
            (run_dir / "config_resolved.yaml").write_text(config)
        # (path, checkpoint): the one training continues from, else the one whose weights it
        # starts from (init_from) or evaluates (train=false ckpt_path=...); None: fresh weights.
        resumed = checkpoint.find_resume(cfg, run_dir, proc)
        weights = resumed or checkpoint.find_weights(cfg, proc)
        with open_logger(cfg, run_dir, proc, resumed) as logger:  # finishes wandb on every exit
            data = instantiate(cfg.data)
            data.setup(proc)

            seed_everything(cfg.seed)  # the same initial weights on every rank
            model = instantiate(cfg.model).to(proc.device)
            if weights:
                checkpoint.load_model(model, *weights)
            model = distributed.wrap(speed_up(model, cfg.trainer), cfg, proc)
            if cfg.train:
                optimizer = instantiate(cfg.optimizer, model.parameters())
                total_steps = data.steps_per_epoch * cfg.trainer.epochs
                total_steps = min(total_steps, cfg.trainer.max_steps or total_steps)
                scheduler = build_scheduler(cfg, optimizer, total_steps)
                state = resumed and resumed[1]
                if not (state and checkpoint.restore(state, optimizer, scheduler, proc)):
                    seed_everything(cfg.seed + proc.rank)  # each rank its own dropout stream
                fitted = fit(model, optimizer, scheduler, data, proc, cfg, logger, run_dir, state)
                result = fitted.best and fitted.best.value
            else:  # train=false: the checkpoint's weights, on the validation split too
                fitted = Fitted(weights[1].get("epoch", 0), weights[1].get("step", 0), None)
                result = None
                if len(data.val[1]):
                    at = {"step": fitted.step, "epoch": fitted.epoch}
                    val = evaluate_and_log(model, data, "val", proc, logger, cfg.trainer, at,
                                           str(weights[0]))  # fmt: skip
                    result = val[cfg.checkpoint.monitor]
            test(model, data, proc, logger, cfg.trainer, fitted, run_dir)  # once, at the end
            if cfg.plots and proc.is_main:
                pictures = plots.draw(run_dir, distributed.unwrap(model), data)
                if logger:
                    logger.log_images(pictures)
        proc.barrier()  # no rank tears the process group down while another still uses it
    finally:
        distributed.teardown()
    return result
