"""Writing a run's files, and what a refused write tells the user.

A full disk, a used-up quota, a file-size limit, a read-only or a vanished folder are not bugs:
the run stops, on every rank together, with one message that names the file, says which
checkpoint is intact and gives the command that resumes. Files are written beside their final
name and renamed over it, so a refused or killed write leaves the previous file whole and no
partial one.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from src.errors import UserError

if TYPE_CHECKING:
    from src.distributed import Process

# What each refusal means, and what to do about it before resuming.
FULL = {
    errno.ENOSPC: ("the disk is full", "Free space on that disk"),
    errno.EDQUOT: ("the disk quota is used up", "Free space within your quota (or ask for more)"),
    errno.EFBIG: ("the file-size limit is reached", "Raise the limit (ulimit -f unlimited)"),
}
READ_ONLY = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission is denied",
    errno.EPERM: "permission is denied",
}
GONE = {errno.ENOENT, errno.ESTALE, errno.ENOTDIR}


class Fault(NamedTuple):
    """A write the storage refused: the file, the error number and the system's words for it.
    Plain values, so that ranks can gather it."""

    path: str
    errno: int
    strerror: str

    @classmethod
    def of(cls, err: OSError, path: Path | None = None) -> Fault | None:
        """The fault `err` is, writing `path` (else the file it names); None if it is not the
        storage's refusal but a bug."""
        known = err.errno in FULL or err.errno in READ_ONLY or err.errno in GONE
        return cls(str(path or err.filename), err.errno, err.strerror or "") if known else None


class StorageFull(UserError):
    """The storage refused a write of the run; nothing partial was left, and the message says
    what is intact and how to resume."""


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` with `write(file)`: into a partial file beside it, flushed to the disk, then
    renamed over `path`. On any failure the partial file is removed and `path` is as it was."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # network file systems report a full disk here, if not before
        os.replace(partial, path)
    except BaseException as err:
        with suppress(OSError):
            partial.unlink(missing_ok=True)
        refused = _os_error(err)
        if refused is None:
            raise
        refused.filename, refused.filename2 = str(path), None  # the file meant, not its partial
        raise refused from None


def _os_error(err: BaseException | None) -> OSError | None:
    """The OSError behind `err`: itself, or the one it was raised while handling (torch.save's
    writer raises a RuntimeError of its own when it closes a file whose write failed)."""
    while err is not None and not isinstance(err, OSError):
        err = err.__context__
    return err


def attempt(write: Callable[[], object], path: Path | None = None) -> Fault | None:
    """Run `write`; the storage's refusal of it as a Fault (of `path`, else the file the error
    names), None if it succeeded. Other errors are bugs and raise."""
    try:
        write()
    except OSError as err:
        if fault := Fault.of(err, path):
            return fault
        raise
    return None


def agree(process: Process, fault: Fault | None) -> Fault | None:
    """The first rank's fault, on every rank, so that all of them stop together (one collective,
    which is also a barrier)."""
    return next((f for f in process.all_gather_object(fault) if f), None)


def copy_atomically(source: Path, target: Path) -> None:
    """Copy `source` to `target` as `write_atomically` writes it."""
    with open(source, "rb") as file:
        write_atomically(target, lambda out: shutil.copyfileobj(file, out))


def stopped(
    fault: Fault, run_dir: Path, step: int | None, kept: tuple[Path, int] | None
) -> StorageFull:
    """The message a refused write stops the run with: what failed, what is `kept` (the last
    checkpoint written, and its step), and the command that resumes once the cause is gone."""
    at = "" if step is None else f" at step {step}"
    resume = f"run the same command with hydra.run.dir={run_dir}"
    if not run_dir.is_dir():
        from_ = f" from its checkpoints/last.pt (step {kept[1]})" if kept else ""
        return StorageFull(
            f"Stopped{at}: the run folder {run_dir} was deleted or moved during the run, so "
            f"{_within(Path(fault.path), run_dir)} could not be written. If it was moved, run the "
            f"same command with hydra.run.dir=<its new place> to resume{from_}; if it was "
            "deleted, start again."
        )
    if kept:
        intact = f"{_within(kept[0], run_dir)} from step {kept[1]} is intact"
        resume += " to resume"
    else:
        intact = "no checkpoint was written before it"
        resume += " to start again"
    if fault.errno in FULL:
        reason, fix = FULL[fault.errno]
        fix = f"{fix}, then {resume}"
    elif fault.errno in READ_ONLY:
        reason, folder = READ_ONLY[fault.errno], Path(fault.path).parent
        fix = f"Make {folder} writable, then {resume}"
        if kept:
            fix += f"; or continue elsewhere: resume={kept[0]} hydra.run.dir=<a writable folder>"
    else:
        reason, fix = "its folder is missing", f"Recreate {Path(fault.path).parent}, then {resume}"
    return StorageFull(
        f"Stopped{at}: {fault.path} could not be written: {reason} ({fault.strerror}). "
        f"Nothing partial is left, and {intact}. {fix}."
    )


def _within(path: Path, folder: Path) -> str:
    """`path` relative to `folder` if it lies inside it (checkpoints/last.pt), else whole."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)
