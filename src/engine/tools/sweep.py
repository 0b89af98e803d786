"""A sweep's `summary.csv` (a row per job, the best by `checkpoint.monitor` first), printed at the
end. A Hydra callback: each job leaves `job.json`, so jobs in other processes (submitit) count."""

from __future__ import annotations

import atexit
import csv
import json
import logging
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.engine.config import checkpoint_mode_of
from src.engine.core.context import Best
from src.engine.errors import UserError
from src.engine.logger import measured

log = logging.getLogger(__name__)

# summary.csv's columns: these, then the jobs' test metrics, then LAST.
FIRST = ["job", "overrides", "monitor", "best", "best_epoch"]
LAST = ["wall_s", "status", "folder"]


class SweepSummary(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode.name != "MULTIRUN":
            return
        try:  # the job's checkpoint.mode as training resolved it (a mode it refused: max)
            mode = checkpoint_mode_of(config) or "max"
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
