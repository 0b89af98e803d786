"""Checkpoints for real: what is saved, exact resume (after an epoch, after a signal, after a
SIGKILL of a torchrun worker), loading into every parallel mode, and bad files."""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TESTS,
    WEIGHT_ATOL,
    assert_same_training,
    defaults_for_tests,
    files,
    last,
    load,
    metric_lines,
    offline_env,
    ok,
    printed,
    read_metrics,
    read_test,
    run,
    start,
    torchrun_through_shell,
    train,
    wait_for,
)

from src.engine.checkpoint import OptimizerState, Weights, _read, check_changes, on_cpu
from src.engine.errors import UserError

RUN = ["logger=none", "trainer.log_every_n_steps=1"]


def test_checkpoint_holds_plain_values_and_unwrapped_weights(tmp_path, tiny_data):
    ok(train([f"data.root={tiny_data}", *RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    state = last(tmp_path / "run")  # weights_only=True: tensors and plain Python values only
    # Each part's own state under its name, and what the run was: its config, its wandb run.
    parts = {"model", "optimizer", "scheduler", "scaler", "progress", "rng"}
    assert set(state) == parts | {"config", "wandb_id"}
    assert set(state["progress"]) == {
        "epoch",
        "epoch_step",
        "step",
        "metrics",
        "best",
        "batch_size",
        "stopped",
    }
    assert list(state["model"]) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert (
        state["progress"]["epoch"],
        state["progress"]["epoch_step"],
        state["progress"]["step"],
    ) == (1, 4, 4)
    assert state["config"]["model"]["_target_"] == "src.models.MLP"
    (validation, _) = read_metrics(tmp_path / "run")[1]
    assert state["progress"]["metrics"]["val/acc"] == validation["val/acc"]
    best = {"monitor": "val/acc", "mode": "max", "value": validation["val/acc"], "epoch": 1}
    assert state["progress"]["best"] == {**best, "stale": 0}
    assert len(state["rng"]) == 1 and set(state["rng"][0]) == {"python", "numpy", "torch", "cuda"}
    assert load(tmp_path / "run" / "checkpoints" / "best.pt")["progress"]["step"] == 4
    assert not list((tmp_path / "run" / "checkpoints").glob(".*partial"))


@pytest.mark.parametrize("nproc", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_after_an_epoch_equals_the_uninterrupted_run(tmp_path, tiny_data, nproc):
    """The CNN (dropout: random streams matter) with a StepLR schedule, 1 epoch then 2 more."""
    common = [f"data.root={tiny_data}", *RUN, "model=cnn", "scheduler=step"]
    if nproc:
        common.append("parallel=ddp")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(train([*common, "trainer.epochs=3", f"hydra.run.dir={whole}"], tmp_path, nproc=nproc))
    ok(train([*common, "trainer.epochs=1", f"hydra.run.dir={parts}"], tmp_path, nproc=nproc))
    assert last(parts)["progress"]["step"] == 4
    result = ok(
        train([*common, "trainer.epochs=3", f"hydra.run.dir={parts}"], tmp_path, nproc=nproc)
    )
    assert "Resuming at epoch 2, after 0 of its batches, step 4" in printed(result)
    assert len(last(parts)["rng"]) == (nproc or 1)
    assert_same_training(parts, whole)


# On the tiny data this run's val/acc stops improving after epoch 5, so early stopping with a
# patience of 2 ends it after epoch 7 (of 12), testing best.pt's weights of epoch 5.
EARLY_STOPPING = ["data.batch_size=8", "optimizer.lr=0.001", "trainer.epochs=12",
                  "trainer.early_stopping_patience=2"]  # fmt: skip


@pytest.mark.slow
def test_early_stopping_and_its_counter_survive_a_resume(tmp_path, tiny_data):
    """The first launch ends after epoch 6, one validation into the patience; the resumed run
    must stop after epoch 7, as the uninterrupted one does, not count afresh."""
    common = [f"data.root={tiny_data}", *RUN, *EARLY_STOPPING]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    result = ok(train([*common, f"hydra.run.dir={whole}"], tmp_path))
    assert "early stopping: val/acc has not improved for 2 validations" in printed(result)
    assert last(whole)["progress"]["epoch"] == 7 and last(whole)["progress"]["best"]["epoch"] == 5
    assert read_test(whole)["test/weights_epoch"] == 5
    assert load(whole / "checkpoints" / "best.pt")["progress"]["step"] == 5 * 25
    ok(train([*common, "trainer.epochs=6", f"hydra.run.dir={parts}"], tmp_path))
    assert last(parts)["progress"]["best"]["stale"] == 1
    ok(train([*common, f"hydra.run.dir={parts}"], tmp_path))
    assert_same_training(parts, whole)
    # Launched once more, it trains nothing and tests the same weights again.
    result = ok(train([*common, f"hydra.run.dir={parts}"], tmp_path))
    assert "Nothing left to train" in printed(result)
    assert read_test(parts)["test/acc"] == read_test(whole)["test/acc"]


@pytest.mark.slow
def test_resuming_a_file_from_another_folder_brings_its_best_pt_along(tmp_path, tiny_data):
    """resume=PATH in a new run folder: the best.pt beside PATH comes too, so the new run tests
    the epoch its record names; without one, the record starts afresh (and says so)."""
    common = [f"data.root={tiny_data}", *RUN, *EARLY_STOPPING]
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    ok(train([*common, "trainer.epochs=6", f"hydra.run.dir={first}"], tmp_path))
    resume = f"resume={first / 'checkpoints' / 'last.pt'}"
    ok(train([*common, resume, f"hydra.run.dir={second}"], tmp_path))
    copied = load(second / "checkpoints" / "best.pt")
    assert copied["progress"]["epoch"] == 5 and read_test(second)["test/weights_epoch"] == 5
    (first / "checkpoints" / "best.pt").unlink()
    result = ok(train([*common, resume, f"hydra.run.dir={third}"], tmp_path))
    assert "but no best.pt lies beside it: the best so far starts afresh" in printed(result)
    assert last(third)["progress"]["best"]["epoch"] == 7  # the first validation after the resume


@pytest.mark.parametrize(
    ("signum", "nproc"),
    [
        (signal.SIGTERM, None),
        pytest.param(signal.SIGINT, None, marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, 2, marks=pytest.mark.slow, id="torchrun-SIGTERM"),
    ],
)
def test_signal_stops_at_a_step_saves_and_the_next_launch_resumes(
    tmp_path, tiny_data, signum, nproc
):
    """Pre-emption or Ctrl-C mid-epoch: last.pt is written there, and resuming from it ends
    exactly where an uninterrupted run ends. Under torchrun the signal goes to torchrun, which
    passes it on to its workers (as SLURM's does)."""
    overrides = [f"data.root={tiny_data}", *RUN, "data.batch_size=8", "trainer.epochs=8"]
    if nproc:
        overrides.append("parallel=ddp")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(train([*overrides, f"hydra.run.dir={whole}"], tmp_path, nproc=nproc))
    process = start([*overrides, f"hydra.run.dir={parts}"], tmp_path / "first", nproc=nproc)
    wait_for(lambda: metric_lines(parts) >= 3, process)
    process.send_signal(signum)
    assert process.wait(timeout=60) != 0
    output = (tmp_path / "first" / "log").read_text()
    assert output.count("Stopped by a signal after step") == 1, output
    # No traceback from the workers; torchrun prints its own for the signal it got.
    assert output.count("Traceback") == (1 if nproc else 0), output
    stopped = last(parts)
    assert 0 < stopped["progress"]["step"] < 200, (
        "stopped during training (25 steps per epoch, 8 epochs)"
    )
    result = ok(train([*overrides, f"hydra.run.dir={parts}"], tmp_path, nproc=nproc))
    assert f"step {stopped['progress']['step']}" in printed(result)
    assert_same_training(parts, whole)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "whom"), [(signal.SIGTERM, "the launcher"), (signal.SIGINT, "every process")]
)
def test_a_signal_to_a_self_launched_ddp_run_ends_with_the_stop_sentence_alone(
    tmp_path, tiny_data, signum, whom
):
    """parallel=ddp without torchrun: SIGTERM to the process that started the workers (as a
    scheduler sends it), or Ctrl-C (SIGINT to the terminal's whole process group). The workers
    stop at a step and save; the output ends with rank 0's sentence, no traceback of the
    launcher's, no leaked semaphore of a worker's."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, "data.batch_size=8", "trainer.epochs=1000",
                 "parallel=ddp", "parallel.nproc_per_node=2",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    process = start(overrides, tmp_path / "first", start_new_session=True)
    wait_for(lambda: metric_lines(run_dir) >= 3, process)
    if whom == "the launcher":
        process.send_signal(signum)
    else:
        os.killpg(process.pid, signum)
    assert process.wait(timeout=60) == 1
    output = (tmp_path / "first" / "log").read_text()
    stopped = last(run_dir)["progress"]["step"]
    sentence = (
        f"Stopped by a signal after step {stopped}; {run_dir}/checkpoints/last.pt is saved. Run "
        f"the same command with hydra.run.dir={run_dir} to resume."
    )
    assert output.rstrip().endswith(sentence) and output.count("Stopped by a signal") == 1, output
    for noise in ("Traceback", "Error executing job", "leaked semaphore", "death signal"):
        assert noise not in output, output


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "signum", "said"),
    [
        ("SlowToBuild", signal.SIGTERM, "Stopped by a signal before training; nothing was saved."),
        ("SlowToTest", signal.SIGINT, "Stopped by a signal after training ended at step 4, during "
         "the test; {run}/checkpoints holds its weights (test one with train=false "
         "ckpt_path=...)."),
    ],
)  # fmt: skip
def test_a_signal_outside_training_says_where_the_run_stopped(
    tmp_path, tiny_data, model, signum, said
):
    """SIGTERM or Ctrl-C while the model is built (or the data decoded), or during the test: one
    sentence saying where, and what is kept; no KeyboardInterrupt traceback."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", "logger=none", f"model._target_=user_models.{model}",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    process = start(overrides, tmp_path, env=offline_env(PYTHONPATH=TESTS))
    marker = tmp_path / ("building" if model == "SlowToBuild" else "testing")  # the model's
    wait_for(marker.exists, process)
    process.send_signal(signum)
    assert process.wait(timeout=60) == 1
    output = (tmp_path / "log").read_text()
    assert said.format(run=run_dir) in output, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output


@pytest.mark.slow
def test_kill_during_checkpoint_writes_never_damages_last_pt(tmp_path, tiny_data):
    """SIGKILL at random moments of a run that rewrites a 6 MB last.pt every step: last.pt always
    loads, and the run still resumes from it."""
    run_dir = tmp_path / "run"
    overrides = [
        f"data.root={tiny_data}",
        *RUN,
        "model.hidden=2048",
        "data.batch_size=8",
        "trainer.epochs=8",
        "checkpoint.every_n_steps=1",
        f"hydra.run.dir={run_dir}",
    ]
    checkpoint = run_dir / "checkpoints" / "last.pt"
    steps = []
    for attempt in range(3):
        process = start(overrides, tmp_path / f"attempt{attempt}")
        before = last(run_dir)["progress"]["step"] if checkpoint.exists() else 0
        wait_for(lambda b=before: checkpoint.exists() and last_step(checkpoint) > b, process)
        time.sleep(random.uniform(0, 0.3))
        process.kill()
        process.wait()
        steps.append(last(run_dir)["progress"]["step"])  # loads with weights_only=True: whole
    assert steps == sorted(steps) and steps[0] > 0
    result = ok(train(overrides, tmp_path))
    assert "Resuming from" in printed(result)
    assert last(run_dir)["progress"]["step"] == 8 * 25


def last_step(path: Path) -> int:
    try:
        return load(path)["progress"]["step"]
    except Exception:  # noqa: BLE001 - being replaced right now; the caller polls again
        return -1


def worker_pids(agent: subprocess.Popen) -> dict[int, int]:
    """torchrun's worker processes, by their RANK."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [v for v in env if v.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0][5:])] = pid
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_restarts_a_killed_worker_group_which_resumes_in_the_same_folder(
    tmp_path, tiny_data, mode
):
    """A real SIGKILL of rank 1 in the middle of training; torchrun --max-restarts=1 starts the
    group again, which continues from last.pt in the same run folder and ends like a run
    that was never killed: stopped early at the same epoch, with the same best.pt."""
    overrides = [
        f"data.root={tiny_data}",
        *RUN,
        f"parallel={mode}",
        *EARLY_STOPPING,
        "checkpoint.every_n_steps=5",
    ]
    whole = tmp_path / "whole"
    ok(train([*overrides, f"hydra.run.dir={whole}"], tmp_path, nproc=2))
    outputs = tmp_path / "killed" / "outputs"
    # After the restart rank 1 joins first, where what the first attempt left in torchrun's store
    # would send it to the dead rank 0 (see launch.attempt_store).
    restarted_rank_0_starts_late = '[ "$RANK$TORCHELASTIC_RESTART_COUNT" = 01 ] && sleep 2'
    agent = subprocess.Popen(
        torchrun_through_shell(
            restarted_rank_0_starts_late, overrides, outputs, "--max-restarts=1"
        ),
        cwd=tmp_path,
        env=offline_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: list(outputs.rglob("last.pt")), agent)
    time.sleep(0.2)
    os.kill(worker_pids(agent)[1], signal.SIGKILL)
    output, _ = agent.communicate(timeout=180)
    assert agent.returncode == 0, output
    (run_dir,) = [p.parent for p in outputs.rglob(".hydra")]  # one folder for both attempts
    assert output.count("Run folder:") == 2 and "Resuming from" in output, output
    assert_same_training(run_dir, whole)


@pytest.mark.slow
def test_a_restart_meets_although_a_rank_died_before_it_joined(tmp_path, tiny_data):
    """Rank 1 of the first attempt dies while rank 0 waits for it in the rendezvous: the ranks of
    the restarted group have lived through different numbers of attempts, and still agree on
    which one this is (counted per rank, they met under different prefixes until the timeout)."""
    overrides = [f"data.root={tiny_data}", *RUN, "parallel=ddp", "trainer.max_steps=2",
                 "parallel.timeout=30"]  # fmt: skip
    rank_1_dies_first = '[ "$RANK$TORCHELASTIC_RESTART_COUNT" = 10 ] && sleep 6 && exit 3'
    command = torchrun_through_shell(
        rank_1_dies_first, overrides, tmp_path / "outputs", "--max-restarts=1"
    )
    result = subprocess.run(
        command, cwd=tmp_path, env=offline_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, printed(result)[-3000:]
    assert "Test on" in printed(result)


MODES = {"none": None, "dp": None, "ddp": 2, "fsdp": 2}  # mode: processes under torchrun


# Adam divides by sqrt(v) + eps: with its default eps a gradient near zero turns the noise of
# another summation order into steps of 1e-5; eps=0.01 keeps them at float32's noise.
ADAM = ["optimizer=adam", "+optimizer.eps=0.01"]


@pytest.fixture(scope="module")
def adam_whole(tmp_path_factory, tiny_data) -> Path:
    """Two epochs of ADAM in one process, uninterrupted: what every resumed run must end as."""
    folder = tmp_path_factory.mktemp("adam-whole")
    overrides = [f"data.root={tiny_data}", *RUN, *ADAM, "trainer.epochs=2"]
    ok(train([*overrides, f"hydra.run.dir={folder / 'run'}"], folder))
    return folder / "run"


@pytest.mark.slow
@pytest.mark.parametrize("saved", list(MODES))
def test_checkpoints_resume_in_every_parallel_mode(tmp_path, tiny_data, adam_whole, saved):
    """Saved after one epoch under `saved` (none, dp, ddp, fsdp), resumed for a second epoch under
    each mode (Adam's moments and step counts included): the same final weights as one
    uninterrupted run, and the same test, on the best.pt each resumed run loads. (Without GPUs,
    dp trains on one device after a warning; the checkpoint path is the same.) One test per saved
    mode, so that they spread over the test workers."""
    common = [f"data.root={tiny_data}", *RUN, *ADAM]
    first = tmp_path / f"saved-{saved}"
    overrides = [*common, f"parallel={saved}", "trainer.epochs=1", f"hydra.run.dir={first}"]
    ok(train(overrides, tmp_path, nproc=MODES[saved]))
    assert list(last(first)["optimizer"]["state"]) == [0, 1, 2, 3]  # plain, numbered
    want = last(adam_whole)
    for loaded, nproc in MODES.items():
        resumed = tmp_path / f"{saved}-in-{loaded}"
        resume = f"resume={first / 'checkpoints' / 'last.pt'}"
        overrides = [*common, f"parallel={loaded}", "trainer.epochs=2", resume,
                     f"hydra.run.dir={resumed}"]  # fmt: skip
        result = ok(train(overrides, tmp_path, nproc=nproc))
        assert "Resuming at epoch 2, after 0 of its batches" in printed(result)
        got = last(resumed)
        assert got["progress"]["step"] == want["progress"]["step"]
        for key, tensor in want["model"].items():
            torch.testing.assert_close(
                got["model"][key], tensor, rtol=0, atol=1e-6, msg=f"{saved} in {loaded}: {key}"
            )
        for number, moments in want["optimizer"]["state"].items():
            assert got["optimizer"]["state"][number]["step"] == moments["step"]
        assert read_test(resumed)["test/correct"] == read_test(adam_whole)["test/correct"]


@pytest.mark.slow
def test_fsdp_resumes_an_optimizer_without_state_for_unused_parameters(tmp_path, tiny_data):
    """A head that gets no gradient has no Adam state in a plain checkpoint; FSDP resumes it as
    one process does (its moments start when it gets a gradient)."""
    common = [
        f"data.root={tiny_data}",
        *RUN,
        "optimizer=adam",
        "model._target_=user_models.UnusedBranch",
    ]
    env = offline_env(PYTHONPATH=str(Path(__file__).parent))
    first = tmp_path / "first"
    ok(train([*common, "trainer.epochs=1", f"hydra.run.dir={first}"], tmp_path, env=env))
    assert len(last(first)["optimizer"]["state"]) == 4  # of 6 parameters
    resume = f"resume={first / 'checkpoints' / 'last.pt'}"
    overrides = [*common, "parallel=fsdp", "trainer.epochs=2", resume]
    ok(train([*overrides, f"hydra.run.dir={tmp_path / 'fsdp'}"], tmp_path, nproc=2, env=env))
    assert last(tmp_path / "fsdp")["progress"]["step"] == 2 * last(first)["progress"]["step"]


@pytest.mark.slow
def test_sharded_checkpoints_of_2_processes_resume_in_3(tmp_path, tiny_data):
    """checkpoint.sharded=true under fsdp: each rank writes its shards, last.pt names their
    folder; 3 processes resume from the shards of 2 (torch.distributed.checkpoint reshards) and
    end as one uninterrupted process does, testing the sharded best.pt. Only the folders a file
    names are kept, and another mode refuses the checkpoint with one sentence."""
    common = [f"data.root={tiny_data}", *RUN, *ADAM, "data.batch_size=24"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(train([*common, "trainer.epochs=2", f"hydra.run.dir={whole}"], tmp_path))
    sharded = [*common, "parallel=fsdp", "checkpoint.sharded=true", f"hydra.run.dir={parts}"]
    ok(train([*sharded, "trainer.epochs=1"], tmp_path, nproc=2))
    first = last(parts)
    assert "model" not in first and "optimizer" not in first
    assert sorted(p.name for p in (parts / "checkpoints" / first["shards"]).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip
    refused = train([*common, "trainer.epochs=2", f"hydra.run.dir={parts}"], tmp_path)
    assert refused.returncode == 1
    assert "holds its weights in shards (checkpoint.sharded=true)" in printed(refused)

    moved = tmp_path / "moved" / "last.pt"  # the file without the folder it names
    moved.parent.mkdir()
    moved.write_bytes((parts / "checkpoints" / "last.pt").read_bytes())
    elsewhere = [*common, "parallel=fsdp", f"hydra.run.dir={tmp_path / 'elsewhere'}"]
    missing = train([*elsewhere, f"resume={moved}"], tmp_path, nproc=2)
    assert missing.returncode == 1 and "which is missing or incomplete" in printed(missing)
    gathered = [*common, "parallel=fsdp", "trainer.epochs=2", f"hydra.run.dir={parts}"]
    gathered = train(gathered, tmp_path, nproc=2)  # without checkpoint.sharded=true
    assert gathered.returncode == 1
    assert "checkpoint.sharded=false, and " in printed(gathered), printed(gathered)
    assert "Resume with checkpoint.sharded=true, or start a new run" in printed(gathered)
    wider = train([*sharded, "trainer.epochs=2", "model.hidden=32"], tmp_path, nproc=2)
    assert wider.returncode == 1 and "another architecture than MLP" in printed(wider)

    result = ok(train([*sharded, "trainer.epochs=2"], tmp_path, nproc=3))
    assert "Resuming at epoch 2, after 0 of its batches" in printed(result)
    assert printed(result).count("The checkpoint was saved by 2 processes and this run has 3") == 1
    final, want = last(parts), last(whole)
    assert (
        final["progress"]["step"] == want["progress"]["step"]
        and final["progress"]["best"] == want["progress"]["best"]
    )
    folders = sorted(p.name for p in (parts / "checkpoints").glob("shards-*"))
    assert folders == sorted({final["shards"], load(parts / "checkpoints" / "best.pt")["shards"]})
    # The final weights, read back from the shards by one more (evaluating) fsdp run.
    evaluated = tmp_path / "evaluated"
    ok(train([*common, "parallel=fsdp", "train=false", f"hydra.run.dir={evaluated}",
              f"ckpt_path={parts / 'checkpoints' / 'last.pt'}"], tmp_path, nproc=2))  # fmt: skip
    test, expected = read_test(parts), read_test(whole)  # of best.pt, read from its shards
    assert test["test/correct"] == expected["test/correct"]
    assert test["test/loss"] == pytest.approx(expected["test/loss"], rel=1e-5)
    validated = [m for m in read_metrics(evaluated)[1] if "val/loss" in m]
    last_validation = [m for m in read_metrics(whole)[1] if "val/loss" in m][-1]
    assert validated[0]["val/loss"] == pytest.approx(last_validation["val/loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["module.", "_orig_mod."])
def test_init_from_a_bare_state_dict_of_a_wrapped_model(tmp_path, tiny_data, prefix):
    """A foreign file: `torch.save(ddp_model.state_dict())` or a compiled model's. With lr=0 the
    weights stay as loaded, so the run's last.pt shows exactly what init_from put in."""
    ok(train([f"data.root={tiny_data}", *RUN, f"hydra.run.dir={tmp_path / 'source'}"], tmp_path))
    weights = last(tmp_path / "source")["model"]
    foreign = tmp_path / "foreign.pt"
    torch.save({prefix + key: tensor for key, tensor in weights.items()}, foreign)
    ok(
        train(
            [
                f"data.root={tiny_data}",
                *RUN,
                f"init_from={foreign}",
                "optimizer.lr=0",
                f"hydra.run.dir={tmp_path / 'tuned'}",
            ],
            tmp_path,
        )
    )
    tuned = last(tmp_path / "tuned")
    assert tuned["progress"]["step"] == 4  # a fresh run: its own optimizer, schedule and step count
    for key, tensor in weights.items():
        assert torch.equal(tuned["model"][key], tensor), key


@pytest.mark.slow
def test_train_false_evaluates_a_checkpoint(tmp_path, tiny_data):
    ok(train([f"data.root={tiny_data}", *RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    result = ok(
        train(
            [
                f"data.root={tiny_data}",
                "logger=none",
                "train=false",
                f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'best.pt'}",
                f"hydra.run.dir={tmp_path / 'eval'}",
            ],
            tmp_path,
        )
    )
    (validation, test), (trained, tested_there) = (
        read_metrics(tmp_path / folder)[1] for folder in ("eval", "run")
    )
    assert validation["val/correct"] == trained["val/correct"]  # both splits, the same weights
    assert test["test/correct"] == tested_there["test/correct"]
    assert f"test acc {test['test/acc']:.4f}" in printed(result)
    assert not (tmp_path / "eval" / "checkpoints").exists()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_data) -> Path:
    """One trained run's folder, for the bad-checkpoint tests to spoil copies of."""
    folder = tmp_path_factory.mktemp("saved")
    ok(train([f"data.root={tiny_data}", *RUN, f"hydra.run.dir={folder / 'run'}"], folder))
    return folder / "run" / "checkpoints" / "last.pt"


class Command:
    """Pickled as a call of os.system: what a malicious checkpoint holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def bad_file(kind: str, saved: Path, folder: Path) -> Path:
    path = folder / f"{kind}.pt"
    if kind == "truncated":
        data = saved.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(b"not a checkpoint at all\n" * 10)
    elif kind == "pickle-dump":  # not torch.save's: unpickling it would run a command
        path.write_bytes(pickle.dumps({"model": Command(f"touch {folder / 'ran'}")}))
    elif kind == "protocol-4":  # torch.save's, in a pickle protocol weights_only does not read
        torch.save(load(saved)["model"], path, pickle_protocol=4)
    elif kind == "pickled-module":  # the whole model, as many tutorials save it
        torch.save(torch.nn.Linear(2, 2), path)
    elif kind == "malicious":  # unpickling it would run a command (os.system)
        torch.save({"model": Command(f"touch {folder / 'ran'}")}, path)
    elif kind == "not-a-checkpoint":
        torch.save({"epoch": 3, "notes": "weights elsewhere"}, path)
    elif kind == "other-architecture":
        state = load(saved)
        state["model"]["fc1.weight"] = torch.zeros(128, 784)
        torch.save(state, path)
    elif kind == "non-finite":  # a diverged run's weights, saved by a loop without our guard
        state = load(saved)
        state["model"]["fc2.bias"][3] = float("nan")
        torch.save(state, path)
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "does not exist: check the path (relative to "),
        ("truncated", "is not a readable checkpoint: truncated or corrupt (PytorchStreamReader"),
        ("garbage", "is not a file torch.save wrote (neither a zip archive nor torch's older "),
        ("pickle-dump", "is not a file torch.save wrote (neither a zip archive nor torch's older "),
        (
            "protocol-4",
            "holds a pickle that torch.load(weights_only=True) does not read "
            "(Unsupported operand 149): if you trust the file, load it yourself and save its "
            "model's state_dict() again with torch.save's default pickle_protocol.",
        ),
        ("pickled-module", "(torch.nn.modules.linear.Linear), not only tensors"),
        ("malicious", f"({os.system.__module__}.system), not only tensors"),
        ("not-a-checkpoint", "is not a checkpoint of this template: it has no model"),
        ("other-architecture", "fc1.weight 128×784 in the file, 512×784 in the model"),
        ("non-finite", "holds weights that are not finite (NaN or infinite values in fc2.bias)"),
    ],
)
def test_bad_checkpoints_stop_with_one_sentence(tmp_path, tiny_data, saved, kind, message):
    path = bad_file(kind, saved, tmp_path)
    result = train([f"data.root={tiny_data}", "logger=none", f"resume={path}"], tmp_path)
    assert result.returncode != 0
    assert message in printed(result) and "Traceback" not in printed(result), printed(result)
    assert str(path) in printed(result)
    assert not (tmp_path / "ran").exists(), "the file's command ran"
    assert "Detected pickle protocol" not in printed(result)  # torch's warning, before its error


@pytest.mark.parametrize("given", ["init_from", "train=false ckpt_path", "resume"])
def test_a_file_torch_save_did_not_write_is_named_so_unread(tmp_path, tiny_data, saved, given):
    """A plain pickle.dump whose unpickling would run a command, and a text file, given for any
    of the three: called what they are, with what to give instead; neither is unpickled, and no
    run folder is left."""
    run_dir = tmp_path / "run"
    wanted = "a last.pt or best.pt from a run folder's checkpoints/" + (
        "." if given == "resume" else ", or a model's state_dict() saved with torch.save."
    )
    for kind in ("pickle-dump", "garbage"):
        path = bad_file(kind, saved, tmp_path)
        before = path.read_bytes()
        overrides = [*given.split()[:-1], f"{given.split()[-1]}={path}"]
        result = train([f"data.root={tiny_data}", "logger=none", *overrides,
                        f"hydra.run.dir={run_dir}"], tmp_path)  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in printed(result), printed(result)
        assert (
            f"{path} is not a file torch.save wrote (neither a zip archive nor torch's older "
            f"format): give {wanted}" in printed(result)
        )
        assert "Detected pickle protocol" not in printed(result)
        assert not (tmp_path / "ran").exists() and path.read_bytes() == before
        assert not run_dir.exists()


@pytest.mark.unit
def test_the_reader_tells_torch_save_files_from_others(tmp_path):
    """_read, in-process: torch.save's files in both its formats (zip, and the one before PyTorch
    1.6) are read; a plain pickle and a text file are refused unread, an empty file is truncated."""
    weights = {"w": torch.arange(3.0)}
    for legacy in (False, True):
        path = tmp_path / f"legacy-{legacy}.pt"
        torch.save(weights, path, _use_new_zipfile_serialization=not legacy)
        assert torch.equal(_read(path)["w"], weights["w"])
    (tmp_path / "pickled.pt").write_bytes(pickle.dumps(weights))
    (tmp_path / "text.pt").write_text("hello\n" * 10)  # torch.load raised a KeyError on it
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, said in [
        ("pickled", "is not a file torch.save wrote"),
        ("text", "is not a file torch.save wrote"),
        ("empty", "is not a readable checkpoint: truncated or corrupt (it ends early)"),
    ]:
        with pytest.raises(UserError, match=re.escape(f"{tmp_path / name}.pt {said}")):
            _read(tmp_path / f"{name}.pt")


@pytest.mark.parametrize("nproc", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_a_resume_stops_before_training_where_its_best_pt_cannot_be_used(
    tmp_path, tiny_data, saved, nproc
):
    """last.pt intact, and the best.pt it records its best epoch in truncated or holding a Python
    object: one sentence naming both before any work (not after training, at the test), on every
    rank, the folder byte for byte as it was; best.pt moved away, as it says, the run goes on."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved.parent.parent, run_dir)
    best, last_pt = run_dir / "checkpoints" / "best.pt", run_dir / "checkpoints" / "last.pt"
    overrides = [f"data.root={tiny_data}", *RUN, "trainer.epochs=2", f"hydra.run.dir={run_dir}"]
    overrides += ["parallel=ddp"] if nproc else []
    for spoil, why in [
        ("truncated", "is not a readable checkpoint: truncated or corrupt (PytorchStreamReader "
         "failed reading zip archive: failed finding central directory)"),
        ("pickled-module", "holds Python objects (torch.nn.modules.linear.Linear), not only "
         "tensors and plain values"),
    ]:  # fmt: skip
        best.write_bytes(bad_file(spoil, saved, tmp_path).read_bytes())
        records = files(run_dir)
        result = train(overrides, tmp_path, nproc=nproc)
        assert result.returncode == 1
        assert (
            f"{last_pt} records its best epoch (1) in {best}, which {why}: delete or move {best} "
            f"to resume from {last_pt} (the best so far then starts afresh), or give resume= "
            "another checkpoint."
        ) in printed(result), printed(result)
        assert "val acc" not in printed(result) and "Training ended" not in printed(result)
        assert files(run_dir) == records
        if nproc:
            return  # the rest does not depend on the ranks
    # A run whose test takes the last weights reads no best.pt: it trains (and rewrites best.pt
    # when an epoch validates better), as it did.
    ok(train([*overrides, "trainer.test_weights=last", "trainer.epochs=1"], tmp_path))
    best.unlink()
    result = ok(train(overrides, tmp_path))
    assert "but no best.pt lies beside it: the best so far starts afresh" in printed(result)
    assert last(run_dir)["progress"]["step"] == 8


@pytest.mark.parametrize("kind", ["state dict", "tutorial dict"])
def test_evaluating_a_bare_state_dict_says_it_records_no_training(tmp_path, tiny_data, saved, kind):
    """train=false ckpt_path=<torch.save(model.state_dict())>, or a tutorial's {"model": ...,
    "epoch": 5} (an epoch, no step): the test line names the file's weights, not "the weights
    after epoch 0 (step 0)" as if untrained ones were tested."""
    path = tmp_path / "sd.pt"
    weights = load(saved)["model"]
    torch.save(weights if kind == "state dict" else {"model": weights, "epoch": 5}, path)
    before = path.read_bytes()
    overrides = [f"data.root={tiny_data}", "logger=none", "train=false", f"ckpt_path={path}",
                 f"hydra.run.dir={tmp_path / 'eval'}"]  # fmt: skip
    result = ok(train(overrides, tmp_path))
    assert (
        f"Test on the weights of {path}, which records no training progress: test loss"
        in printed(result)
    ), printed(result)
    assert "after epoch 0" not in printed(result) and path.read_bytes() == before


def test_an_evaluation_into_a_training_runs_folder_is_refused_and_changes_nothing(
    tmp_path, tiny_data, saved
):
    """train=false ckpt_path=<run>/checkpoints/best.pt hydra.run.dir=<run> would replace the run's
    metrics.jsonl and config with the evaluation's: refused, and the folder as it was (the run's
    .hydra/ files never moved in from run.pending/, train.log without the refused run's lines).
    An evaluation's own folder is evaluated into again (its records replaced)."""
    run_dir = saved.parent.parent
    records = files(run_dir)
    evaluate = ["logger=none", f"data.root={tiny_data}", "train=false", f"ckpt_path={saved}"]
    result = train([*evaluate, f"hydra.run.dir={run_dir}"], tmp_path)
    said = (
        f"{run_dir} holds a run's records (metrics.jsonl, config_resolved.yaml, .hydra/), which "
        "an evaluation (train=false) would replace with its own: give it a folder of its own "
        "(hydra.run.dir=...); ckpt_path can stay where it is."
    )
    assert result.returncode == 1 and said in printed(result), printed(result)
    assert files(run_dir) == records
    for _ in range(2):
        ok(train([*evaluate, f"hydra.run.dir={tmp_path / 'evaluated'}"], tmp_path))


@pytest.mark.parametrize("given", ["init_from", "train=false ckpt_path"])
def test_non_finite_weights_to_start_from_or_evaluate_are_named(tmp_path, tiny_data, saved, given):
    """Not a diverged loss ("try a lower optimizer.lr") nor chance-level figures and exit 0: the
    file's NaN, named before any work."""
    path = bad_file("non-finite", saved, tmp_path)
    overrides = [*given.split()[:-1], f"{given.split()[-1]}={path}"]
    result = train([f"data.root={tiny_data}", "logger=none", *overrides], tmp_path)
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert (
        f"{path} holds weights that are not finite (NaN or infinite values in fc2.bias): nothing "
        "can be trained from them or evaluated. Use an earlier checkpoint (best.pt is a second "
        "one), or start without it."
    ) in printed(result)
    assert "optimizer.lr" not in printed(result) and "test acc" not in printed(result)


def test_bad_checkpoint_under_ddp_stops_every_rank(tmp_path, tiny_data, saved):
    path = bad_file("truncated", saved, tmp_path)
    result = train(
        [f"data.root={tiny_data}", "logger=none", "parallel=ddp", f"init_from={path}"],
        tmp_path,
        nproc=2,
    )
    assert result.returncode != 0
    assert "is not a readable checkpoint" in printed(result)


def test_resume_auto_without_a_checkpoint_starts_fresh_and_mistakes_are_named(tmp_path, tiny_data):
    result = ok(train([f"data.root={tiny_data}", *RUN, "resume=auto"], tmp_path))
    assert "Resuming" not in printed(result)
    for overrides, message in [
        (["train=false"], "train=false evaluates a checkpoint: add ckpt_path=PATH."),
        (["ckpt_path=x.pt"], "use resume=PATH; to start from its weights, init_from=PATH"),
        (["checkpoint.every_n_steps=0"], "checkpoint.every_n_steps=0 is not allowed"),
    ]:
        result = train([f"data.root={tiny_data}", "logger=none", *overrides], tmp_path)
        assert result.returncode != 0 and message in printed(result), printed(result)


@pytest.mark.slow
def test_wandb_continues_the_same_run_on_resume(tmp_path, tiny_data):
    env = offline_env(HOME=str(tmp_path / "home"))
    overrides = [
        f"data.root={tiny_data}",
        "trainer.log_every_n_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"paths.log_dir={tmp_path}",
    ]
    command = [sys.executable, str(REPO / "train.py"), *overrides, *defaults_for_tests(overrides)]
    ok(run([*command, "trainer.epochs=1"], tmp_path, env=env))
    first_id = last(tmp_path / "run")["wandb_id"]
    ok(run([*command, "trainer.epochs=2"], tmp_path, env=env))
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(first_id) for r in runs), runs
    assert last(tmp_path / "run")["wandb_id"] == first_id


@pytest.mark.parametrize("scheduler", ["none", "step", "cosine", "onecycle"])
def test_continuing_for_more_epochs_replans_each_shipped_schedule(tmp_path, tiny_data, scheduler):
    """The README's "continues it for epochs 3 and 4": the resumed epochs train at the rates a
    fresh 4-epoch run has there (cosine's and onecycle's plans span the run: re-planned for 4
    epochs, stepped to where training stands), and the changed key is said in one line."""
    common = [f"data.root={tiny_data}", *RUN, f"scheduler={scheduler}"]
    fresh, continued = tmp_path / "fresh", tmp_path / "continued"
    ok(train([*common, "trainer.epochs=4", f"hydra.run.dir={fresh}"], tmp_path))
    ok(train([*common, "trainer.epochs=2", f"hydra.run.dir={continued}"], tmp_path))
    result = ok(train([*common, "trainer.epochs=4", f"hydra.run.dir={continued}"], tmp_path))
    assert "trainer.epochs 2 → 4 from this config" in printed(result)
    rates = [[m["lr"] for m in read_metrics(run)[0] if m["step"] > 8] for run in (fresh, continued)]
    assert len(rates[0]) == 8 and rates[1] == rates[0]
    if scheduler in ("cosine", "onecycle"):  # the plan of 2 epochs would have other rates here
        assert len(set(rates[0])) > 1


def test_a_resume_trains_with_the_changed_optimizer_settings_and_refuses_what_cannot_change(
    tmp_path, tiny_data
):
    """optimizer.lr and momentum changed on resume: the steps after it use them (not the
    checkpoint's), as config_resolved.yaml records, each said in one line. trainer.max_steps at
    or below the checkpoint's step: nothing left to train. Another optimizer class, seed or
    validation split: one sentence, before any work."""
    run_dir = tmp_path / "run"
    common = [f"data.root={tiny_data}", *RUN, f"hydra.run.dir={run_dir}"]
    ok(train([*common, "trainer.epochs=1"], tmp_path))
    changed = ["trainer.epochs=2", "optimizer.lr=0.5", "optimizer.momentum=0.9"]
    result = ok(train([*common, *changed], tmp_path))
    for line in ("optimizer.lr 0.01 → 0.5 from", "optimizer.momentum 0.0 → 0.9 from"):
        assert line in printed(result)
    steps = read_metrics(run_dir)[0]
    assert [m["lr"] for m in steps if m["step"] > 4] == [0.5] * 4
    assert last(run_dir)["optimizer"]["param_groups"][0]["momentum"] == 0.9
    assert "lr: 0.5" in (run_dir / "config_resolved.yaml").read_text()
    result = ok(train([*common, "trainer.epochs=2", "trainer.max_steps=3", *changed[1:]], tmp_path))
    assert (
        "Nothing left to train: the checkpoint is at the end of this run (trainer.max_steps=3 "
        "reached: 8 optimizer steps done)." in printed(result)
    )
    assert last(run_dir)["progress"]["step"] == 8 and len(read_metrics(run_dir)[0]) == 8
    result = ok(train([*common, "trainer.epochs=1", *changed[1:]], tmp_path))  # 2 epochs done
    assert (
        "Nothing left to train: the checkpoint is at the end of this run (2 epoch(s) done)."
        in printed(result)
    )
    checkpoint, records = run_dir / "checkpoints" / "last.pt", files(run_dir)
    for override, message in {
        "optimizer=adam": f"{checkpoint} was trained with torch.optim.SGD, and this config's "
        "optimizer is torch.optim.Adam: its state cannot continue in another optimizer. Resume "
        "with the checkpoint's optimizer, or start from its weights with a fresh one: "
        f"init_from={checkpoint}.",
        "seed=2": f"seed=2, and {checkpoint} was trained with seed=1: it decides which images "
        "train and validate, in what order, so it cannot change in a resumed run. Resume with "
        f"seed=1, or start a new run from its weights: init_from={checkpoint}.",
        "data.val_size=40": "data.val_size=40, and",
        "scheduler=onecycle": "scheduler.interval=step, and",
    }.items():
        result = train([*common, "trainer.epochs=3", override], tmp_path)
        assert result.returncode == 1 and message in printed(result), printed(result)
        assert "Traceback" not in printed(result)
    # Refused before it began: the folder as it was (the runs' .hydra/ files never moved in from
    # run.pending/, train.log without the refused runs' lines); into a new folder, no folder left
    # and no best.pt copied.
    assert files(run_dir) == records
    elsewhere = tmp_path / "elsewhere" / "run"
    refused = [*common, f"hydra.run.dir={elsewhere}", f"resume={checkpoint}", "optimizer=adam"]
    result = train(refused, tmp_path)
    assert result.returncode == 1 and "was trained with torch.optim.SGD" in printed(result)
    assert not elsewhere.parent.exists()


def test_a_mid_epoch_resume_with_another_batch_size_continues_at_the_same_image(
    tmp_path, tiny_data
):
    """A checkpoint 2 batches of 64 into epoch 1 (128 of its 200 images), resumed with batch
    size 32: 4 batches of 32 are done, and the epoch ends after the 72 images left (32, 32, 8).
    Batch size 48 does not divide 128: refused, with the sizes that do."""
    run_dir = tmp_path / "run"
    common = [f"data.root={tiny_data}", *RUN, f"hydra.run.dir={run_dir}", "trainer.epochs=1"]
    ok(train([*common, "trainer.max_steps=2", "checkpoint.every_n_steps=2"], tmp_path))
    assert (last(run_dir)["progress"]["epoch"], last(run_dir)["progress"]["epoch_step"]) == (1, 2)
    result = train([*common, "data.batch_size=48"], tmp_path)
    assert result.returncode == 1
    assert (
        "The checkpoint stands 128 images into epoch 1 (2 batches of 64), which "
        "data.batch_size=48 does not divide: resume with one that does (16, 32, 64), or from a "
        "checkpoint at the end of an epoch." in printed(result)
    )
    result = ok(train([*common, "data.batch_size=32"], tmp_path))
    assert "The checkpoint's 2 batches of 64 into epoch 1 are 4 batches of 32" in printed(result)
    assert "Resuming at epoch 1, after 4 of its batches, step 2" in printed(result)
    state = last(run_dir)
    assert (
        state["progress"]["epoch"],
        state["progress"]["epoch_step"],
        state["progress"]["step"],
    ) == (1, 7, 5)


# A last.pt written by the template before its checkpoint was made of parts that save their own
# state (commit 77da666), with this test's tiny data (make_dataset's defaults) and RUN_OF_OLD:
#   python train.py logger=none plots=false data.root=DATA data.val_size=50 model.hidden=4 \
#     optimizer.momentum=0.9 scheduler=step trainer.epochs=2 trainer.max_steps=6
# It stands after step 6, 2 batches into epoch 2, with SGD's momentum and StepLR's state.
OLD_CHECKPOINT = REPO / "tests" / "data" / "checkpoint-77da666" / "last.pt"
RUN_OF_OLD = ["logger=none", "model.hidden=4", "optimizer.momentum=0.9", "scheduler=step",
              "trainer.epochs=2"]  # fmt: skip


def test_a_checkpoint_written_before_this_layout_resumes_exactly(tmp_path, tiny_data):
    """Its weights, momentum, schedule, position in the epoch and random streams all continue:
    the resumed run ends with the weights of a run of this code never stopped."""
    common = [f"data.root={tiny_data}", *RUN_OF_OLD]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    ok(train([*common, f"hydra.run.dir={whole}"], tmp_path))
    result = ok(train([*common, f"resume={OLD_CHECKPOINT}", f"hydra.run.dir={resumed}"], tmp_path))
    assert "Resuming at epoch 2, after 2 of its batches, step 6" in printed(result)
    got, want = last(resumed), last(whole)
    # Its first 6 steps were computed on another machine (on this one, equal to the bit): float32
    # rounding of other kernels moves the weights by 1e-7 (conftest's WEIGHT_ATOL); a momentum,
    # a learning rate or a batch lost on resuming moves them by 1e-4 or more.
    for key, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][key], tensor, rtol=0, atol=WEIGHT_ATOL)
    for number, moments in want["optimizer"]["state"].items():
        torch.testing.assert_close(
            got["optimizer"]["state"][number], moments, rtol=0, atol=WEIGHT_ATOL
        )


@pytest.mark.unit
def test_a_resume_into_another_mode_says_so_in_one_line(caplog):
    """parallel=ddp's checkpoint resumed with parallel=none: one line for the mode, not one per
    key of ddp's that none lacks; a changed key of a group that kept its class still shows."""
    ddp = {"_target_": "src.engine.parallel.ddp.DDP", "find_unused_parameters": False,
           "bucket_cap_mb": 25.0, "static_graph": False}  # fmt: skip
    none = {"_target_": "src.engine.parallel.none.Single"}
    saved = {"parallel": ddp, "trainer": {"epochs": 2}}
    caplog.set_level(logging.INFO)
    check_changes(saved, {"parallel": none, "trainer": {"epochs": 4}}, "last.pt")
    assert [r.getMessage() for r in caplog.records] == [
        "parallel._target_ src.engine.parallel.ddp.DDP → src.engine.parallel.none.Single from "
        "this config",
        "trainer.epochs 2 → 4 from this config",
    ]
    # A group inside a group, both switched (a model's encoder of another class): the outer's
    # line alone, whatever the inner's name sorts as.
    for inner in ("Enc", "0", "encoder"):
        caplog.clear()
        old = {"_target_": "a.Net", inner: {"_target_": "a.Enc", "width": 4}}
        new = {"_target_": "b.Net", inner: {"_target_": "b.Enc", "depth": 2}}
        check_changes({"model": old}, {"model": new}, "last.pt")
        assert [r.getMessage() for r in caplog.records] == [
            "model._target_ a.Net → b.Net from this config"
        ], inner


@pytest.mark.unit
def test_what_a_checkpoint_holds_is_copied_to_the_cpu_keeping_its_structure():
    """on_cpu, which every save goes through: the same containers and values, a CPU tensor not
    copied. A GPU's tensors are checked in test_gpu."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = {"model": model.state_dict(), "rng": [{"python": (3, [1, 2], None)}], "step": 4}
    copied = on_cpu(state)
    assert copied.keys() == state.keys() and copied["rng"] == state["rng"] and copied["step"] == 4
    assert type(copied["model"]) is type(state["model"])
    assert all(copied["model"][k] is t for k, t in state["model"].items())  # on the CPU already


@pytest.mark.unit
@pytest.mark.parametrize("wrapper", ["none", "dp", "compile"])
def test_the_saved_state_dicts_are_a_plain_models_and_optimizers(tmp_path, wrapper):
    """The model's and optimizer's parts (torch.distributed.checkpoint's state dicts, in one
    process here, gathered under FSDP in tests/test_fsdp.py), written as a save writes them: read
    back by torch.load(weights_only=True) and loaded into a plain model and optimizer by their own
    load_state_dict, in anyone's code; and back into the parts, the moments continuing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    wrapped = {"none": model, "dp": torch.nn.DataParallel(model), "compile": torch.compile(model)}
    parts = {"model": Weights(wrapped[wrapper]), "optimizer": OptimizerState(optimizer, model)}
    torch.save({name: part.state_dict() for name, part in parts.items()}, tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert list(saved["model"]) == list(model.state_dict())  # no module. or _orig_mod.
    assert list(saved["optimizer"]["state"]) == [0, 1, 2, 3]  # numbered, as torch's own

    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    plain.load_state_dict(saved["model"])  # anyone's reading
    theirs = torch.optim.Adam(plain.parameters(), lr=0.1)
    theirs.load_state_dict(saved["optimizer"])
    for mine, yours in ((model, plain), (optimizer, theirs)):
        mine, yours = mine.state_dict(), yours.state_dict()
        torch.testing.assert_close(yours, mine, rtol=0, atol=0)

    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    again = torch.optim.Adam(fresh.parameters(), lr=0.2)
    Weights(fresh).load_state_dict(saved["model"])  # the engine's reading
    OptimizerState(again, fresh).load_state_dict(saved["optimizer"])
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    ours = again.state_dict()
    torch.testing.assert_close(ours["state"], optimizer.state_dict()["state"], rtol=0, atol=0)
    assert again.param_groups[0]["lr"] == 0.2  # this run's settings


@pytest.mark.unit
def test_a_parameter_the_checkpoint_holds_no_moments_of_starts_afresh():
    """A branch without a gradient before the save has no optimizer state in the file; loaded, it
    has none either (torch.distributed.checkpoint's load makes one for every parameter), so Adam's
    first step of it is its step 1, as in the run that was not interrupted."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model["used"](torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = OptimizerState(optimizer, model).state_dict()
    assert list(saved["state"]) == [0, 1]  # the used layer's weight and bias

    fresh = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "unused": torch.nn.Linear(3, 2)})
    again = torch.optim.Adam(fresh.parameters(), lr=0.1)
    OptimizerState(again, fresh).load_state_dict(saved)
    ours = again.state_dict()["state"]
    assert list(ours) == [0, 1]
    torch.testing.assert_close(ours, optimizer.state_dict()["state"], rtol=0, atol=0)
