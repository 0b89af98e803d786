"""Evaluation: a split's metrics, exact whatever the ranks and the batch size; the test, once."""

import logging
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from src.engine.core.context import Best, Run
from src.engine.core.task import float64_sum
from src.engine.errors import UserError
from src.engine.logger import measured

log = logging.getLogger(__name__)


class Fitted(NamedTuple):
    """Where training ended, and its best validation (None without a validation split);
    `unrecorded`: the file evaluated where it records no training (a bare state_dict)."""

    epoch: int
    step: int
    best: Best | None
    unrecorded: str | None = None


def evaluate_and_log(
    run: Run, model: nn.Module, split: str, record: dict[str, Any], about: str
) -> dict[str, Any]:
    """Evaluate on `split` (val or test); print the result after `about` (where training stands,
    which weights), and log it with `record` (its step, epoch, ...)."""
    metrics = evaluate(run, model, split)
    shown = (f"{split} {name} {value:.4f}" for name, value in measured(metrics, split).items())
    log.info("%s: %s", about, ", ".join(shown))
    if run.logger:
        run.logger.log({**record, **metrics})
    return metrics


def evaluate_weights(run: Run, model: nn.Module, weights: tuple) -> tuple[Fitted, float | None]:
    """train=false: the checkpoint's weights on the validation split, if there is one."""
    path, saved = weights[0], weights[1].get("progress")
    recorded = saved and "step" in saved  # a file of its own may hold an epoch alone
    fitted = (
        Fitted(saved["epoch"], saved["step"], None) if recorded else Fitted(0, 0, None, str(path))
    )
    if not run.data.size("val"):
        return fitted, None
    at = {"step": fitted.step, "epoch": fitted.epoch}
    val = evaluate_and_log(run, model, "val", at, str(path))
    return fitted, val[run.settings.checkpoint.monitor]


def test(run: Run, model: nn.Module, fitted: Fitted) -> dict[str, Any]:
    """The test split, once, after training: on best.pt's weights (`trainer.test_weights=best`,
    where a validation picked them), else on the weights training ended with."""
    epoch, step, best, unrecorded = fitted
    weights, weights_epoch = f"the weights after epoch {epoch} (step {step})", epoch
    if unrecorded:  # not untrained weights: the file's, whatever trained them
        weights = f"the weights of {unrecorded}, which records no training progress"
    if best and best.epoch is not None and run.trainer.test_weights == "best":
        run.checkpointer.load_best(model)
        weights = f"best.pt, the weights of epoch {best.epoch} ({best.monitor} {best.value:.4f})"
        weights_epoch = best.epoch
    record = {"step": step, "epoch": epoch, "test/weights_epoch": weights_epoch}
    metrics = evaluate_and_log(run, model, "test", record, f"Test on {weights}")
    if run.logger:  # the monitor's best value is the tracker's own (wandb's define_metric)
        chosen = {"best/epoch": best.epoch} if best else {}
        run.logger.summary({**metrics, **chosen, "test/weights_epoch": weights_epoch})
    return metrics


@torch.inference_mode()
def evaluate(run: Run, model: nn.Module, split: str) -> dict[str, Any]:
    """The task's metrics over the whole `split` (val or test): each batch's sums added up in
    float64 on the CPU, then over the ranks, and turned into metrics once."""
    # The config's callbacks decide the weights evaluated: an average's, say.
    with run.hooks.callbacks.evaluating(run, model, split):
        task, process = run.task, run.process
        model = run.strategy.evaluated(model)  # each rank its share: DDP's module, not its wrapper
        # Buffers (BatchNorm's running statistics) are updated by each rank's own share of the last
        # step: every rank takes rank 0's, as DDP does before each forward and the checkpoint saves.
        process.broadcast_tensors(model.buffers())
        model.eval()
        sums: dict[str, float] = {}
        # Where every forward is collective (FSDP), each rank runs as many as the one with the most.
        for inputs, targets in run.data.eval_batches(split, even=run.strategy.sharded):
            with run.autocast():
                outputs = model(inputs)
            batch = {"count": task.count(inputs, targets), **task.sums(outputs, inputs, targets)}
            for key, value in batch.items():
                sums[key] = sums.get(key, 0.0) + float64_sum(value)
        if process.in_group:  # a rank with no batch of this split knows none of the sums' names
            names = sorted({n for names in process.all_gather_object(sorted(sums)) for n in names})
            totals = process.sum_over_ranks([sums.get(n, 0.0) for n in names])
            sums = dict(zip(names, totals, strict=True))
        metrics = {f"{split}/{name}": value for name, value in task.metrics(sums).items()}
        if process.in_group:  # every rank decides with them: the best epoch, early stopping
            check_same_on_every_rank(process, metrics)
        return metrics


def check_same_on_every_rank(process: Any, metrics: dict[str, Any]) -> None:
    """Stop every rank at once where a metric differs between them: rank 0's alone would be
    logged, and the ranks split on the best epoch would wait on each other until the timeout."""
    ranks = process.all_gather_object(metrics)
    for name in dict.fromkeys(n for theirs in ranks for n in theirs):
        values = [theirs.get(name) for theirs in ranks]
        if not all(same(value, values[0]) for value in values):
            shown = ", ".join(f"rank {rank} {value}" for rank, value in enumerate(values))
            raise UserError(
                f"Stopped: {name} differs between the ranks ({shown}). The task's metrics(sums) "
                "must come from the sums summed over the ranks alone: a metric each rank computes "
                "from its own share (state kept in the task, a torchmetrics object with its sync "
                "off) differs. Return additive sums from sums(), or let torchmetrics sync "
                "(docs/training.md, the task).",
                every_rank=True,
            )


def same(value: Any, other: Any) -> bool:
    """Equal values; numbers from the same summed sums within float64's rounding (NaN to NaN)."""
    if isinstance(value, (int, float)) and isinstance(other, (int, float)):
        return math.isclose(value, other, rel_tol=1e-9) or math.isnan(value) and math.isnan(other)
    return value == other
