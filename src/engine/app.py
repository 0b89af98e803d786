"""The engine from a command line: `main()` is the whole of train.py, and of a script of your own
wherever the engine is installed (`pip install -e .`, or a wheel). Hydra composes the template's
config (conf/, which a wheel holds as src/conf) with a folder of yours, and each job runs in this
process, as a rank under torchrun, or in the processes it starts (ddp or fsdp without torchrun).

`train(cfg)` is one run, top to bottom: it sets up this process (alone, or one rank of a process
group), builds the data, the model and the optimizer, trains (validating after every epoch) and
tests once. The config ends here (and in `src/engine/build.py`): below, only typed settings and
built objects travel. It is a module's function, not train.py's, so that a job's processes import
it by name, however the job reached them (submitit and other launchers pickle `train.py`'s
functions by value).

`SweepSummary` is the Hydra callback that writes a sweep's `summary.csv` (a row per job, the
best by `checkpoint.monitor` first) and prints it at the end: each job leaves `job.json`, so jobs
in other processes (submitit) count."""

import atexit
import csv
import json
import logging
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.engine import checkpoint, launch, storage
from src.engine.build import build_model, build_parts, build_run, logged, read_settings
from src.engine.config import Settings, check_command_line, direction
from src.engine.core.context import Best
from src.engine.core.evaluate import evaluate_weights, test
from src.engine.core.loop import fit
from src.engine.data import check_shares
from src.engine.errors import UserError, on_every_rank
from src.engine.guards import Interrupts
from src.engine.launch import shared_run_dir
from src.engine.logger import measured
from src.engine.parallel import teardown
from src.engine.tools import equivalence, plots

log = logging.getLogger("train")

PACKAGE = Path(__file__).resolve().parents[1]  # src/
# The template's conf/: inside the package where a wheel installed it (setup.py maps it there),
# else beside it (a checkout, and `pip install -e .`, which uses the checkout's files).
CONFIG = PACKAGE / "conf" if (PACKAGE / "conf").is_dir() else PACKAGE.parent / "conf"


def main(config_dir: str | Path | None = None, config_name: str = "config") -> None:
    """Run the command line's job (Hydra's overrides; -m for a sweep) on the template's config.
    `config_dir`, a folder of yours (relative to the script's), is searched after the template's,
    as Hydra's --config-dir is: a file there adds a preset to a group (model/mine.yaml, chosen by
    model=mine), or, named by `config_name`, is the primary config, which may start from the
    template's (`defaults: [config, _self_]`)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # A process parallel=ddp started, importing the script: it would start its own.
        sys.exit(
            "main() ran again in each process that parallel=ddp (or fsdp) started, which import "
            'your script: call it under `if __name__ == "__main__":`, as train.py does.'
        )
    script = Path(sys.argv[0]).resolve()  # train.py, or yours (not one: python -c, a command)
    folder, name = (script.parent, script.stem) if script.suffix == ".py" else (Path.cwd(), "train")
    # The script's folder anchors data/ and outputs/ (paths.root_dir), wherever it is started
    # from, and processes started for this run (submitit's SLURM jobs) import from it: src/ in a
    # checkout, a fork's own modules beside its script.
    os.environ.setdefault("PROJECT_ROOT", str(folder))
    paths = [str(folder), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    # cuBLAS reads this at its first call only, so a deterministic job after another in the same
    # process (a sweep) needs it set now; it costs about 24 MiB of GPU memory, no speed.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args = launch.hydra_argv(sys.argv)[1:]
    if said := check_command_line(args):  # a value of the wrong type: one sentence, not Hydra's 5
        sys.exit(said if os.environ.get("LOCAL_RANK", "0") == "0" else 1)  # once per machine
    # The log is named for the script (train.log), as Hydra names it for a function of its own:
    # before the command line's first override (argparse takes them in one run: `-m a=1,2` stays
    # one), so that one of the command line's own, read later, wins over it.
    given = get_args_parser().parse_known_args(args)[0].overrides
    args.insert(
        args.index(given[0]) if given else 0, "hydra.job.name=" + re.sub(r"[^\w.-]", "_", name)
    )
    if config_dir is not None:
        args.insert(0, f"--config-dir={own_folder(folder / config_dir)}")
    sys.argv = [sys.argv[0], *args]
    hydra.main(version_base="1.3", config_path=str(CONFIG), config_name=config_name)(job)()
    if launch.under_torchrun():  # on failure, Hydra exited non-zero from inside
        launch.exit_worker()


def job(cfg: DictConfig) -> float | None:
    """One job (each of a sweep's): the value of `checkpoint.monitor` a sweeper optimises."""
    if (cfg.debug or {}).get("equivalence"):  # debug=equivalence: compare, don't train
        return equivalence.check(cfg)
    if launch.under_torchrun():  # a worker: failures go to torchrun's error file
        return launch.run_worker(train, cfg)
    settings = read_settings(cfg)  # the config's values checked before any work
    parallel = settings.parallel
    # ddp, fsdp, and no launcher (torchrun's variables) started this one: the processes start here
    if parallel.in_group and not any(v in os.environ for v in launch.TORCHRUN_VARIABLES):
        check_shares(cfg.data.batch_size, nproc := parallel.processes(cfg.device))  # before them
        return launch.start_workers(train, cfg, nproc)
    return train(cfg, settings=settings)


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
                    plots.finish(run, model, fitted.step, cfg.plots)
    except BaseException:
        storage.settle()  # refused before it began: its folder as it was (else nothing to do)
        raise
    finally:
        teardown()
    return result


def own_folder(folder: Path) -> Path:
    """`folder`, refused where a file of it has the name of one of the template's, which Hydra,
    reading the template's first, would take instead of it without a word."""
    for path in sorted(folder.rglob("*.yaml")):
        if (CONFIG / path.relative_to(folder)).is_file():
            sys.exit(
                f"{path} is never read: the template's conf/ has a file of that name, which Hydra "
                "reads first. Give yours a name of its own (model/mine.yaml, chosen by model=mine)."
            )
    return folder


# summary.csv's columns: these, then the jobs' test metrics, then LAST.
FIRST = ["job", "overrides", "monitor", "best", "best_epoch"]
LAST = ["wall_s", "status", "folder"]


class SweepSummary(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode.name != "MULTIRUN":
            return
        try:  # the job's checkpoint.mode as training resolved it (none, or one it refused: max)
            mode = direction(_root_=config)
        except UserError:
            mode = "max"
        # The same choice as training's best.pt, made again from the validations it logged.
        best = Best(config.checkpoint.monitor, mode)
        folder = Path(config.hydra.runtime.output_dir)
        metrics = folder / "metrics.jsonl"
        # What its test logged; a job stopped before it has the table's two, empty.
        test = dict.fromkeys([f"test/{best.monitor.removeprefix('val/')}", "test/loss"])
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
            record = json.loads(line)
            if best.monitor in record:
                best.update(record, record["epoch"])
            test.update({f"test/{name}": value for name, value in measured(record, "test").items()})
        job = {"job": config.hydra.job.num, "overrides": " ".join(job_return.overrides or [])}
        job |= {"monitor": best.monitor, "best": best.value, "best_epoch": best.epoch}
        job |= {"mode": best.mode, **test, "wall_s": round(time.monotonic() - self.started, 1)}
        job |= {"status": job_return.status.name.lower(), "folder": str(folder)}
        failure = job_return._return_value  # noqa: SLF001 - a failed job's exception, no getter
        if job_return.status.name == "FAILED" and failure is not None:
            job["cause"] = str(failure)
            log.error("Job %d (%s) stopped: %s", job["job"], job["overrides"], job["cause"])
        (folder / "job.json").write_text(json.dumps(job))
        # Rewritten after every job: a sweep that stops on a failed job still has its summary,
        # and Hydra then skips on_multirun_end, so the table is printed on the way out instead.
        _write(Path(config.hydra.sweep.dir))
        atexit.unregister(_print)  # registered once, however many jobs end in this process
        atexit.register(_print, Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(_print)  # if a job registered it
        _print(Path(config.hydra.sweep.dir))


def _print(sweep_dir: Path) -> None:
    """The table: each job's best value of its monitor, and the test value of that metric."""
    jobs = _write(sweep_dir)
    tested = "test " + "/".join(sorted({j["monitor"].removeprefix("val/") for j in jobs}))
    rows = [("best", "monitor", "epoch", tested, "wall s", "status", "overrides")]
    for j in jobs:
        value = j.get("test/" + j["monitor"].removeprefix("val/"))
        best, test = (f"{v:.4f}" if v is not None else "-" for v in (j["best"], value))
        epoch = j["best_epoch"] if j["best_epoch"] is not None else "-"
        rows.append((best, j["monitor"], epoch, test, j["wall_s"], j["status"], j["overrides"]))
    width = max(8, len(tested))
    lines = ("{:>7} {:8} {:>5} {:>{w}} {:>7} {:9} {}".format(*row, w=width) for row in rows)
    print(f"Sweep summary ({sweep_dir / 'summary.csv'}):\n" + "\n".join(lines), flush=True)


def _write(sweep_dir: Path) -> list[dict[str, Any]]:
    """summary.csv from the jobs' job.json files, the best by their monitor first; the rows."""
    jobs = sorted((json.loads(p.read_text()) for p in sweep_dir.glob("*/job.json")), key=_rank)
    # Every test metric any job logged (jobs of one sweep may run different tasks), the loss last.
    tests = {key for job in jobs for key in job if key.startswith("test/")}
    tests = sorted(tests, key=lambda key: (key == "test/loss", key))
    with (sweep_dir / "summary.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, [*FIRST, *tests, *LAST], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(jobs)
    return jobs


def _rank(job: dict[str, Any]) -> tuple:
    """Jobs with a best value first, the better first (by their mode); the rest in job order."""
    best, sign = job["best"], -1 if job["mode"] == "max" else 1
    return (best is None, 0.0 if best is None else sign * best, job["job"])
