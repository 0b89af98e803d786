"""Storage faults, injected for real: a full disk (a small tmpfs), a file-size limit (setrlimit),
a checkpoints folder made read-only and a run folder moved during the run, a data folder that
cannot be written. Each stops the run with one message, leaves nothing partial, and the run then
resumes to the uninterrupted run's result.

The tests that mount a file system need root (or CAP_SYS_ADMIN), as CI has; elsewhere they are
skipped with that reason, and the file-size-limit and moved-folder tests cover the same code.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import threading
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import (
    assert_same_training,
    compose_config,
    files,
    last,
    load,
    ok,
    printed,
    train,
    wait_for,
)
from conftest import start as start_run
from hydra.utils import instantiate

from src.engine import storage
from src.engine.errors import UserError
from src.engine.logger import MetricsLogger, metrics_until
from src.engine.parallel import Process
from src.engine.tools import plots

RUN = ["logger=none", "trainer.log_every_n_steps=1"]
# 25 steps an epoch, 20 epochs: time to act on the run while it trains.
LONG = [*RUN, "data.batch_size=8", "trainer.epochs=20"]


def mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a 4 MB file system of its own, which the test may resize or make read-only."""
    point = tmp_path / "disk"
    point.mkdir()
    if mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(point)).returncode:
        pytest.skip("mounting a file system needs root (or CAP_SYS_ADMIN)")
    yield point
    subprocess.run(["umount", "-R", "-l", str(point)], check=True)


@pytest.fixture
def start():
    """`conftest.start`, each run in a session of its own, killed with its workers at the end of
    the test if it is still running (a test that fails leaves no training behind)."""
    started = []

    def start_and_track(*args, **kwargs) -> subprocess.Popen:
        process = start_run(*args, start_new_session=True, **kwargs)
        started.append(process)
        return process

    yield start_and_track
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_data) -> Path:
    """The LONG run, trained without a fault: what every interrupted run must end up equal to."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    ok(train([f"data.root={tiny_data}", *LONG, f"hydra.run.dir={folder / 'run'}"], folder))
    return folder / "run"


def partial_files(folder: Path) -> list[Path]:
    return list(folder.rglob(".*.partial"))


def stop_message(output: str) -> str:
    """The one message the run stopped with."""
    lines = [line for line in output.splitlines() if line.startswith("Stopped")]
    assert len(lines) == 1, output
    assert "Traceback" not in output, output
    return lines[0]


def running_in_group(group: int) -> list[int]:
    """The processes of process group `group` still running (exited ones not yet reaped by
    init, such as multiprocessing's resource tracker after its parent, do not count)."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # gone meanwhile
            continue
        if int(pgrp) == group and state != "Z":
            running.append(int(stat.parent.name))
    return running


@contextmanager
def file_size_limit(size: int):
    """Files of this process cannot grow past `size` bytes (writes then fail with EFBIG; Python
    ignores the SIGXFSZ that comes with it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# In-process units: the atomic write, the metrics line, the messages.


@pytest.mark.unit
def test_a_refused_write_leaves_the_old_file_whole_and_nothing_partial(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"old")
    with file_size_limit(1000), pytest.raises(OSError) as refused:
        storage.write_atomically(path, lambda file: file.write(b"x" * 5000))
    assert (refused.value.errno, refused.value.filename) == (errno.EFBIG, str(path))
    assert path.read_bytes() == b"old" and not partial_files(tmp_path)
    assert storage.Fault.of(refused.value) == (str(path), errno.EFBIG, "File too large", True)


def test_a_save_removes_the_partial_files_a_killed_writer_left_of_its_name(tmp_path):
    """A writer killed mid-write leaves its partial file: the next save of that name removes it,
    and leaves those still being written (a living process's, another host's) and other names'."""
    killed = subprocess.Popen(["true"])
    killed.wait()  # its process id is free: the writer is gone
    host = socket.gethostname()
    left = tmp_path / f".last.pt.{host}.{killed.pid}.partial"
    kept = [
        tmp_path / f".last.pt.{host}.{os.getppid()}.partial",  # pytest's parent, running
        tmp_path / f".last.pt.another-host.{killed.pid}.partial",
        tmp_path / f".best.pt.{host}.{killed.pid}.partial",
    ]
    for path in [left, *kept]:
        path.write_bytes(b"half")
    storage.write_atomically(tmp_path / "last.pt", lambda file: file.write(b"whole"))
    assert sorted(partial_files(tmp_path)) == sorted(kept)
    assert (tmp_path / "last.pt").read_bytes() == b"whole"


@pytest.mark.unit
def test_a_refused_metrics_line_is_taken_back_whole(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log({"step": 1, "train/loss": 1.5})
    kept = (tmp_path / "metrics.jsonl").read_text()
    with file_size_limit(len(kept) + 10):  # the next line gets 10 of its bytes in, then EFBIG
        logger.log({"step": 2, "train/loss": 1.25, "lr": 0.01})
    assert logger.fault == (str(tmp_path / "metrics.jsonl"), errno.EFBIG, "File too large", True)
    logger.log({"step": 3, "train/loss": 1.0})  # nothing more is written
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == kept


@pytest.mark.unit
def test_metrics_of_a_moved_run_folder_are_a_fault_not_lost_lines(tmp_path):
    (tmp_path / "run").mkdir()
    logger = MetricsLogger(tmp_path / "run")
    (tmp_path / "run").rename(tmp_path / "moved")
    logger.log({"step": 1})
    assert logger.fault and logger.fault.errno == errno.ENOENT
    message = str(storage.stopped(logger.fault, tmp_path / "run", 7, None))
    assert message == (
        f"Stopped at step 7: the run folder {tmp_path / 'run'} was deleted or moved during the "
        "run, so metrics.jsonl could not be written. If it was moved, run the same command with "
        "hydra.run.dir=<its new place> to resume; if it was deleted, start again."
    )
    logger.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.ENOSPC, "the disk is full (E). Nothing partial is left, and checkpoints/last.pt "
                       "from step 40 is intact. Free space on that disk, then run the same "
                       "command with hydra.run.dir={run} to resume."),
        (errno.EDQUOT, "the disk quota is used up (E). Nothing partial is left, and checkpoints/"
                       "last.pt from step 40 is intact. Free space within your quota (or ask "
                       "for more), then run the same command with hydra.run.dir={run} to resume."),
        (errno.EFBIG, "the file-size limit is reached (E). Nothing partial is left, and "
                      "checkpoints/last.pt from step 40 is intact. Raise the limit (ulimit -f "
                      "unlimited), then run the same command with hydra.run.dir={run} to resume."),
        (errno.EROFS, "the file system is read-only (E). Nothing partial is left, and "
                      "checkpoints/last.pt from step 40 is intact. Make {run}/checkpoints "
                      "writable, then run the same command with hydra.run.dir={run} to resume; "
                      "or continue elsewhere: resume={run}/checkpoints/last.pt "
                      "hydra.run.dir=<a writable folder>."),
    ],
)  # fmt: skip
def test_each_refusal_says_what_is_intact_and_what_to_do(tmp_path, code, says):
    last = tmp_path / "checkpoints" / "last.pt"
    fault = storage.Fault(str(tmp_path / "checkpoints" / "best.pt"), code, "E")
    message = str(storage.stopped(fault, tmp_path, 48, (last, 40)))
    assert message == (
        f"Stopped at step 48: {fault.path} could not be written: {says.format(run=tmp_path)}"
    )


def test_a_data_folder_that_cannot_be_written_is_named_with_what_to_set(small_disk):
    assert mount("-o", "remount,ro", str(small_disk)).returncode == 0
    data = instantiate(compose_config(f"data.root={small_disk}/mnist").data)
    with pytest.raises(UserError, match="Set data.root to a writable folder") as refused:
        data.setup(Process())
    assert f"data.root={small_disk}/mnist cannot be written to download them into" in str(
        refused.value
    )
    assert "(Read-only file system)" in str(refused.value)


@pytest.mark.unit
def test_a_torn_last_line_of_metrics_is_left_out_on_resume(tmp_path):
    """A run killed while writing a line: the resumed run keeps the whole lines up to its
    checkpoint's step and writes its file afresh from them."""
    lines = [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}]
    whole = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 3, "train/lo')
    history = metrics_until(tmp_path / "metrics.jsonl", step=3)
    assert history == lines
    MetricsLogger(tmp_path, history=history).close()
    assert (tmp_path / "metrics.jsonl").read_text() == whole


@pytest.mark.unit
@pytest.mark.parametrize("metric", ["acc", "mae"])
def test_a_resumed_run_leaves_the_tests_line_out_whatever_the_task(tmp_path, metric):
    """The test of the launch that was stopped (classification's test/acc, regression's
    test/mae) is at its checkpoint's step, and still left out: the resumed run tests again."""
    lines = [{"step": 2, "train/loss": 1.5}, {"step": 2, "epoch": 1, "val/loss": 1.2}]
    test = {"step": 2, "epoch": 1, "test/weights_epoch": 1, f"test/{metric}": 0.5}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*lines, test]))
    assert metrics_until(tmp_path / "metrics.jsonl", step=2) == lines


def test_a_download_onto_a_full_disk_leaves_nothing_partial(tmp_path, small_disk, monkeypatch):
    """torchvision's own download code writing onto the 4 MB disk, from a local server: its
    mirror list and checksum are pointed there (nothing can be fetched from the internet here),
    and the first file, 8 MB, does not fit."""
    import torchvision

    served = tmp_path / "served"
    served.mkdir()
    big = served / "train-images-idx3-ubyte.gz"
    big.write_bytes(os.urandom(8 << 20))
    handler = partial(QuietHandler, directory=str(served))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        mirror = f"http://127.0.0.1:{server.server_address[1]}/"
        monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", [mirror])
        checksum = hashlib.md5(big.read_bytes()).hexdigest()
        monkeypatch.setattr(torchvision.datasets.MNIST, "resources", [(big.name, checksum)])
        for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
            monkeypatch.delenv(proxy, raising=False)
        data = instantiate(compose_config(f"data.root={small_disk}").data)
        with pytest.raises(UserError) as refused:
            data.setup(Process())
        server.shutdown()
    assert str(refused.value) == (
        f"The download into {small_disk} stopped: the disk is full (No space left on device). "
        "The partial download is removed. Free space on that disk, or set data.root to a folder "
        "with room: the dataset takes about 70 MB."
    )
    assert list(small_disk.iterdir()) == []


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


# Real runs.


@pytest.mark.slow
def test_a_full_disk_stops_every_ddp_rank_and_the_run_resumes_once_space_is_freed(
    start, tmp_path, tiny_data, small_disk
):
    """The issue's 3 a.m. case on 4 MB: last.pt of step 2 and best.pt of step 4 (1.7 MB each)
    fit, the copy of best.pt to last.pt beside them does not. Both ranks stop together, no
    process is left, the message names best.pt of step 4 (whole) and the command that resumes
    from it, last.pt of step 2 still loads, and with space freed that command resumes to the
    uninterrupted run's end."""
    common = [f"data.root={tiny_data}", *RUN, "trainer.epochs=3", "checkpoint.every_n_steps=2",
              "parallel=ddp", "parallel.nproc_per_node=2", "device=cpu"]  # fmt: skip
    run_dir = small_disk / "run"
    process = start([*common, f"hydra.run.dir={run_dir}"], tmp_path / "full")
    assert process.wait(timeout=120) != 0
    wait_for(lambda: not running_in_group(process.pid), None, timeout=10)  # nothing outlives it
    assert stop_message((tmp_path / "full" / "log").read_text()) == (
        f"Stopped at step 4: {run_dir}/checkpoints/last.pt could not be written: the disk is "
        "full (No space left on device). Nothing partial is left, and checkpoints/best.pt from "
        "step 4 is intact. Free space on that disk, then run the same command with "
        f"hydra.run.dir={run_dir} resume={run_dir}/checkpoints/best.pt to resume."
    )
    assert not partial_files(run_dir)
    assert (
        last(run_dir)["progress"]["step"],
        load(run_dir / "checkpoints" / "best.pt")["progress"]["step"],
    ) == (2, 4)
    assert mount("-o", "remount,size=64m", str(small_disk)).returncode == 0
    best = run_dir / "checkpoints" / "best.pt"
    result = ok(train([*common, f"hydra.run.dir={run_dir}", f"resume={best}"], tmp_path))
    assert "step 4" in printed(result)
    reference = tmp_path / "reference"
    ok(train([*common, f"hydra.run.dir={reference}"], tmp_path))
    assert_same_training(run_dir, reference)


@pytest.mark.unit
def test_a_refused_picture_leaves_nothing_partial(tmp_path):
    records = [{"step": 1, "epoch": 1, "train/loss": 2.0}]
    with file_size_limit(1000), pytest.raises(OSError) as refused:
        plots.save(plots.curves_figure(records), tmp_path / "curves.png")
    fault = storage.Fault.of(refused.value)
    assert fault == (str(tmp_path / "curves.png"), errno.EFBIG, "File too large", True)
    assert list(tmp_path.iterdir()) == []


def limit_files_to_1_mb() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))


def test_a_file_size_limit_stops_the_first_save_and_the_run_starts_again(
    start, tmp_path, tiny_data, uninterrupted
):
    """1 MB per file (`ulimit -f 1024`): the first checkpoint (1.7 MB) is refused."""
    run_dir, overrides = tmp_path / "run", [f"data.root={tiny_data}", *LONG]
    process = start([*overrides, f"hydra.run.dir={run_dir}"], tmp_path / "limited",
                    preexec_fn=limit_files_to_1_mb)  # fmt: skip
    assert process.wait(timeout=120) != 0
    assert stop_message((tmp_path / "limited" / "log").read_text()) == (
        f"Stopped at step 25: {run_dir}/checkpoints/best.pt could not be written: the file-size "
        "limit is reached (File too large). Nothing partial is left, and no checkpoint was "
        "written before it. Raise the limit (ulimit -f unlimited), then run the same command "
        f"with hydra.run.dir={run_dir} to start again."
    )
    assert not partial_files(run_dir)
    ok(train([*overrides, f"hydra.run.dir={run_dir}"], tmp_path))
    assert_same_training(run_dir, uninterrupted)


@pytest.mark.slow
def test_a_checkpoints_folder_made_read_only_stops_and_the_run_continues_elsewhere(
    start, tmp_path, tiny_data, small_disk, uninterrupted
):
    assert mount("-o", "remount,size=64m", str(small_disk)).returncode == 0
    run_dir, overrides = small_disk / "run", [f"data.root={tiny_data}", *LONG]
    checkpoints = run_dir / "checkpoints"
    process = start([*overrides, f"hydra.run.dir={run_dir}"], tmp_path / "first")
    wait_for(lambda: (checkpoints / "last.pt").exists(), process)
    assert mount("--bind", str(checkpoints), str(checkpoints)).returncode == 0
    wait_for(  # the remount is refused while a save is writing there: try again
        lambda: mount("-o", "remount,bind,ro", str(checkpoints)).returncode == 0, process, 30
    )
    assert process.wait(timeout=120) != 0
    message = stop_message((tmp_path / "first" / "log").read_text())
    step = int(re.search(r"last\.pt from step (\d+) is intact", message).group(1))
    assert re.fullmatch(
        rf"Stopped at step \d+: {checkpoints}/(best|last)\.pt could not be written: the file "
        r"system is read-only \(Read-only file system\)\. Nothing partial is left, and "
        rf"checkpoints/last\.pt from step {step} is intact\. Make {checkpoints} writable, then "
        rf"run the same command with hydra.run.dir={run_dir} to resume; or continue elsewhere: "
        rf"resume={checkpoints}/last\.pt hydra.run.dir=<a writable folder>\.",
        message,
    ), message
    elsewhere = tmp_path / "elsewhere"
    resume = f"resume={checkpoints}/last.pt"
    ok(train([*overrides, resume, f"hydra.run.dir={elsewhere}"], tmp_path))
    assert_same_training(elsewhere, uninterrupted)


@pytest.mark.slow
def test_a_run_folder_moved_during_the_run_stops_and_resumes_from_its_new_place(
    start, tmp_path, tiny_data, uninterrupted
):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    overrides = [f"data.root={tiny_data}", *LONG]
    process = start([*overrides, f"hydra.run.dir={run_dir}"], tmp_path / "first")
    wait_for(lambda: (run_dir / "checkpoints" / "last.pt").exists(), process)
    run_dir.rename(moved)
    assert process.wait(timeout=120) != 0
    message = stop_message((tmp_path / "first" / "log").read_text())
    assert re.fullmatch(
        rf"Stopped at step \d+: the run folder {run_dir} was deleted or moved during the run, so "
        r"(metrics\.jsonl|checkpoints/(best|last)\.pt) could not be written\. If it was moved, "
        r"run the same command with hydra.run.dir=<its new place> to resume from its "
        r"checkpoints/last\.pt \(step \d+\); if it was deleted, start again\.",
        message,
    ), message
    assert not run_dir.exists() and not partial_files(moved)
    ok(train([*overrides, f"hydra.run.dir={moved}"], tmp_path))
    assert_same_training(moved, uninterrupted)


def test_one_run_per_folder_a_second_is_refused_on_every_rank_and_a_dead_runs_lock_taken_over(
    start, tmp_path, tiny_data
):
    """A run holds its folder (run.lock: a kernel lock, and its process id and host) until it
    ends. A second run into it while the first trains, alone or as a DDP group, is refused with
    one sentence naming the holder, on every rank, and writes nothing there; a run SIGKILLed
    leaves its file, whose lock died with it: the next run into the folder takes it at once."""
    run_dir, host = tmp_path / "run", socket.gethostname()
    overrides = [f"data.root={tiny_data}", f"hydra.run.dir={run_dir}"]
    # Killed below, long before its 1,000 epochs end, however fast this machine trains.
    first = start(
        [*overrides, *RUN, "data.batch_size=8", "trainer.epochs=1000"], tmp_path / "first"
    )
    lock = run_dir / storage.LOCK
    wait_for(lambda: (run_dir / "config_resolved.yaml").exists(), first)
    assert json.loads(lock.read_text()) == {"pid": first.pid, "host": host}
    config = (run_dir / "config_resolved.yaml").read_bytes()
    refused = (
        f"{run_dir} is in use by another run (process {first.pid} on {host}): give this run a "
        "folder of its own (hydra.run.dir=...), or wait for that one to end. If it is no longer "
        f"running, delete {lock}."
    )
    hydra_files = files(run_dir / ".hydra")
    alone = train([*overrides, *RUN, "optimizer.lr=0.5"], tmp_path / "second")
    group = train([*overrides, *RUN, "parallel=ddp", "optimizer.lr=0.5"], tmp_path / "g", nproc=2)
    # Nothing written there, alone or under torchrun: the first run's .hydra/, its own train.log.
    assert files(run_dir / ".hydra") == hydra_files
    assert (run_dir / "train.log").read_text().count("Run folder:") == 1
    for result in (alone, group):
        assert result.returncode != 0 and refused in printed(result), printed(result)
    assert "Traceback" not in printed(alone), printed(alone)
    # Each rank stops with it: rank 0 says it, torchrun's report of the group quotes every rank.
    assert re.search(r"rank\s+: 1 .*\n.*\n.*\n\s+traceback : " + re.escape(refused), printed(group))
    assert (run_dir / "config_resolved.yaml").read_bytes() == config
    wait_for(lambda: (run_dir / "checkpoints" / "last.pt").exists(), first)  # for the third
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert json.loads(lock.read_text())["pid"] == first.pid  # left behind
    # The same command again, to fewer steps than its last.pt holds: it takes the folder, has
    # nothing left to train, and tests the weights.
    ok(train([*overrides, *RUN, "data.batch_size=8", "trainer.epochs=1000", "trainer.max_steps=1"],
             tmp_path / "third"))  # fmt: skip
    assert not lock.exists() and (run_dir / "metrics.jsonl").exists()


def test_a_run_folder_that_cannot_be_made_or_written_is_named(tmp_path, small_disk):
    afile = tmp_path / "afile"
    afile.write_text("")
    for folder in (afile, afile / "run"):
        with pytest.raises(UserError) as refused:
            storage.check_run_folder(folder)
        assert str(refused.value) == (
            f"hydra.run.dir={folder} cannot be a folder: {afile} is a file. Choose another "
            "hydra.run.dir."
        )
    storage.check_run_folder(small_disk / "run")  # writable: made later by Hydra
    assert mount("-o", "remount,ro", str(small_disk)).returncode == 0
    with pytest.raises(UserError) as refused:
        storage.check_run_folder(small_disk / "run")
    assert str(refused.value) == (
        f"hydra.run.dir={small_disk / 'run'} cannot be written: the file system is read-only at "
        f"{small_disk}. Choose a folder you can write to (hydra.run.dir=...), or make that one "
        "writable."
    )


def test_a_full_disk_before_the_run_begins_is_one_sentence_and_leaves_the_folder_as_it_was(
    tmp_path, tiny_data, small_disk
):
    """Hydra's .hydra/ files, or the run's lock, refused by a full disk: one sentence, not Hydra's
    traceback and an empty config.yaml; a new folder is not left behind, an earlier run's is as
    it was."""
    earlier = small_disk / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml", "../train.log"):
        (earlier / ".hydra" / name).write_text(f"an earlier run's {name}\n")
    records = files(earlier)

    def fill(filler):
        with pytest.raises(OSError):
            while True:
                filler.write(b"x" * 4096)

    def refused(run_dir, file):
        result = train([f"data.root={tiny_data}", "logger=none", f"hydra.run.dir={run_dir}"],
                       tmp_path)  # fmt: skip
        assert result.returncode == 1 and printed(result).strip() == (
            f"{run_dir} cannot hold the run's files: the disk is full (No space left on device) "
            f"writing {file}, and nothing of this run is left there. Free space on that disk, or "
            "give the run a folder on another disk (hydra.run.dir=...)."
        ), printed(result)

    with open(small_disk / "filler", "wb", buffering=0) as filler:
        fill(filler)
        filler.truncate(filler.tell() // 4096 * 4096 - 4096)  # a page left: the lock's, no more
        for run_dir in (small_disk / "run", earlier):
            refused(run_dir, ".hydra/config.yaml")
        fill(filler)
        refused(small_disk / "run", "run.lock")
    assert sorted(small_disk.iterdir()) == [earlier, small_disk / "filler"]
    assert files(earlier) == records and not partial_files(small_disk)


def test_a_file_as_the_run_folder_stops_the_run_with_one_sentence(tmp_path, tiny_data):
    """Checked by a Hydra callback before Hydra makes the folder (where it failed with a
    FileExistsError traceback)."""
    (tmp_path / "afile").write_text("")
    run_dir = f"hydra.run.dir={tmp_path / 'afile'}"
    result = train([f"data.root={tiny_data}", "logger=none", run_dir], tmp_path)
    assert result.returncode == 1 and printed(result).strip() == (
        f"hydra.run.dir={tmp_path / 'afile'} cannot be a folder: {tmp_path / 'afile'} is a file. "
        "Choose another hydra.run.dir."
    )
