"""The training loop: `fit` runs the epochs, `train_epoch` one pass over the training batches.

The same code for every parallel mode. The guards and the tools are hooks the loop calls at its
named points (`src/engine/core/hooks.py`); what is saved and when is the checkpointer's to decide.
"""

from __future__ import annotations

import logging

from src.engine.core.context import Run
from src.engine.core.evaluate import Fitted, evaluate_and_log
from src.engine.core.state import Parts, Progress
from src.engine.core.step import train_step

log = logging.getLogger(__name__)


def fit(run: Run, parts: Parts, progress: Progress) -> Fitted:
    """Train for `trainer.epochs` epochs (or `trainer.max_steps` steps, or until early stopping)
    from where `progress` stands, validating after each epoch (with a validation split) and
    saving checkpoints. The test split is not touched here."""
    settings, saver, hooks = run.settings, run.checkpointer, run.hooks
    if why := why_finished(progress, run):
        log.info("Nothing left to train: the checkpoint is at the end of this run (%s).", why)
        return Fitted(progress.ended_in, progress.step, progress.best)
    with hooks.active(run, parts, progress):
        while not (why := why_finished(progress, run)):
            hooks.epoch_started(run, progress)
            train_epoch(run, parts, progress)
            hooks.epoch_ended(run, progress)
            hooks.check(run, progress, weights=parts.model)  # nothing bad is validated or saved
            if settings.validates:
                val = evaluate_and_log(run, parts.model, "val", progress.record, progress.about)
                progress.metrics = val
            hooks.check(run, progress)  # metrics.jsonl took those lines: checked before a save
            best = progress.best  # None without a validation split
            improved = bool(best and best.update(progress.metrics, progress.epoch))
            saver.epoch_done(progress.step, improved)
            if stopping := hooks.stopping(run):
                stopping.stop(run, progress)
            if progress.epoch_step == run.data.steps_per_epoch:
                progress.epoch, progress.epoch_step = progress.epoch + 1, 0
    log.info("Training ended: %s.", why)
    return Fitted(progress.ended_in, progress.step, progress.best)


def why_finished(progress: Progress, run: Run) -> str:
    """Why training is over (all epochs done, `max_steps` reached, stopped early), or "" if not."""
    trainer, best, patience = run.trainer, progress.best, run.trainer.early_stopping_patience
    if (steps := trainer.max_steps) is not None and progress.step >= steps:
        return f"trainer.max_steps={steps} reached: {progress.step} optimizer steps done"
    if best is not None and patience is not None and best.stale >= patience:
        return (
            f"early stopping: {best.monitor} has not improved for {best.stale} validations; the "
            f"best, {best.value:.4f}, was at epoch {best.epoch}"
        )
    return f"{trainer.epochs} epoch(s) done" if progress.epoch > trainer.epochs else ""


def train_epoch(run: Run, parts: Parts, progress: Progress) -> None:
    """One pass over the training batches (what is left of it, after a resume), or up to
    `max_steps` or a stop signal."""
    trainer, data, hooks = run.trainer, run.data, run.hooks
    parts.model.train()
    for batch in data.train_batches(progress.epoch, progress.epoch_step):
        logs = (progress.step + 1) % trainer.log_every_n_steps == 0
        loss, grad_norm = train_step(run, parts, batch, measure_norm=logs)
        lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step used
        parts.schedule.after_step()
        progress.step, progress.epoch_step = progress.step + 1, progress.epoch_step + 1
        hooks.after_step(run, progress, loss)
        if logs:  # the ranks agree on the loss (and on the guards' checks), and it is logged
            mean = hooks.check(run, progress, loss.item())
            if run.logger:
                norm = {} if grad_norm is None else {"train/grad_norm": grad_norm.item()}
                run.logger.log({**progress.record, "train/loss": mean, "lr": lr, **norm})
        if progress.step == trainer.max_steps or progress.epoch_step == data.steps_per_epoch:
            break  # the epoch's end validates and saves
        if stopping := hooks.stopping(run):
            save(run, parts, progress)
            stopping.stop(run, progress)
        if run.checkpointer.due(progress.step):
            save(run, parts, progress)
    if progress.epoch_step == data.steps_per_epoch:
        parts.schedule.after_epoch()


def save(run: Run, parts: Parts, progress: Progress) -> None:
    """`last.pt` now, once the ranks agree that the losses and the weights are sound."""
    run.hooks.check(run, progress, weights=parts.model)
    run.checkpointer.save(progress.step)
