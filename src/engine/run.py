"""One run, from a composed config to its metrics: the table of contents of the template.

`train(cfg)` sets up this process (alone, or one rank of a process group), builds the data, the
model and the optimizer, trains (validating after every epoch) and tests once. The config ends here
(and in `src/engine/build.py`): below, only typed settings and built objects travel. It is a module,
not part of `train.py`, so that a job's processes import it by name, however the job reached them
(submitit and other launchers pickle `train.py`'s functions by value).
"""

import logging
from pathlib import Path

from omegaconf import DictConfig

from src.engine import checkpoint, storage
from src.engine.build import build_model, build_parts, build_run, logged, read_settings
from src.engine.config import Settings
from src.engine.core.evaluate import evaluate_weights, test
from src.engine.core.loop import fit
from src.engine.errors import on_every_rank
from src.engine.guards import Interrupts
from src.engine.launch import shared_run_dir
from src.engine.parallel import teardown
from src.engine.tools import plots

log = logging.getLogger("train")


def train(
    cfg: DictConfig, run_dir: Path | None = None, settings: Settings | None = None
) -> float | None:
    """One run (or evaluation) in this process: the best validation value of `checkpoint.monitor`,
    what a sweeper optimises (None without validation); `run_dir` is Hydra's unless given."""
    with on_every_rank():  # under torchrun, one rank per machine tells a mistake found here
        settings = settings or read_settings(cfg)  # the config's values, checked before any work
        process = settings.parallel.setup(settings.device, settings.trainer)  # or a group's rank
    # Where a signal outside training (SIGTERM, Ctrl-C) finds the run, and what is kept.
    when = "before training; nothing was saved" if settings.train else "during the evaluation"
    try:
        with Interrupts(process, when) as interrupts:
            run_dir = shared_run_dir(process, run_dir)
            log.info("Run folder: %s", run_dir)
            if not settings.train:  # an evaluation writes records of its own
                storage.refuse_records(run_dir, process)
            with storage.held(run_dir, process):  # one run per folder
                resumed, weights = checkpoint.starting_point(settings, run_dir, process)
                if settings.train and not resumed:  # a new run: no earlier one's records lost
                    storage.refuse_fresh_start(run_dir, process)
                run = build_run(cfg, settings, process, run_dir)  # the data, checked
                model = build_model(cfg, run, weights)
                if settings.train:
                    parts, progress, run.checkpointer = build_parts(cfg, run, model, resumed)
                with logged(cfg, run, resumed) as run.logger:  # all checked: the run begins
                    if settings.train:
                        fitted = fit(run, parts, progress)
                        result = fitted.best and fitted.best.value
                        interrupts.when = (  # for a signal now
                            f"after training ended at step {fitted.step}, during the test; "
                            f"{run.checkpointer.holding()}"
                        )
                    else:  # train=false: the checkpoint's weights, on the validation split too
                        fitted, result = evaluate_weights(run, model, weights)
                    test(run, model, fitted)  # once, at the end
                    if run.logger and settings.train:  # logger.log_checkpoints: to the tracker
                        run.logger.checkpoints(run.checkpointer.files())
                    plots.finish(run, model, fitted.step, settings.config["plots"])
    except BaseException:
        storage.settle()  # refused before it began: its folder as it was (else nothing to do)
        raise
    finally:
        teardown()
    return result
