"""Writing a run's files atomically: a refused or killed write leaves the old file whole, no partial
one. A refusal (full disk or quota, file-size limit, read-only or vanished folder) is no bug: all
ranks stop with one message naming the file, the intact checkpoint and the command that resumes."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, NamedTuple

from filelock import FileLock, Timeout
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from src.engine.errors import UserError
from src.engine.parallel import Process

FULL = {  # what each refusal means, and what to do about it before resuming
    errno.ENOSPC: ("the disk is full", "Free space on that disk"),
    errno.EDQUOT: ("the disk quota is used up", "Free space within your quota (or ask for more)"),
    errno.EFBIG: ("the file-size limit is reached", "Raise the limit (ulimit -f unlimited)"),
}
DENIED = "permission is denied"
READ_ONLY = {errno.EROFS: "the file system is read-only", errno.EACCES: DENIED, errno.EPERM: DENIED}
GONE = {errno.ENOENT, errno.ESTALE, errno.ENOTDIR}
LOCK = "run.lock"  # in the run folder while a run holds it (a kernel lock): its process id, host
HOLDS, REFUSED = "TRAIN_HOLDS", "TRAIN_REFUSED"  # the run folder held, or refused, in this run
_locks: dict[str, FileLock] = {}  # the run folders this process holds
PENDING = "run.pending"  # in the run folder: Hydra's .hydra/ files, until the run is admitted
_begun: dict[str, Any] = {}  # the run folder this process took before Hydra wrote there


class Fault(NamedTuple):
    """A refused write in plain values, decided where it failed, for ranks to gather and agree."""

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
    """The storage refused a write; the message says what is intact and how to resume."""


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` by `write(file)` into this process's partial file beside it (machines may share
    a folder), flushed, then renamed over it: a moved folder, held open, gets all of it or none.
    The partial files of `path` that a writer killed mid-write left (its process gone from this
    host) are removed first; another host's, or a living writer's, stay."""
    host, folder = socket.gethostname(), None
    partial = f".{path.name}.{host}.{os.getpid()}.partial"
    stale = re.compile(rf"\.{re.escape(path.name)}\.{re.escape(host)}\.(\d+)\.partial")
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        for entry in os.listdir(folder):
            if (match := stale.fullmatch(entry)) and not alive(int(match[1])):
                with suppress(OSError):  # removed meanwhile by another run's save
                    os.unlink(entry, dir_fd=folder)
        with open(partial, "wb", opener=lambda p, f: os.open(p, f, 0o666, dir_fd=folder)) as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())  # network file systems report a full disk here, if not before
        os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)  # the rename, on the disk: a crash now leaves the new file, not none
    except BaseException as err:
        # torch.save's writer raises a RuntimeError of its own closing a file whose write failed
        refused = err.__context__ if isinstance(err, RuntimeError) else err
        if not isinstance(refused, OSError):
            raise
        refused.filename, refused.filename2 = str(path), None  # the file meant, not its partial
        raise refused from None
    finally:
        if folder is not None:
            with suppress(OSError):  # a failed write's partial file (renamed, if it succeeded)
                os.unlink(partial, dir_fd=folder)
            os.close(folder)


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def copy_atomically(source: Path, target: Path) -> None:
    """Copy `source` to `target` as `write_atomically` writes it."""
    with open(source, "rb") as file:
        write_atomically(target, lambda out: shutil.copyfileobj(file, out))


def attempt(write: Callable[[], Any], path: Path | None = None) -> Fault | None:
    """Run `write`; what the storage refused of it (of `path`, else the file named), or None. Any
    OSError counts (an NFS EIO too): the main process must not fail alone while the others wait."""
    try:
        write()
    except OSError as err:
        return Fault.of(err, path)
    return None


def on_main(process: Process, write: Callable[[], Any], path: Path | None = None) -> Fault | None:
    """`write` on the main process; what the storage refused of it, on every rank (a barrier)."""
    return agree(process, attempt(write, path) if process.is_main else None)


def agree(process: Process, fault: Any) -> Any:
    """The first rank's fault (or message), on every rank, so all stop together (a barrier)."""
    return next((f for f in process.all_gather_object(fault) if f), None)


def stop_together(
    process: Process, fault: Fault | None, run_dir: Path, step: int | None, kept: tuple | None
) -> None:
    """Every rank stops, with `stopped`'s message, if the storage refused one rank a file."""
    message = fault and str(stopped(fault, run_dir, step, kept))
    if told := agree(process, message):
        raise StorageFull(told)


def stopped(fault: Fault, run_dir: Path, step: int | None, kept: tuple | None) -> StorageFull:
    """The stop message: what failed, what is `kept` (last checkpoint, step), how to resume."""
    at = "" if step is None else f" at step {step}"
    path = Path(fault.path)
    last = kept and (kept[0].relative_to(run_dir) if kept[0].is_relative_to(run_dir) else kept[0])
    if not fault.folder_exists and run_dir in (path.parent, path.parent.parent):
        from_ = f" from its {last} (step {kept[1]})" if kept else ""
        return StorageFull(
            f"Stopped{at}: the run folder {run_dir} was deleted or moved during the run, so "
            f"{path.relative_to(run_dir)} could not be written. If it was moved, run the same "
            f"command with hydra.run.dir=<its new place> to resume{from_}; if it was deleted, "
            "start again."
        )
    intact = f"{last} from step {kept[1]} is intact" if kept else None
    reason, fix = reason_and_fix(fault, run_dir)
    newer = kept and kept[0].name != "last.pt"  # best.pt, written before its copy was refused
    fix += f", then run the same command with hydra.run.dir={run_dir}"
    fix += f" resume={kept[0]} to resume" if newer else " to resume" if kept else " to start again"
    if kept and fault.errno in READ_ONLY:
        fix += f"; or continue elsewhere: resume={kept[0]} hydra.run.dir=<a writable folder>"
    return StorageFull(
        f"Stopped{at}: {fault.path} could not be written: {reason} ({fault.strerror}). "
        f"Nothing partial is left, and {intact or 'no checkpoint was written before it'}. {fix}."
    )


def reason_and_fix(fault: Fault, run_dir: Path) -> tuple[str, str]:
    """Why the storage refused the file of `fault`, and what to do before trying again."""
    if fault.errno in FULL:
        return FULL[fault.errno]
    if fault.errno in READ_ONLY:
        return READ_ONLY[fault.errno], f"Make {Path(fault.path).parent} writable"
    if fault.errno in GONE:
        reason = "it was deleted during the run" if fault.folder_exists else "its folder is gone"
        return reason, f"Make sure nothing else deletes files in {run_dir}"
    return "the storage reported an error", f"Check the disk of {Path(fault.path).parent}"


def refuse_records(run_dir: Path, process: Process) -> None:
    """Refuse an evaluation (train=false) the folder of a training run, whose records it would
    replace with its own."""
    if process.broadcast_object(process.is_main and trained_in(run_dir)):
        raise UserError(
            f"{run_dir} holds a run's records (metrics.jsonl, config_resolved.yaml, .hydra/), "
            "which an evaluation (train=false) would replace with its own: give it a folder of "
            "its own (hydra.run.dir=...); ckpt_path can stay where it is."
        )


def refuse_fresh_start(run_dir: Path, process: Process) -> None:
    """Refuse a training run that would start afresh (no last.pt to resume) in the folder of an
    earlier run, whose records it would replace with its own: its checkpoints, and the metrics of
    a run that ended (one stopped before its first checkpoint may start again)."""
    best, found = run_dir / "checkpoints" / "best.pt", None
    if process.is_main:
        records = sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("checkpoints/[!.]*"))
        with suppress(OSError), open(run_dir / "metrics.jsonl") as metrics:
            if any('"test/' in line for line in metrics):  # its test: it ended
                records.append("metrics.jsonl")
        found = records and (records, best.exists())
    if found := process.broadcast_object(found):
        records, has_best = found
        ways = f"run the same command with resume={best} to continue from its best epoch, or "
        raise UserError(
            f"{run_dir} holds an earlier run's {' and '.join(records)} but no checkpoints/last.pt "
            f"to resume from, which a new run would replace: {ways if has_best else ''}"
            "give this run a folder of its own (hydra.run.dir=...)."
        )


@contextmanager
def held(run_dir: Path, process: Process) -> Iterator[None]:
    """Hold the run folder for the run (rank 0's lock, taken before Hydra wrote there, else here;
    a self-launched worker's by the process that started it): refused on every rank where another
    run holds it."""
    refusal = None
    if process.is_main and os.environ.get(HOLDS) != str(run_dir):  # not held before Hydra ran
        try:
            refusal = os.environ.get(REFUSED) or take(run_dir)
        except OSError as err:
            refusal = str(stopped(Fault.of(err, run_dir / LOCK), run_dir, None, None))
    if refusal := process.broadcast_object(refusal):
        raise UserError(refusal)
    try:
        yield
    finally:
        let_go(run_dir)


def take(folder: Path) -> str | None:
    """Take `folder`'s lock, a kernel lock that dies with this process, until `let_go`; else the
    sentence refusing the folder, which the holder's process id and host (in the file) name."""
    me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
    lock = FileLock(folder / LOCK, on_acquired=lambda fd: os.ftruncate(fd, os.pwrite(fd, me, 0)))
    existed = (folder / LOCK).exists()
    try:
        lock.acquire(blocking=False)
    except Timeout:
        holder = {}
        with suppress(OSError, ValueError):  # being written: unnamed
            holder = json.loads((folder / LOCK).read_text())
        return (
            f"{folder} is in use by another run (process {holder.get('pid')} on "
            f"{holder.get('host')}): give this run a folder of its own (hydra.run.dir=...), or "
            f"wait for that one to end. If it is no longer running, delete {folder / LOCK}."
        )
    except OSError as err:  # its holder not written (a full disk): named, the file made removed
        if not existed:
            (folder / LOCK).unlink(missing_ok=True)
        err.filename = str(folder / LOCK)
        raise
    _locks[str(folder)] = lock
    os.environ[HOLDS] = str(folder)  # for the processes this one starts
    return None


def let_go(folder: Path) -> None:
    """Give `folder`'s lock back, if this process holds it: the file removed first (a run that
    opened it meanwhile does not get it: filelock checks that the file is still there)."""
    if lock := _locks.pop(str(folder), None):
        (folder / LOCK).unlink(missing_ok=True)
        lock.release()
        os.environ.pop(HOLDS, None)


def trained_in(folder: Path) -> bool:
    """Whether `folder` holds a training run's records (an evaluation's may be replaced)."""
    if not (folder / "metrics.jsonl").is_file():
        return False
    try:
        return OmegaConf.load(folder / "config_resolved.yaml").get("train", True) is not False
    except (OSError, OmegaConfBaseException):
        return True


def check_run_folder(folder: Path) -> None:
    """The run folder can be made and written, else one sentence why (not Hydra's tracebacks)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(
            f"hydra.run.dir={folder} cannot be a folder: {existing} is a file. Choose another "
            "hydra.run.dir."
        )
    if not os.access(existing, os.W_OK):
        read_only = False
        with suppress(OSError):  # os.access passes root on a read-only file system; statvfs says it
            read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        why = READ_ONLY[errno.EROFS if read_only else errno.EACCES]
        raise UserError(
            f"hydra.run.dir={folder} cannot be written: {why} at {existing}. Choose a folder "
            "you can write to (hydra.run.dir=...), or make that one writable."
        )


class RunFolderCheck(Callback):
    """The run folder before Hydra writes in it (conf/config.yaml's hydra.callbacks): checked (Hydra
    turns a callback's exception into a warning and goes on, so a bad folder ends the process
    here), and held (`take`) before anything is written there: a run refused for another's holding
    it writes nothing there. Hydra's `.hydra/` files wait in run.pending/ (`write_hydra_files`:
    a full disk is one sentence) until the run is admitted (`admit`); a run refused before that
    leaves an earlier run's files as they were (`settle`: its log cut back to where it stood)."""

    def on_run_start(self, config, **kwargs) -> None:  # noqa: ANN001 (Hydra's DictConfig)
        if int(os.environ.get("RANK", 0)) > 0:  # a torchrun rank that writes nothing of its own
            return
        try:  # resolved as Hydra would; a folder that needs Hydra's own state is left to Hydra
            folder = Path(os.path.abspath(Path(str(OmegaConf.select(config, "hydra.run.dir")))))
            check_run_folder(folder)
        except OmegaConfBaseException:
            return
        except UserError as err:
            raise SystemExit(str(err)) from None  # printed, exit status 1
        _begun.clear()  # an earlier run's of this process (tests run several in one)
        made = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if refusal := take(folder):  # held() refuses it on every rank; nothing written here
                refused_here(config, refusal)
                return
            log = folder / f"{config.hydra.job.name}.log"  # read once held: no run appends now
            size = log.stat().st_size if log.is_file() else None  # where a refused run cuts it
            _begun.update(folder=folder, made=made, log=(log, size))
            write_hydra_files(folder, config)
        except OSError as err:
            raise SystemExit(withdrawn(folder, made, err)) from None

    def on_run_end(self, config, job_return, **kwargs) -> None:  # noqa: ANN001
        for folder in list(_locks):  # a self-launched run's, held while its workers ran
            let_go(Path(folder))
        os.environ.pop(REFUSED, None)
        if job_return.status == JobStatus.COMPLETED:
            admit()
        settle()  # refused in this process, or in the workers it started


def refused_here(config: DictConfig, refusal: str) -> None:
    """A run refused the folder another holds: told by held() on every rank; Hydra writes nothing
    there meanwhile (no .hydra/ files, no log, which that run appends to)."""
    os.environ[REFUSED] = refusal
    hydra = config.hydra
    with read_write(hydra), open_dict(hydra):
        hydra.output_subdir = None
        for name, handler in (hydra.job_logging.get("handlers") or {}).items():
            if "filename" in handler:  # its log, which that run appends to
                hydra.job_logging.handlers[name] = {"class": "logging.NullHandler"}


def withdrawn(folder: Path, made: list[Path], err: OSError) -> str:
    """Remove all of this run from `folder` (its hold, its pending files, the folders it `made`),
    then say why `folder` cannot hold the run's files (`err`)."""
    _begun.clear()
    if str(folder) in _locks:  # held here: its pending files are this run's
        shutil.rmtree(folder / PENDING, ignore_errors=True)
    let_go(folder)
    for path in made:
        with suppress(OSError):
            path.rmdir()
    fault = Fault.of(err)
    reason, fix = reason_and_fix(fault, folder)
    file = os.path.relpath(fault.path, folder).removeprefix(f"{PENDING}/")  # its place
    return (
        f"{folder} cannot hold the run's files: {reason} ({fault.strerror}) writing {file}, and "
        f"nothing of this run is left there. {fix}, or give the run a folder on another disk "
        "(hydra.run.dir=...)."
    )


def write_hydra_files(folder: Path, config: DictConfig) -> None:
    """Write the `.hydra/` files Hydra is about to into run.pending/ (a disk without room for them
    refuses them here, not in Hydra, which leaves an empty config.yaml), and leave Hydra none to
    write: they move in when the run is admitted."""
    pending = folder / PENDING
    shutil.rmtree(pending, ignore_errors=True)  # a killed run's
    pending.mkdir()
    if not (subdir := config.hydra.output_subdir):
        return
    copied = copy.deepcopy(config)
    with read_write(copied.hydra), open_dict(copied.hydra):
        copied.hydra.runtime.output_dir = str(folder)
    texts = {
        "config.yaml": OmegaConf.masked_copy(copied, [k for k in copied if k != "hydra"]),
        "hydra.yaml": OmegaConf.masked_copy(copied, "hydra"),
        "overrides.yaml": copied.hydra.overrides.task,
    }
    (pending / subdir).mkdir(parents=True)
    for name, node in texts.items():
        text = OmegaConf.to_yaml(node).encode()
        write_atomically(pending / subdir / name, lambda file, text=text: file.write(text))
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None


def admit(folder: Path | None = None) -> None:
    """The run begins (on rank 0): its `.hydra/` files move in from run.pending/ (of `folder`, else
    the one this process took), over an earlier run's (renamed: no room needed)."""
    folder = folder or _begun.get("folder")
    pending = folder and folder / PENDING
    if os.environ.get("RANK", "0") != "0" or not (pending and pending.is_dir()):
        return
    for path in sorted(p for p in pending.rglob("*") if p.is_file()):
        target = folder / path.relative_to(pending)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(pending)


def settle() -> None:
    """The folder this process took, as it was if its run was refused before it began (`admit`,
    here or in the workers it started): the pending files removed, its log cut back to where it
    stood (none: removed), the folder let go, the folders made for it removed."""
    if not _begun or not (_begun["folder"] / PENDING).is_dir():
        _begun.clear()
        return  # admitted, or begun in another process (the one that started this one)
    folder, (log, size), made = _begun.pop("folder"), _begun.pop("log"), _begun.pop("made")
    with suppress(OSError):
        shutil.rmtree(folder / PENDING)
        if size is None:
            log.unlink(missing_ok=True)
        else:
            os.truncate(log, size)
        let_go(folder)
        for path in made:  # the innermost first; one holding files stays
            path.rmdir()
