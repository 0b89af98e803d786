"""A run folder holds one run's records: a new run into the folder of an earlier one, which it would
start afresh (no last.pt to resume), is refused before any work, and the folder stays as it was."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TESTS,
    defaults_for_tests,
    files,
    offline_env,
    ok,
    printed,
    read_test,
    run_train_py_here,
    train,
)
from omegaconf import OmegaConf

from src.engine import storage
from src.engine.errors import UserError
from src.engine.parallel import Process

RUN = ["logger=none", "trainer.epochs=1"]
FORK = [f"hydra.searchpath=[file://{TESTS}/conf]"]  # tests/conf/callbacks/watch.yaml


def finished_without_last_pt(tmp_path: Path, tiny_data: Path) -> tuple[list[str], str]:
    """The overrides of a finished run, its last.pt gone, and the sentence refusing its folder."""
    run_dir = tmp_path / "run"
    common = [f"data.root={tiny_data}", *RUN, f"hydra.run.dir={run_dir}"]
    ok(train(common, tmp_path))
    (run_dir / "checkpoints" / "last.pt").unlink()
    best = run_dir / "checkpoints" / "best.pt"
    return common, (
        f"{run_dir} holds an earlier run's checkpoints/best.pt and metrics.jsonl but no "
        "checkpoints/last.pt to resume from, which a new run would replace: run the same command "
        f"with resume={best} to continue from its best epoch, or give this run a folder of its "
        "own (hydra.run.dir=...)."
    )


def test_a_new_run_into_a_finished_runs_folder_without_last_pt_is_refused_and_changes_nothing(
    tmp_path, tiny_data
):
    """last.pt gone (a full disk's stop, a clean-up): a new run there, with another config or the
    same, would replace best.pt, metrics.jsonl and .hydra/. Refused with the folder byte for byte
    as it was (train.log too); the resume the sentence names continues from best.pt."""
    common, refused = finished_without_last_pt(tmp_path, tiny_data)
    run_dir = tmp_path / "run"
    records = files(run_dir)
    for name, overrides in (("other", ["optimizer.lr=0.5"]), ("same", [])):
        result = train([*common, *overrides], tmp_path / name)
        assert result.returncode == 1 and refused in printed(result), printed(result)
        assert "Traceback" not in printed(result), printed(result)
        assert files(run_dir) == records
    best = run_dir / "checkpoints" / "best.pt"
    result = ok(train([*common, "trainer.epochs=2", f"resume={best}"], tmp_path / "resumed"))
    assert f"Resuming from {best}" in printed(result)
    assert (run_dir / "checkpoints" / "last.pt").is_file()


@pytest.mark.unit
def test_what_counts_as_an_earlier_runs_records(tmp_path):
    """A run that ended (its test line) without checkpoints (checkpoint.save=false) is refused
    with a folder of its own as the one way on; one stopped before its first checkpoint (an empty
    checkpoints/, no test line: its stop told "start again") starts again in its folder."""
    (tmp_path / "checkpoints").mkdir()
    lines = [{"step": 3, "train/loss": 2.0}, {"step": 3, "epoch": 1, "val/acc": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    storage.refuse_fresh_start(tmp_path, Process())
    with (tmp_path / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 3, "test/weights_epoch": 1, "test/acc": 0.5}) + "\n")
    with pytest.raises(UserError) as refused:
        storage.refuse_fresh_start(tmp_path, Process())
    assert str(refused.value) == (
        f"{tmp_path} holds an earlier run's metrics.jsonl but no checkpoints/last.pt to resume "
        "from, which a new run would replace: give this run a folder of its own "
        "(hydra.run.dir=...)."
    )


@pytest.mark.slow
def test_a_new_ddp_run_into_a_finished_runs_folder_is_refused_on_every_rank(tmp_path, tiny_data):
    common, refused = finished_without_last_pt(tmp_path, tiny_data)
    records = files(tmp_path / "run")
    group = train([*common, "parallel=ddp"], tmp_path / "group", nproc=2)
    assert group.returncode != 0 and refused in printed(group), printed(group)
    # Each rank stops with it: torchrun's report of the group quotes rank 1's too.
    assert re.search(r"rank\s+: 1 .*\n.*\n.*\n\s+traceback : " + re.escape(refused), printed(group))
    assert files(tmp_path / "run") == records


def forked(overrides: list[str], cwd: Path) -> int:
    """train.py in a child of this process, its output in cwd/log: the process id. Where this
    process has run train.py before, the child has nothing to import: it starts at once."""
    cwd.mkdir(parents=True)
    command = [sys.executable, str(REPO / "train.py"), *overrides, *defaults_for_tests(overrides)]
    if pid := os.fork():
        return pid
    code = 1
    try:
        result = run_train_py_here(command, cwd, offline_env())
        (cwd / "log").write_text(printed(result))
        code = result.returncode
    finally:
        os._exit(code)


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_trains_and_the_other_changes_nothing(
    tmp_path, tiny_data
):
    """The folder's lock is taken before Hydra writes there: of two runs started into one folder
    0 to 1 s apart, one trains to its end with every file its own, the other is refused in one
    sentence naming it and writes nothing there (50 tries; its undo once deleted the winner's
    .hydra/ and train.log). Each run is a child of this process (no imports to wait for), whose
    callback sleeps 1.5 s at its epoch's end, so that the first holds the folder while the
    second starts, whatever the delay; five pairs at a time."""
    # A run in this process first: what a run imports (900 modules) is then imported for every
    # child, which starts in a tenth of a second.
    ok(train([f"data.root={tiny_data}", *RUN, "trainer.max_steps=1"], tmp_path / "imports"))
    hold = [*FORK, "callbacks=watch", "callbacks.watch.sleep_at_epoch_end=1.5"]
    for first in range(0, 50, 5):
        tries = range(first, first + 5)
        # Each pair's first run at once, its second attempt / 49 s later: the ten starts in order.
        starts = sorted([(0.0, a, 1) for a in tries] + [(a / 49, a, 2) for a in tries])
        began, pids = time.monotonic(), {}
        for at, attempt, seed in starts:
            time.sleep(max(0.0, began + at - time.monotonic()))
            overrides = [f"data.root={tiny_data}", *RUN, *hold, f"seed={seed}",
                         f"hydra.run.dir={tmp_path / f'run{attempt}'}"]  # fmt: skip
            pids[attempt, seed] = forked(overrides, tmp_path / f"{attempt}-{seed}")
        codes = {key: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for key, pid in pids.items()}
        for attempt in tries:
            run_dir, pair = tmp_path / f"run{attempt}", [codes[attempt, 1], codes[attempt, 2]]
            assert sorted(pair) == [0, 1], (attempt, pair)
            won = pair.index(0)  # the winner's seed is won + 1, the other's 2 - won
            said = (tmp_path / f"{attempt}-{2 - won}" / "log").read_text()
            refused = f"{run_dir} is in use by another run (process {pids[attempt, won + 1]} on "
            assert said.count(refused) == 1 and "Traceback" not in said, said
            assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").seed == won + 1
            assert f"seed={won + 1}" in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
            log = (run_dir / "train.log").read_text()
            assert log.count("Run folder:") == 1 and "Training ended" in log, log
            assert read_test(run_dir) and (run_dir / "checkpoints" / "last.pt").is_file()
            assert not (run_dir / "run.lock").exists()


@pytest.mark.unit
@pytest.mark.parametrize("subdir", [".hydra", None])
def test_what_hydra_writes_waits_for_the_run_with_or_without_its_output_subdir(tmp_path, subdir):
    """RunFolderCheck takes a new folder and writes Hydra's .hydra/ files into run.pending/ (none
    with hydra.output_subdir=null), leaving Hydra none to write. A run refused before it begins
    (settle) leaves no folder, its log gone too; an admitted one's files move in, and stay."""
    folder = tmp_path / "new" / "run"
    hydra = {"run": {"dir": str(folder)}, "output_subdir": subdir, "job": {"name": "train"}}
    hydra |= {"job_logging": {}, "runtime": {}, "overrides": {"task": ["seed=1"]}}
    for admitted in (False, True):
        config = OmegaConf.create({"seed": 1, "hydra": hydra})
        storage.RunFolderCheck().on_run_start(config)
        assert config.hydra.output_subdir is None and not (folder / ".hydra").exists()
        (folder / "train.log").write_text("a line of the run\n")
        if admitted:
            storage.admit(folder)
        storage.settle()
        assert folder.exists() == admitted
    assert (folder / "train.log").is_file() and not (folder / storage.PENDING).exists()
    if subdir:
        assert OmegaConf.load(folder / subdir / "config.yaml") == {"seed": 1}
        assert OmegaConf.load(folder / subdir / "overrides.yaml") == ["seed=1"]
    storage.let_go(folder)
