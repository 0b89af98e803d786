"""The main process's metrics: `metrics.jsonl`, and wandb, whose failures only warn."""

import errno
import json
import logging
import netrc
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from src.engine import storage
from src.engine.parallel import Process


class MetricsLogger(AbstractContextManager):
    """A JSON line per `log` appended to `metrics.jsonl` (after a resumed run's `history`), handed
    to the tracker; a refused line is taken back whole and kept as `fault`, then nothing written."""

    def __init__(self, run_dir: Path, tracker: Any | None = None, history: list[dict] = ()):
        self.path, self.tracker, self.file = run_dir / "metrics.jsonl", tracker, None
        lines = "".join(json.dumps(record) + "\n" for record in history).encode()
        self.fault = storage.attempt(lambda: self._start(lines), self.path)

    def _start(self, lines: bytes) -> None:
        storage.write_atomically(self.path, lambda file: file.write(lines))
        self.file = self.path.open("ab", buffering=0)  # each line reaches the file at once

    def log(self, metrics: dict[str, Any]) -> None:
        self.fault = self.fault or storage.attempt(lambda: self._append(metrics), self.path)
        if self.tracker is not None:
            self.tracker.log(metrics)

    def _append(self, metrics: dict[str, Any]) -> None:
        if not self.path.exists():  # the run folder was moved or deleted: the line would be lost
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.path))
        end, data = self.file.tell(), memoryview((json.dumps(metrics) + "\n").encode())
        try:
            while data:  # an unbuffered write may take part of the line
                data = data[self.file.write(data) :]
        except OSError:
            with suppress(OSError):  # no torn line: what was logged reads back whole
                os.ftruncate(self.file.fileno(), end)
            raise

    def log_images(self, paths: list[Path]) -> None:
        """Hand pictures of the run to the tracker (metrics.jsonl keeps no images)."""
        if self.tracker is not None:
            self.tracker.log_images(paths)

    def summary(self, values: dict[str, Any]) -> None:
        """The run's headline numbers, for the tracker's summary (metrics.jsonl has them logged)."""
        if self.tracker is not None:
            self.tracker.summary(values)

    def checkpoints(self, files: dict[str, list[Path]]) -> None:
        """Hand the run's checkpoints (`{alias: its files}`) to a tracker that keeps them."""
        if self.tracker is not None and hasattr(self.tracker, "checkpoints"):
            self.tracker.checkpoints(files)

    run_id = property(lambda self: getattr(self.tracker, "run_id", None))  # wandb's run id, if any

    def close(self, failed: bool = False) -> None:
        if self.file:
            self.file.close()
        if self.tracker is not None:
            self.tracker.finish(exit_code=1 if failed else 0)

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.close(failed=exc_type is not None)


class WandbTracker:
    """One wandb run (a resumed `run_id`'s continued), its files in the run folder: every metric
    plotted against the optimizer step, the `monitor` (name, max or min) summarised by its best
    value, and with `log_checkpoints` a completed run's best.pt and last.pt logged as artifacts."""

    def __init__(
        self,
        run_dir: Path,
        resolved_config: dict[str, Any],
        project: str,
        entity: str | None,
        name: str | None,
        group: str | None,
        tags: list[str],
        mode: str | None,
        init_timeout: float,
        job_type: str | None = None,
        log_checkpoints: bool = False,
        run_id: str | None = None,
        monitor: tuple[str, str] | None = None,
    ):
        import wandb  # imported only when wandb is used

        self.run, self.wandb, self.log_checkpoints = None, wandb, log_checkpoints
        mode = wandb_mode(mode, default_base_url=wandb.Settings().base_url)
        names = {"project": project, "entity": entity, "name": name, "group": group, "id": run_id}
        with self._warned("wandb did not start (%s); logging to metrics.jsonl only."):
            self.run = wandb.init(
                **names,
                job_type=job_type,
                tags=list(tags),
                config=resolved_config,
                dir=run_dir,
                mode=mode,
                resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=init_timeout),
            )
        if self.run is not None:
            with self._warned("wandb could not define the run's metrics (%s)."):
                # The x-axis of every chart: our step, logged as a metric (a resumed run logs
                # steps again from its checkpoint's, which wandb's own step would drop).
                self.run.define_metric("step")
                self.run.define_metric("*", step_metric="step")
                if monitor:  # the summary holds its best value and its last
                    self.run.define_metric(monitor[0], summary=f"{monitor[1]},last")

    @contextmanager
    def _warned(self, failed: str, finish: bool = False) -> Iterator[None]:
        """A failure inside: the warning `failed` (then `finish`); wandb never stops training."""
        try:
            yield
        except Exception as err:  # noqa: BLE001
            logging.getLogger(__name__).warning(failed, err)
            if finish:
                self.finish(exit_code=1)

    run_id = property(lambda self: None if self.run is None else self.run.id)

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            with self._warned("wandb.log failed (%s); now metrics.jsonl alone.", finish=True):
                self.run.log(dict(metrics))

    def log_images(self, paths: list[Path]) -> None:
        if self.run is not None:
            with self._warned("wandb could not log the pictures (%s)."):
                self.run.log({path.stem: self.wandb.Image(str(path)) for path in paths})

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            with self._warned("wandb could not update the run's summary (%s)."):
                self.run.summary.update(values)

    def checkpoints(self, files: dict[str, list[Path]]) -> None:
        """Each alias's files (the .pt file, a shards folder) as a version of the model artifact."""
        if self.run is None or not self.log_checkpoints:
            return
        with self._warned("wandb could not log the checkpoints (%s)."):
            for alias, paths in files.items():
                artifact = self.wandb.Artifact(f"model-{self.run.id}", type="model")
                for path in paths:
                    add = artifact.add_dir if path.is_dir() else artifact.add_file
                    add(str(path), name=path.name)
                self.run.log_artifact(artifact, aliases=[alias])

    def finish(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is not None:
            with self._warned("wandb.finish failed: %s"):
                run.finish(exit_code=exit_code)


def wandb_mode(mode: str | None, default_base_url: str) -> str:
    """`logger.mode`, else WANDB_MODE, else online with an API key, offline (no prompt) without."""
    if mode or os.environ.get("WANDB_MODE"):
        return mode or os.environ["WANDB_MODE"]
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or default_base_url).hostname
    path, key = os.environ.get("NETRC") or os.path.expanduser("~/.netrc"), None
    with suppress(OSError, netrc.NetrcParseError):  # no netrc file, or one it cannot read
        key = os.environ.get("WANDB_API_KEY") or netrc.netrc(path).authenticators(host)
    return "online" if key else "offline"


def open_logger(
    run_dir: Path, process: Process, resumed: tuple | None = None, tracker: Callable | None = None
) -> AbstractContextManager[MetricsLogger | None]:
    """The main process's logger (else None), continuing a `resumed` (path, checkpoint) run."""
    if not process.is_main:
        return nullcontext()
    if not resumed:
        return MetricsLogger(run_dir, tracker and tracker(None))
    path, state = resumed
    history = metrics_until(path.parent.parent / "metrics.jsonl", state["progress"]["step"])
    return MetricsLogger(run_dir, tracker and tracker(state.get("wandb_id")), history)


def metrics_until(path: Path, step: int) -> list[dict[str, Any]]:
    """Records of a `metrics.jsonl` to step `step`, not the test (each launch tests at its end)."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with suppress(json.JSONDecodeError):  # the last line of a run killed while writing it
            records.append(json.loads(line))
    return [r for r in records if r.get("step", 0) <= step and not logged(r, "test")]


def logged(record: dict[str, Any], split: str) -> dict[str, Any]:
    """What a record holds of `split` (train, val or test), by name: its `test/acc` as `acc`."""
    return {k.removeprefix(f"{split}/"): v for k, v in record.items() if k.startswith(f"{split}/")}


def measured(record: dict[str, Any], split: str) -> dict[str, float]:
    """The metrics (floats) of `split` in `record`, not its counts nor the tested weights' epoch."""
    return {name: v for name, v in logged(record, split).items() if isinstance(v, float)}
