"""The summary of a sweep: `summary.csv` in its folder, with each job's overrides, final test
accuracy and loss, wall time and status, best first; printed as a table when the sweep ends.

A Hydra callback (conf/config.yaml, hydra.callbacks). Each job leaves `job.json` in its own folder
when it ends, so the summary also covers jobs that launchers ran in other processes (submitit).
"""

from __future__ import annotations

import atexit
import csv
import json
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

FIELDS = ["job", "overrides", "test/acc", "test/loss", "wall_s", "status", "folder"]


class SweepSummary(Callback):
    printer = None  # the exit hook that prints the table if the sweep stops on a failure

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode.name != "MULTIRUN":
            return
        folder = Path(config.hydra.runtime.output_dir)
        evals = [m for m in _records(folder / "metrics.jsonl") if "test/acc" in m]
        job = {
            "job": config.hydra.job.num,
            "overrides": " ".join(job_return.overrides or []),
            "test/acc": evals[-1]["test/acc"] if evals else None,
            "test/loss": evals[-1]["test/loss"] if evals else None,
            "wall_s": round(time.monotonic() - self.started, 1),
            "status": job_return.status.name.lower(),
            "folder": str(folder),
        }
        (folder / "job.json").write_text(json.dumps(job))
        # Rewritten after every job: a sweep that stops on a failed job still has its summary,
        # and Hydra then skips on_multirun_end, so the table is printed on the way out instead.
        sweep_dir = Path(config.hydra.sweep.dir)
        _write(sweep_dir)
        if not self.printer:
            self.printer = atexit.register(_print, sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.printer:
            atexit.unregister(self.printer)
        _print(Path(config.hydra.sweep.dir))


def _print(sweep_dir: Path) -> None:
    jobs = _write(sweep_dir)
    lines = [f"{'acc':>7} {'loss':>8} {'wall s':>7} {'status':9} overrides"]
    for j in jobs:
        acc = f"{j['test/acc']:.4f}" if j["test/acc"] is not None else "-"
        loss = f"{j['test/loss']:.4f}" if j["test/loss"] is not None else "-"
        lines.append(f"{acc:>7} {loss:>8} {j['wall_s']:>7} {j['status']:9} {j['overrides']}")
    print(f"Sweep summary ({sweep_dir / 'summary.csv'}):\n" + "\n".join(lines), flush=True)


def _write(sweep_dir: Path) -> list[dict[str, Any]]:
    """summary.csv from the jobs' job.json files, best test accuracy first; the rows."""
    jobs = [json.loads(p.read_text()) for p in sweep_dir.glob("*/job.json")]
    jobs.sort(key=lambda j: (j["test/acc"] is None, -(j["test/acc"] or 0), j["job"]))
    with (sweep_dir / "summary.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, FIELDS)
        writer.writeheader()
        writer.writerows(jobs)
    return jobs


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
