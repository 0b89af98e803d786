"""One run, from a composed config to its metrics: the table of contents of the template.

`train(cfg)` sets up this process (alone, or one rank of a process group), builds the data, the
model and the optimizer, trains (validating after every epoch) and evaluates the test split once.
It is the composition root: the config ends here (with `src/engine/build.py`), and below it only
typed settings and built objects travel. It lives in an importable module, not in `train.py`, so
that the processes started for a job import it by name, however the job reached its process
(submitit and other launchers pickle `train.py`'s functions by value).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig
from torch import nn

from src.engine import checkpoint, storage
from src.engine.build import (
    build_model,
    build_parts,
    build_run,
    checkpointer,
    logged,
    read_settings,
)
from src.engine.core.context import Run
from src.engine.core.evaluate import Fitted, evaluate_weights, test
from src.engine.core.loop import fit
from src.engine.errors import on_every_rank
from src.engine.guards.signals import during_the_test, interrupted, signals_interrupt
from src.engine.launch import shared_run_dir
from src.engine.parallel import teardown
from src.engine.tools import plots

log = logging.getLogger("train")


def train(cfg: DictConfig, run_dir: Path | None = None) -> float | None:
    """One training run (or evaluation) in this process: alone, or one rank of a process group.

    Returns the best validation value of `checkpoint.monitor` (what a sweeper optimises), or
    None without a validation split. `run_dir` defaults to the folder Hydra made for the run.
    """
    with on_every_rank():  # under torchrun, one rank per machine tells a mistake found here
        settings = read_settings(cfg)  # the config's values, checked before any work
        process = settings.parallel.setup(settings.device, settings.trainer)  # or a group's rank
    # Where a signal outside training (SIGTERM, Ctrl-C) finds the run, and what is kept.
    when = "before training; nothing was saved" if settings.train else "during the evaluation"
    try:
        run_dir = shared_run_dir(process, run_dir)
        log.info("Run folder: %s", run_dir)
        with storage.held(run_dir, process), signals_interrupt():  # one run per folder
            resumed, weights = checkpoint.starting_point(settings, run_dir, process)
            with logged(cfg, settings, run_dir, process, resumed) as logger:
                run = build_run(cfg, settings, process, logger, run_dir)
                model = build_model(cfg, run, weights)
                if settings.train:
                    parts, progress, saved = build_parts(cfg, run, model, resumed and resumed[1])
                    run.checkpointer = checkpointer(run, saved, resumed)
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


def draw(run: Run, shown: plots.Predicted | None) -> None:
    """The run's pictures, into the run folder and to the tracker."""
    pictures = plots.draw(run.run_dir, shown, run.data)
    if run.logger:
        run.logger.log_images(pictures)
