"""Where the main process's metrics go: `metrics.jsonl` in the run folder, and wandb when
`logger=wandb`. A tracker failure never stops training: one warning, then `metrics.jsonl` alone."""

from __future__ import annotations

import errno
import json
import logging
import netrc
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from src.engine import storage
from src.engine.parallel import Process

log = logging.getLogger(__name__)


class MetricsLogger(AbstractContextManager):
    """Appends one JSON line per `log` to `metrics.jsonl` (after a resumed run's `history`), and
    hands it to the tracker. A line the storage refuses is taken back whole and kept as `fault`,
    which training stops on where the ranks next meet; nothing more is written."""

    def __init__(self, run_dir: Path, tracker: Any | None = None, history: list[dict] = ()):
        self.path, self.tracker, self.file = run_dir / "metrics.jsonl", tracker, None
        lines = "".join(json.dumps(record) + "\n" for record in history).encode()
        self.fault = storage.attempt(lambda: self._start(lines), self.path)

    def _start(self, lines: bytes) -> None:
        storage.write_atomically(self.path, lambda file: file.write(lines))
        self.file = self.path.open("ab", buffering=0)  # each line reaches the file at once

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.fault:
            self.fault = storage.attempt(lambda: self._append(metrics), self.path)
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

    @property
    def run_id(self) -> str | None:
        """The tracker's id of this run (wandb's run id), if it has one."""
        return getattr(self.tracker, "run_id", None)

    def close(self, failed: bool = False) -> None:
        if self.file:
            self.file.close()
        if self.tracker is not None:
            self.tracker.finish(exit_code=1 if failed else 0)

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        self.close(failed=exc_type is not None)


class WandbTracker:
    """One wandb run with the resolved config, its files in the run folder; given a resumed run's
    `run_id`, it continues that run."""

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
        run_id: str | None = None,
    ):
        import wandb  # imported only when wandb is used

        self.run = None
        mode = wandb_mode(mode, default_base_url=wandb.Settings().base_url)
        try:
            self.run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                group=group,
                tags=list(tags),
                config=resolved_config,
                dir=run_dir,
                mode=mode,
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=init_timeout),
            )
        except Exception as err:  # noqa: BLE001 - wandb must never stop training
            log.warning("wandb did not start (%s); logging to metrics.jsonl only.", err)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is None:
            return
        step = metrics.get("step")
        try:
            self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        except Exception as err:  # noqa: BLE001
            log.warning("wandb.log failed (%s); logging to metrics.jsonl only from now on.", err)
            self.finish(exit_code=1)

    def log_images(self, paths: list[Path]) -> None:
        if self.run is None:
            return
        import wandb

        try:
            self.run.log({path.stem: wandb.Image(str(path)) for path in paths})
        except Exception as err:  # noqa: BLE001
            log.warning("wandb could not log the pictures (%s).", err)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update(values)
        except Exception as err:  # noqa: BLE001
            log.warning("wandb could not update the run's summary (%s).", err)

    def finish(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as err:  # noqa: BLE001
            log.warning("wandb.finish failed: %s", err)


def wandb_mode(mode: str | None, default_base_url: str) -> str:
    """`logger.mode` if set, else WANDB_MODE, else online with an API key and offline without (which
    keeps wandb from prompting for one)."""
    if mode or os.environ.get("WANDB_MODE"):
        return mode or os.environ["WANDB_MODE"]
    return "online" if _has_api_key(default_base_url) else "offline"


def _has_api_key(default_base_url: str) -> bool:
    """An API key in WANDB_API_KEY or in the netrc file, where `wandb login` saves it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or default_base_url).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_logger(
    run_dir: Path,
    process: Process,
    resumed: tuple[Path, dict[str, Any]] | None = None,
    tracker: Callable[[str | None], Any] | None = None,
) -> AbstractContextManager[MetricsLogger | None]:
    """The main process's logger (None on other ranks), with the tracker `tracker(run_id)` builds.
    A context manager: the tracker is finished on every exit. A run `resumed` from (checkpoint
    path, checkpoint) continues its metrics and its wandb run."""
    if not process.is_main:
        return nullcontext()
    history, run_id = [], None
    if resumed:
        path, state = resumed
        history = metrics_until(path.parent.parent / "metrics.jsonl", state["progress"]["step"])
        run_id = state.get("wandb_id")
    return MetricsLogger(run_dir, tracker and tracker(run_id), history)


def metrics_until(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` (if any) up to optimizer step `step`: a resumed run logs
    again what came after, and the test, which every launch evaluates once at its end."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with suppress(json.JSONDecodeError):  # the last line of a run killed while writing it
            records.append(json.loads(line))
    return [r for r in records if r.get("step", 0) <= step and not logged(r, "test")]


def logged(record: dict[str, Any], split: str) -> dict[str, Any]:
    """What a record holds of `split` (train, val or test), by name: its `test/acc` as `acc`."""
    prefix = f"{split}/"
    return {key.removeprefix(prefix): v for key, v in record.items() if key.startswith(prefix)}


def measured(record: dict[str, Any], split: str) -> dict[str, float]:
    """The metrics of `split` in `record`, without its integers: a count (`correct`) and the
    tested weights' epoch are whole numbers, a metric (`loss`, `acc`, `mae`) is a float."""
    return {name: v for name, v in logged(record, split).items() if isinstance(v, float)}
