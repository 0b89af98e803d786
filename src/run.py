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

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src import checkpoint, distributed, drift, plots, resume, storage
from src.checkpoint import Checkpointer, Parts
from src.errors import instantiated, on_every_rank
from src.logger import MetricsLogger, open_logger
from src.settings import Trainer, read_settings
from src.tasks import Task, preflight
from src.training import (
    Fitted,
    build_scheduler,
    check_accumulation,
    check_count,
    check_schedule,
    compiled,
    configure_kernels,
    during_the_test,
    evaluate_and_log,
    fit,
    interrupted,
    seed_everything,
    signals_interrupt,
    test,
)

log = logging.getLogger("train")

# What a model may take from the data: a sample's shape (any data; an image's channels and size)
# and what it is to output (the number of classes; a target's shape).
DATA_SHAPE = ("input_shape", "in_channels", "image_size", "num_classes", "target_shape")


def train(cfg: DictConfig, run_dir: Path | None = None) -> float | None:
    """One training run (or evaluation) in this process: alone, or one rank of a DDP group.

    Returns the best validation value of `checkpoint.monitor` (what a sweeper optimises), or
    None without a validation split. `run_dir` defaults to the folder Hydra made for the run.
    """
    with on_every_rank():  # under torchrun, one rank per machine tells a mistake found here
        settings = read_settings(cfg)  # the config's values, checked before any work
        trainer, task = settings.trainer, settings.task
        configure_kernels(trainer)
        process = distributed.setup(cfg, trainer)  # one process, or one rank of a DDP group
    # Where a signal outside training (SIGTERM, Ctrl-C) finds the run, and what is kept.
    when = "before training; nothing was saved" if cfg.train else "during the evaluation"
    try:
        if cfg.train:  # each rank's share of a batch splits into the micro-batches asked for
            check_accumulation(trainer, cfg.data.batch_size, process.world_size)
        run_dir = distributed.shared_run_dir(process, run_dir)
        log.info("Run folder: %s", run_dir)
        with storage.held(run_dir, process), signals_interrupt():  # one run per folder
            # (path, checkpoint): the one training continues from, else the one whose weights it
            # starts from (init_from) or evaluates (train=false ckpt_path=...); None: fresh weights.
            resumed = checkpoint.find_resume(cfg, run_dir, process)
            # The config as this run uses it, interpolations resolved; saved with each checkpoint.
            config = OmegaConf.to_container(cfg, resolve=True)
            if resumed:  # what this config changes from the checkpoint's: applied, or refused
                resume.check_changes(resumed[1].get("config"), config, resumed[0])
            write_config(config, run_dir, process, resumed and (resumed[0], resumed[1]["step"]))
            weights = resumed or checkpoint.find_weights(cfg, process)
            with open_logger(
                cfg, run_dir, process, resumed
            ) as logger:  # finishes wandb on every exit
                data = instantiated("data", cfg.data)
                data.setup(process, trainer.dtype)
                if cfg.train:  # under DDP: the ranks' shares of the first batch make it up
                    drift.check_first_batch(data, process)
                    check_count(task, data, process)  # and it has something to learn from

                model = build_model(cfg, trainer, process, weights, data, task)
                if cfg.train:
                    state = resumed and resumed[1]
                    if state:  # a mid-epoch checkpoint, in this config's batches
                        resume.rebatch(state, cfg.data.batch_size, data.size("train"))
                    parts = build_parts(cfg, trainer, model, data.steps_per_epoch, process, state)
                    saver = Checkpointer(
                        settings.checkpoint,
                        run_dir,
                        process,
                        parts,
                        config,
                        logger.run_id if logger else None,
                    )
                    if resumed:  # intact until this run writes its own
                        saver.kept = (resumed[0], state["step"])
                    fitted = fit(parts, data, process, settings, saver, logger, run_dir, state)
                    result = fitted.best and fitted.best.value
                    when = during_the_test(fitted.step, saver)  # for a signal now
                else:  # train=false: the checkpoint's weights, on the validation split too
                    fitted = Fitted(weights[1].get("epoch", 0), weights[1].get("step", 0), None)
                    result = None
                    if data.size("val"):
                        at = {"step": fitted.step, "epoch": fitted.epoch}
                        val = evaluate_and_log(
                            model, task, data, "val", process, logger, trainer, at, str(weights[0])
                        )
                        result = val[settings.checkpoint.monitor]
                test(
                    model, task, data, process, logger, trainer, fitted, run_dir
                )  # once, at the end
                unwritten = logger and logger.fault  # metrics.jsonl, refused by the storage
                # Every rank predicts: under FSDP a forward needs them all.
                shown = plots.predict(distributed.unwrap(model), data, task) if cfg.plots else None
                if cfg.plots and process.is_main and not unwritten:
                    unwritten = storage.attempt(lambda: draw(run_dir, shown, data, logger))
                # Every rank stops together, and none tears the process group down while another
                # still uses it.
                if unwritten := storage.agree(process, unwritten or None):
                    kept = saver.kept if cfg.train else None
                    raise storage.stopped(unwritten, run_dir, fitted.step, kept)
    except KeyboardInterrupt:
        raise interrupted(process, when) from None
    finally:
        distributed.teardown()
    return result


def write_config(
    config: dict, run_dir: Path, process: distributed.Process, kept: tuple[Path, int] | None
) -> None:
    """Log the resolved config and write it to `config_resolved.yaml` (the main process); every
    rank stops if the storage refuses it."""
    path = run_dir / "config_resolved.yaml"

    def write() -> None:
        text = OmegaConf.to_yaml(config)
        log.info("Config:\n%s", text)
        storage.write_atomically(path, lambda file: file.write(text.encode()))

    if unwritten := storage.on_main(process, write):
        raise storage.stopped(unwritten, run_dir, None, kept)


def draw(run_dir: Path, shown: plots.Predicted | None, data, logger: MetricsLogger | None) -> None:
    """The run's pictures, into the run folder and to the tracker."""
    pictures = plots.draw(run_dir, shown, data)
    if logger:
        logger.log_images(pictures)


def build_model(
    cfg: DictConfig,
    trainer: Trainer,
    process: distributed.Process,
    weights: tuple | None,
    data,
    task: Task,
) -> nn.Module:
    """The model of `cfg.model`, the same on every rank, with the checkpoint `weights` if given,
    checked to take the data's samples and give the task what it needs (`preflight`), wrapped
    as the parallel mode trains it."""
    # The input's shape and the number of classes that the config leaves to the data to find.
    found = {key: getattr(data, key) for key in DATA_SHAPE if cfg.model.get(key, 0) is None}
    seed_everything(cfg.seed)  # the same initial weights on every rank
    # Built in float32 (as the default dtype makes it), then cast: float64 starts from the same
    # weights as float32 does.
    model = instantiated("model", cfg.model, **found).to(process.device, trainer.dtype)
    preflight(model, data, task, cfg.model.get("_target_"))
    shards = weights and weights[1].get(checkpoint.SHARDS)  # checkpoint.sharded=true's folder
    if weights and not shards:
        checkpoint.load_model(model, *weights)
    drift.check_start(model, process)  # under DDP: every rank's weights are rank 0's
    if cfg.parallel.get("sync_batchnorm"):  # BatchNorm's statistics over all ranks' shares
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if process.mode == "fsdp":  # compiled with FSDP's hooks, which gather each unit's weights
        model = distributed.wrap(model, cfg, process, trainer)
        if shards:  # each rank reads its own parts
            checkpoint.load_shards(model, weights[0], shards)
        return compiled(model, trainer)
    return distributed.wrap(compiled(model, trainer), cfg, process, trainer)


def build_parts(
    cfg: DictConfig,
    trainer: Trainer,
    model: nn.Module,
    steps_per_epoch: int,
    process: distributed.Process,
    state: dict | None,
) -> Parts:
    """The model with its optimizer, schedule and float16's loss scaler: fresh, or continued from
    the checkpoint `state` training resumes."""
    optimizer = instantiated("optimizer", cfg.optimizer, model.parameters(), values=True)
    settings = resume.settings_of(optimizer)  # this config's lr, momentum, ...
    scaler_type = torch.amp.GradScaler
    if process.mode == "fsdp":  # imported here: 0.5 s to import, which no other mode pays
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler_type = ShardedGradScaler
    # float16 gradients underflow without loss scaling; for other precisions it is off. FSDP's
    # ranks each see a part of the gradients: its scaler agrees with the others on overflows.
    scaler = scaler_type(process.device.type, enabled=trainer.precision == "16")
    continued = bool(state) and checkpoint.restore(state, model, optimizer, scaler, process)
    if state:  # the optimizer's moments continue, its settings and its schedule are this config's
        resume.apply_settings(optimizer, settings)
    total_steps = steps_per_epoch * trainer.epochs
    total_steps = min(total_steps, trainer.max_steps or total_steps)
    check_schedule(cfg, total_steps, steps_per_epoch)  # its whole plan, before training
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    if state:
        resume.replan(scheduler, state["scheduler"]["last_epoch"])
    if not continued:
        seed_everything(cfg.seed + process.rank)  # each rank its own dropout stream
        distributed.seed_dp_replicas(process, cfg.seed)  # and under dp, each GPU's replica
    parts = Parts(model, optimizer, scheduler, scaler)
    return parts
