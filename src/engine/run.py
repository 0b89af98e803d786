"""One run, from a composed config to its metrics: the table of contents of the template.

`train(cfg)` sets up this process (alone, or one rank of a DDP group), builds the data, the model
and the optimizer, trains (validating after every epoch) and evaluates the test split once. It is
the composition root: the config ends here (with `src/engine/build.py`), and below it only typed
settings and built objects travel. It lives in an importable module, not in `train.py`, so that
DDP processes started for a job import it by name, however the job itself reached its process
(submitit and other launchers pickle `train.py`'s functions by value).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.engine import checkpoint, storage
from src.engine.build import build_model, build_parts, check_accumulation, configure_kernels
from src.engine.checkpoint import Checkpointer
from src.engine.config import Settings, read_settings
from src.engine.core.context import Hooks, Run
from src.engine.core.evaluate import Fitted, evaluate_and_log, test
from src.engine.core.loop import fit
from src.engine.errors import instantiated, on_every_rank
from src.engine.guards import drift
from src.engine.guards.checks import NonFinite, UnwrittenMetrics, check_count
from src.engine.guards.signals import StopSignals, during_the_test, interrupted, signals_interrupt
from src.engine.launch import shared_run_dir
from src.engine.logger import open_logger
from src.engine.parallel import Process, teardown
from src.engine.tools import plots
from src.engine.tools.profiler import Profiler
from src.engine.tools.progress import ProgressBar
from src.engine.tools.speed import Speed
from src.engine.tools.warmup import WarmUp

log = logging.getLogger("train")


def train(cfg: DictConfig, run_dir: Path | None = None) -> float | None:
    """One training run (or evaluation) in this process: alone, or one rank of a DDP group.

    Returns the best validation value of `checkpoint.monitor` (what a sweeper optimises), or
    None without a validation split. `run_dir` defaults to the folder Hydra made for the run.
    """
    with on_every_rank():  # under torchrun, one rank per machine tells a mistake found here
        settings = read_settings(cfg)  # the config's values, checked before any work
        configure_kernels(settings.trainer)
        process = settings.parallel.setup(settings.device, settings.trainer)  # or a rank of a group
    # Where a signal outside training (SIGTERM, Ctrl-C) finds the run, and what is kept.
    when = "before training; nothing was saved" if cfg.train else "during the evaluation"
    try:
        if cfg.train:  # each rank's share of a batch splits into the micro-batches asked for
            check_accumulation(settings.trainer, cfg.data.batch_size, process.world_size)
        run_dir = shared_run_dir(process, run_dir)
        log.info("Run folder: %s", run_dir)
        with storage.held(run_dir, process), signals_interrupt():  # one run per folder
            resumed, weights, config = starting_point(cfg, settings, run_dir, process)
            with open_logger(run_dir, process, resumed, tracker(cfg, config, run_dir)) as logger:
                data = instantiated("data", cfg.data)
                data.setup(process, settings.trainer.dtype, settings.trainer.memory_format)
                run = Run(process, settings, data, logger, hooks=hooks(settings), run_dir=run_dir)
                if cfg.train:  # under DDP: the ranks' shares of the first batch make it up
                    drift.check_first_batch(data, process)
                    check_count(run)  # and it has something to learn from
                model = build_model(cfg, run, weights)
                if cfg.train:
                    parts, progress, saved = build_parts(cfg, run, model, resumed and resumed[1])
                    run.checkpointer = checkpointer(run, saved, config, resumed)
                    fitted = fit(run, parts, progress)
                    result = fitted.best and fitted.best.value
                    when = during_the_test(fitted.step, run.checkpointer)  # for a signal now
                else:  # train=false: the checkpoint's weights, on the validation split too
                    fitted, result = evaluate_weights(run, model, weights)
                test(run, model, fitted)  # once, at the end
                finish(run, model, fitted, cfg.plots)
    except KeyboardInterrupt:
        raise interrupted(process, when) from None
    finally:
        teardown()
    return result


def starting_point(
    cfg: DictConfig, settings: Settings, run_dir: Path, process: Process
) -> tuple[tuple | None, tuple | None, dict[str, Any]]:
    """The checkpoint training continues from (path, contents; None: it starts fresh), the one
    whose weights it starts from (init_from) or evaluates (train=false ckpt_path=...), and the
    config as this run uses it, interpolations resolved, written to the run folder."""
    resumed = checkpoint.find_resume(settings, run_dir, process)
    config = OmegaConf.to_container(cfg, resolve=True)
    if resumed:  # what this config changes from the checkpoint's: applied, or refused
        checkpoint.check_changes(resumed[1].get("config"), config, resumed[0])
    step = resumed and resumed[1]["progress"]["step"]
    write_config(config, run_dir, process, resumed and (resumed[0], step))
    return resumed, resumed or checkpoint.find_weights(settings, process), config


def checkpointer(
    run: Run, parts: dict[str, Any], config: dict[str, Any], resumed: tuple | None
) -> Checkpointer:
    """What saves the run's checkpoints; the one it resumes from is kept until it writes its own."""
    metadata = {"config": config, "wandb_id": run.logger.run_id if run.logger else None}
    saver = Checkpointer(run.settings.checkpoint, run.run_dir, run.process, run.strategy, parts,
                         metadata)  # fmt: skip
    saver.kept = resumed and (resumed[0], resumed[1]["progress"]["step"])
    return saver


def hooks(settings: Settings) -> Hooks:
    """The guards and the tools the loop calls, in the order they act at each of its points."""
    trainer = settings.trainer
    chosen = [WarmUp()] if trainer.warmup_steps else []  # before the signal handlers
    chosen += [UnwrittenMetrics(), NonFinite(), StopSignals()]  # checked in this order
    if settings.parallel.drift_every is not None:  # DDP: the ranks' weights compared
        chosen.append(drift.DriftGuard(settings.parallel.drift_every))
    chosen += [ProgressBar(), Speed()]
    if trainer.profile:
        chosen.append(Profiler(trainer.profile))
    return Hooks(chosen)


def tracker(
    cfg: DictConfig, config: dict[str, Any], run_dir: Path
) -> Callable[[str | None], Any] | None:
    """What builds the tracker `cfg.logger` names (wandb) on the main process, given the id of
    the run it continues, with the resolved `config`; None for none (metrics.jsonl only)."""
    if cfg.logger._target_ is None:
        return None
    # Not recursive: the config's own _target_ entries are data for wandb, not objects to build.
    return lambda run_id: instantiate(
        cfg.logger,
        run_dir=run_dir,
        resolved_config=config,
        run_id=run_id,
        _recursive_=False,
        _convert_="all",
    )


def evaluate_weights(run: Run, model: nn.Module, weights: tuple) -> tuple[Fitted, float | None]:
    """train=false: the checkpoint's weights on the validation split, if there is one."""
    saved = weights[1].get("progress", {})
    fitted = Fitted(saved.get("epoch", 0), saved.get("step", 0), None)
    if not run.data.size("val"):
        return fitted, None
    at = {"step": fitted.step, "epoch": fitted.epoch}
    val = evaluate_and_log(run, model, "val", at, str(weights[0]))
    return fitted, val[run.settings.checkpoint.monitor]


def finish(run: Run, model: nn.Module, fitted: Fitted, pictures: bool) -> None:
    """The run's pictures; then every rank stops together if the storage refused a file of the
    run, and none tears the process group down while another still uses it."""
    unwritten = run.logger and run.logger.fault  # metrics.jsonl, refused by the storage
    # Every rank predicts: under FSDP a forward needs them all.
    shown = plots.predict(run.strategy.unwrap(model), run.data, run.task) if pictures else None
    if pictures and run.process.is_main and not unwritten:
        unwritten = storage.attempt(lambda: draw(run, shown))
    if unwritten := storage.agree(run.process, unwritten or None):
        kept = run.checkpointer and run.checkpointer.kept
        raise storage.stopped(unwritten, run.run_dir, fitted.step, kept or None)


def write_config(
    config: dict, run_dir: Path, process: Process, kept: tuple[Path, int] | None
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


def draw(run: Run, shown: plots.Predicted | None) -> None:
    """The run's pictures, into the run folder and to the tracker."""
    pictures = plots.draw(run.run_dir, shown, run.data)
    if run.logger:
        run.logger.log_images(pictures)
