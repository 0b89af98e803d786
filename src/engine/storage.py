"""Writing a run's files, and what a refused write tells the user.

A full disk, a used-up quota, a file-size limit, a read-only or a vanished folder are not bugs:
the run stops, on every rank together, with one message that names the file, says which
checkpoint is intact and gives the command that resumes. Files are written beside their final
name and renamed over it, so a refused or killed write leaves the previous file whole and no
partial one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

from hydra.experimental.callback import Callback

from src.engine.errors import UserError

if TYPE_CHECKING:
    from src.engine.parallel import Process

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
LOCK = "run.lock"  # in the run folder while a run holds it: its process id and host

log = logging.getLogger(__name__)


class Fault(NamedTuple):
    """A write the storage refused: the file, the error number, the system's words for it, and
    whether the file's folder was still there. Plain values, decided where the write failed, so
    that ranks can gather it and every rank tells the same story."""

    path: str
    errno: int
    strerror: str
    folder_exists: bool = True

    @classmethod
    def of(cls, err: OSError, path: Path | None = None) -> Fault:
        """The fault `err` is, writing `path` (else the file it names)."""
        path = Path(path or err.filename or "?")
        return cls(str(path), err.errno or 0, err.strerror or str(err), path.parent.is_dir())


class StorageFull(UserError):
    """The storage refused a write of the run; nothing partial was left, and the message says
    what is intact and how to resume."""


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` with `write(file)`: into a partial file beside it, flushed to the disk, then
    renamed over `path`, and the rename flushed too. On any failure the partial file is removed
    and `path` is as it was. The folder is held open throughout, so a folder moved meanwhile gets
    the whole file, or nothing, where it now is."""
    # Its own partial file per process: two machines may write one file of a shared folder.
    partial, folder = f".{path.name}.{socket.gethostname()}.{os.getpid()}.partial", None
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with open(os.open(partial, flags, 0o666, dir_fd=folder), "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # network file systems report a full disk here, if not before
        os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)  # the rename, on the disk: a crash now leaves the new file, not none
    except BaseException as err:
        if folder is not None:
            with suppress(OSError):
                os.unlink(partial, dir_fd=folder)
        refused = _os_error(err)
        if refused is None:
            raise
        refused.filename, refused.filename2 = str(path), None  # the file meant, not its partial
        raise refused from None
    finally:
        if folder is not None:
            os.close(folder)


def _os_error(err: BaseException) -> OSError | None:
    """The OSError `err` is, or the one behind it: torch.save's writer raises a RuntimeError of
    its own when it closes a file whose write failed."""
    if isinstance(err, RuntimeError) and isinstance(err.__context__, OSError):
        return err.__context__
    return err if isinstance(err, OSError) else None


def copy_atomically(source: Path, target: Path) -> None:
    """Copy `source` to `target` as `write_atomically` writes it."""
    with open(source, "rb") as file:
        write_atomically(target, lambda out: shutil.copyfileobj(file, out))


def attempt(write: Callable[[], object], path: Path | None = None) -> Fault | None:
    """Run `write`; what the storage refused of it as a Fault (of `path`, else the file the error
    names), None if it succeeded. Any OSError counts (an NFS server's EIO too), so that a write
    of the main process never fails on it alone while the other ranks wait."""
    try:
        write()
    except OSError as err:
        return Fault.of(err, path)
    return None


def on_main(
    process: Process, write: Callable[[], object], path: Path | None = None
) -> Fault | None:
    """`write` on the main process; what the storage refused of it, on every rank (`attempt`,
    then `agree`: also a barrier)."""
    return agree(process, attempt(write, path) if process.is_main else None)


def agree(process: Process, fault: Fault | None) -> Fault | None:
    """The first rank's fault, on every rank, so that all of them stop together (one collective,
    which is also a barrier)."""
    return next((f for f in process.all_gather_object(fault) if f), None)


def stopped(
    fault: Fault, run_dir: Path, step: int | None, kept: tuple[Path, int] | None
) -> StorageFull:
    """The message a refused write stops the run with: what failed, what is `kept` (the last
    checkpoint written, and its step), and the command that resumes once the cause is gone."""
    at = "" if step is None else f" at step {step}"
    resume = f"run the same command with hydra.run.dir={run_dir}"
    path = Path(fault.path)
    if not fault.folder_exists and run_dir in (path.parent, path.parent.parent):
        from_ = f" from its {_within(kept[0], run_dir)} (step {kept[1]})" if kept else ""
        return StorageFull(
            f"Stopped{at}: the run folder {run_dir} was deleted or moved during the run, so "
            f"{_within(path, run_dir)} could not be written. If it was moved, run the same "
            f"command with hydra.run.dir=<its new place> to resume{from_}; if it was deleted, "
            "start again."
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
        reason = READ_ONLY[fault.errno]
        fix = f"Make {path.parent} writable, then {resume}"
        if kept:
            fix += f"; or continue elsewhere: resume={kept[0]} hydra.run.dir=<a writable folder>"
    elif fault.errno in GONE:
        reason = "it was deleted during the run" if fault.folder_exists else "its folder is gone"
        fix = f"Make sure nothing else deletes files in {run_dir}, then {resume}"
    else:
        reason, fix = (
            "the storage reported an error",
            f"Check the disk of {path.parent}, then {resume}",
        )
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


@contextlib.contextmanager
def held(run_dir: Path, process: Process) -> Iterator[None]:
    """Hold the run folder for this run: rank 0 writes `run.lock` (its process id and host) and
    removes it when the run ends, however it ends. A folder another living run holds is refused
    on every rank, with one sentence naming the holder; the lock of a run that died (SIGKILL, a
    lost machine) is taken over, as is the previous attempt's under a torchrun restart."""
    refusal = None
    if process.is_main:
        try:
            refusal = _take(run_dir / LOCK)
        except OSError as err:
            refusal = str(stopped(Fault.of(err, run_dir / LOCK), run_dir, None, None))
    if refusal := process.broadcast_object(refusal):
        raise UserError(refusal)
    try:
        yield
    finally:
        if process.is_main:
            with suppress(OSError):
                if json.loads((run_dir / LOCK).read_text()) == _holder():
                    (run_dir / LOCK).unlink()


def _holder() -> dict[str, object]:
    """Who holds a run folder: this process, its machine, its torchrun job (restarts keep it)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return {"pid": os.getpid(), "host": socket.gethostname(), "torchrun_job": job}


def _take(path: Path) -> str | None:
    """Create the lock `path` for this process; the sentence that refuses the folder if a living
    run holds it (None: taken)."""
    me = _holder()
    for _ in range(3):  # a stale lock removed, then created again (another run may win the race)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):  # removed meanwhile, or being written: look again
                continue
            if _alive(holder, me):
                return (
                    f"{path.parent} is in use by another run (process {holder.get('pid')} on "
                    f"{holder.get('host')}): give this run a folder of its own "
                    "(hydra.run.dir=...), or wait for that one to end. If it is no longer "
                    f"running, delete {path}."
                )
            log.warning(
                "%s was left by a run that ended without removing it (process %s on %s): this "
                "run takes the folder over",
                path,
                holder.get("pid"),
                holder.get("host"),
            )
            with suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as file:
            json.dump(me, file)
        return None
    return f"{path} keeps being taken by other runs: give this run a folder of its own."


def _alive(holder: dict, me: dict) -> bool:
    """Whether the run that wrote a lock may still be running: a process of this machine that
    exists, or any process of another machine (which this one cannot see), unless it was an
    earlier attempt of this same torchrun job (torchrun restarts a group only once it stopped)."""
    if me["torchrun_job"] and holder.get("torchrun_job") == me["torchrun_job"]:
        return False
    if holder.get("host") != me["host"]:
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True  # another user's process, or a lock this code did not write
    return True


def check_run_folder(folder: Path) -> None:
    """The run folder `hydra.run.dir` names can be made and written: a path through a file, or a
    folder on a read-only file system or without write permission, is one sentence naming it
    (Hydra's own attempt, a moment later, would fail with tracebacks)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(
            f"hydra.run.dir={folder} cannot be a folder: {existing} is a file. Choose another "
            "hydra.run.dir."
        )
    if not os.access(existing, os.W_OK):
        try:  # os.access passes root on a read-only file system; a statvfs flag says it
            read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        except OSError:
            read_only = False
        why = "the file system is read-only" if read_only else "permission is denied"
        raise UserError(
            f"hydra.run.dir={folder} cannot be written: {why} at {existing}. Choose a folder "
            "you can write to (hydra.run.dir=...), or make that one writable."
        )


class RunFolderCheck(Callback):
    """A Hydra callback (conf/config.yaml's hydra.callbacks): the run folder checked before Hydra
    makes it and writes its logs and .hydra/ files there.

    Hydra turns an exception of a callback into a warning and goes on (hydra/_internal/
    callbacks.py), so a folder that cannot be used ends the process here, with its sentence."""

    def on_run_start(self, config, **kwargs) -> None:  # noqa: ANN001 (Hydra's DictConfig)
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:  # interpolations resolve here as Hydra resolves them; one that needs Hydra's own
            folder = OmegaConf.select(config, "hydra.run.dir")  # state is left to Hydra
        except OmegaConfBaseException:
            return
        try:
            check_run_folder(Path(str(folder)).expanduser().absolute())
        except UserError as err:
            print(err, file=sys.stderr)
            raise SystemExit(1) from None
