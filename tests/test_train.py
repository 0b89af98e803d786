"""Real training runs: python train.py and torchrun subprocesses (gloo on CPU) on tiny IDX files."""

import base64
import csv
import hashlib
import json
import math

import pytest
import torch
from conftest import (
    REPO,
    TESTS,
    assert_identical,
    offline_env,
    ok,
    printed,
    read_metrics,
    read_test,
    run,
    single_run,
    torchrun_through_shell,
    train,
    wandb_records,
    wandb_summary,
)

SMOKE = ["logger=none", "trainer.epochs=2", "trainer.log_every_n_steps=1"]


def test_parallel_none_trains_and_writes_metrics(tmp_path, tiny_data, recwarn):
    result = ok(train([f"data.root={tiny_data}", *SMOKE], tmp_path))
    # No Hydra callback failed (Hydra turns its exception into a warning): in a process of its
    # own on stderr, in this one (TESTS_IN_SUBPROCESSES unset) recorded by pytest.
    failed = [str(w.message) for w in recwarn if "Callback" in str(w.message)]
    assert not failed and "Callback" not in printed(result), failed
    run_dir = single_run(tmp_path)
    steps, evals = read_metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, 9))  # 2 epochs of ceil(200 / 64) = 4 steps
    assert {m["epoch"] for m in steps} == {1, 2}
    validations, test = evals[:-1], read_test(run_dir)
    assert [m["epoch"] for m in validations] == [1, 2]
    assert all(set(m) >= {"step", "epoch", "train/loss"} for m in steps)
    assert all(set(m) >= {"epoch", "val/loss", "val/acc", "val/correct"} for m in validations)
    assert set(test) >= {"test/loss", "test/acc", "test/correct", "test/weights_epoch"}
    assert test["test/acc"] > 0.5  # the synthetic classes are easy to tell apart
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # nothing else written


def test_max_steps_and_subset(tmp_path, tiny_data):
    ok(
        train(
            [
                f"data.root={tiny_data}",
                *SMOKE,
                "trainer.max_steps=3",
                "data.subset=64",
                "data.batch_size=32",
            ],
            tmp_path,
        )
    )
    steps, evals = read_metrics(single_run(tmp_path))
    # 64 images in batches of 32 are 2 steps per epoch: step 3 is in epoch 2, then it stops.
    assert [(m["step"], m["epoch"]) for m in steps] == [(1, 1), (2, 1), (3, 2)]
    assert [(m["step"], m["epoch"]) for m in evals] == [(2, 1), (3, 2), (3, 2)]  # and the test


def test_best_pt_follows_the_monitor_and_test_weights_picks_what_is_tested(tmp_path, tiny_data):
    """best.pt holds the epoch whose validation is best by checkpoint.monitor and mode (here the
    validation loss falls every epoch, so min and max pick different ends), the test is of its
    weights, and trainer.test_weights=last tests the final weights instead. checkpoint.mode left
    null follows the task's way for val/loss (min); max, the other end, is a fork's task that does
    not say which way is better (the shipped one refuses it: test_config)."""
    overrides = [
        f"data.root={tiny_data}",
        *SMOKE,
        "trainer.epochs=4",
        "checkpoint.monitor=val/loss",
    ]
    says_no_modes = ["task._target_=user_models.SaysNoModes", "checkpoint.mode=max"]
    runs = {}
    for name, extra in {
        "min": [],
        "max": says_no_modes,
        "max-last": [*says_no_modes, "trainer.test_weights=last"],
    }.items():
        ok(train([*overrides, *extra], tmp_path / name, env=offline_env(PYTHONPATH=TESTS)))
        runs[name] = single_run(tmp_path / name)
    validations = read_metrics(runs["min"])[1][:-1]
    losses = [m["val/loss"] for m in validations]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == 4
    for mode, epoch in (("min", 4), ("max", 1)):
        saved = torch.load(runs[mode] / "checkpoints" / "best.pt", weights_only=True)
        assert saved["progress"]["epoch"] == saved["progress"]["best"]["epoch"] == epoch, mode
        assert saved["progress"]["best"]["value"] == losses[epoch - 1]
        assert read_test(runs[mode])["test/weights_epoch"] == epoch
    assert read_test(runs["max-last"])["test/weights_epoch"] == 4
    assert read_test(runs["max-last"])["test/loss"] == read_test(runs["min"])["test/loss"]
    assert read_test(runs["max-last"])["test/loss"] != read_test(runs["max"])["test/loss"]


def test_without_a_validation_split_nothing_is_selected_and_the_test_comes_once(
    tmp_path, tiny_data
):
    """data.val_size=0 (pytorch/examples' protocol): no validations, no best.pt, and the test
    split once, on the final weights."""
    ok(train([f"data.root={tiny_data}", *SMOKE, "data.val_size=0"], tmp_path))
    run_dir = single_run(tmp_path)
    steps, evals = read_metrics(run_dir)
    assert steps[-1]["step"] == 8  # 250 training images in batches of 64: 4 steps an epoch
    assert evals == [read_test(run_dir)] and evals[0]["test/weights_epoch"] == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.pt"]
    assert (
        torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["best"]
        is None
    )


def test_dp_without_gpus_warns_once_and_trains_like_none(tmp_path, tiny_data):
    ok(train([f"data.root={tiny_data}", *SMOKE], tmp_path / "none"))
    result = ok(train([f"data.root={tiny_data}", *SMOKE, "parallel=dp"], tmp_path / "dp"))
    assert (result.stdout + result.stderr).count("parallel=dp needs CUDA GPUs") == 1
    assert read_metrics(single_run(tmp_path / "dp")) == read_metrics(single_run(tmp_path / "none"))


def test_ddp_batch_size_must_divide(tmp_path, tiny_data):
    """Every rank finds the mistake; rank 0 says it after the run's log, torchrun's report quotes
    it once, as rank 0's, its root cause, and the other rank's entry points to it. The config's
    parallel.nproc_per_node, which torchrun's count overrides, is said to be unused, once."""
    overrides = ["parallel=ddp", "parallel.nproc_per_node=3", "data.batch_size=63"]
    result = train([f"data.root={tiny_data}", "logger=none", *overrides], tmp_path, nproc=2)
    assert result.returncode != 0
    unused = "parallel.nproc_per_node=3 is not used: the launcher started 2 processes on this "
    assert printed(result).count(unused) == 1
    said, report = printed(result).split("FAILED\n")  # the workers' output, torchrun's report
    for text in (said, report):
        assert text.count("data.batch_size=63 does not divide over 2 processes") == 1, text
    other, root_cause = report.split("Root Cause")
    assert "rank      : 0 (local_rank: 0)" in root_cause and "does not divide" in root_cause
    assert "stopped: local rank 0 failed first, with the same mistake (the root cause)" in other


def test_a_batch_that_the_processes_cannot_share_is_refused_before_they_start(tmp_path, tiny_data):
    """Self-launched, the batch size is checked against the processes to start, before any is."""
    overrides = ["parallel=ddp", "parallel.nproc_per_node=3", "data.batch_size=64"]
    result = train([*overrides, f"data.root={tiny_data}", "logger=none"], tmp_path)
    assert result.returncode != 0
    assert "data.batch_size=64 does not divide over 3 processes: use a multiple of 3" in (
        result.stderr
    )
    assert "Starting 3 processes" not in printed(result) and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("overrides", "nproc", "message"),
    [
        ([], 2, "torchrun started 2 processes, but parallel=none trains in one"),
        pytest.param(
            ["parallel=ddp", "parallel.backend=nccl"],
            2,
            "parallel.backend=nccl needs CUDA GPUs",
            marks=pytest.mark.slow,  # the same check as self-launched, under torchrun
        ),
        (["parallel=ddp", "parallel.backend=nccl"], None, "parallel.backend=nccl needs CUDA GPUs"),
        (["device=cuda"], None, "device=cuda, but no CUDA GPU is visible"),
        pytest.param(
            ["-m", "optimizer.lr=0.1,0.01"],
            2,
            "Hydra multirun cannot run inside torchrun",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_wrong_launch_says_what_to_do(tmp_path, tiny_data, overrides, nproc, message):
    result = train([*overrides, f"data.root={tiny_data}", "logger=none"], tmp_path, nproc=nproc)
    assert result.returncode != 0
    assert message in result.stderr
    if nproc is None:
        assert "Traceback" not in result.stderr


def test_ddp_ranks_starting_seconds_apart_share_one_run_folder_and_wandb_run(tmp_path, tiny_data):
    """Rank 1 starts 2 s after rank 0, so `${now:...}` differs between them: still one folder."""
    env = offline_env(HOME=str(tmp_path / "home"))  # no netrc nor WANDB_API_KEY: offline
    overrides = [
        f"data.root={tiny_data}",
        "parallel=ddp",
        "trainer.log_every_n_steps=1",
        "logger.log_checkpoints=true",
    ]
    delayed_start = '[ "$LOCAL_RANK" = 1 ] && sleep 2'
    ok(
        run(
            torchrun_through_shell(delayed_start, overrides, tmp_path / "outputs"),
            cwd=tmp_path,
            env=env,
        )
    )
    run_dir = single_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "outputs"]  # nothing in the cwd
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1
    assert not list(REPO.glob("wandb"))
    summary = wandb_summary(run_dir)
    _, evals = read_metrics(run_dir)
    best = max(evals[:-1], key=lambda m: m["val/acc"])  # the first of equals, as best.pt
    assert summary["state"] == "finished"
    test = read_test(run_dir)
    assert summary["summary"]["test/acc"] == test["test/acc"]
    # The monitor's best value and its last, by wandb's define_metric; the epoch it was reached.
    assert summary["summary"]["val/acc"] == {"max": best["val/acc"], "last": evals[-2]["val/acc"]}
    assert summary["summary"]["best/epoch"] == test["test/weights_epoch"] == best["epoch"]
    assert summary["summary"]["step"] == evals[-1]["step"]  # every chart's x-axis: our step
    assert summary["config"]["data"]["batch_size"] == 64  # the resolved Hydra config
    # Named by task_name and the command line's overrides, as Hydra recorded them; no group
    # (not a sweep), a training run.
    assert summary["name"].startswith(f"train data.root={tiny_data} parallel=ddp "), summary["name"]
    (started,) = wandb_records(run_dir, "run")
    assert (started.get("run_group"), started["job_type"]) == (None, "train")
    metrics = {m.get("name") or m["glob_name"]: m for m in wandb_records(run_dir, "metric")}
    assert metrics["*"]["step_metric"] == "step"
    assert metrics["val/acc"]["summary"] == {"max": True, "last": True}
    # logger.log_checkpoints=true: best.pt and last.pt, as the run left them, from rank 0 alone.
    artifacts = wandb_records(run_dir, "artifact")
    logged = {
        a: x["manifest"]["contents"] for x in artifacts for a in {"best", "last"} & {*x["aliases"]}
    }
    assert sorted(logged) == ["best", "last"] and len(artifacts) == 2
    for alias, (content,) in logged.items():
        path = run_dir / "checkpoints" / f"{alias}.pt"
        md5 = base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()
        assert (content["path"], content["digest"]) == (path.name, md5)


def test_multirun_jobs_get_their_own_folder_and_wandb_run(tmp_path, tiny_data):
    """A sweep with a job that fails once its wandb run has started (a rate so large that its
    loss is not finite): the others complete, the failure is reported, wandb finished. A
    process of its own: the sweep's summary of a failed sweep is printed as the process exits."""
    env = offline_env(HOME=str(tmp_path))
    sweep = ["optimizer.lr=0.01,1e30", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]
    result = train(["-m", f"data.root={tiny_data}", *sweep], tmp_path, env=env, own_process=True)
    assert result.returncode != 0
    assert "Stopped: the training loss was not finite at step" in result.stderr
    jobs = sorted((tmp_path / "outputs" / "multirun").glob("*/*/[0-9]*"))
    assert [j.name for j in jobs] == ["0", "1"]
    good, bad = jobs
    assert read_metrics(good)[1], "the good job evaluated"
    assert len(list(good.glob("wandb/offline-run-*"))) == 1
    assert len(list(bad.glob("wandb/offline-run-*"))) == 1
    assert (wandb_summary(good)["state"], wandb_summary(bad)["state"]) == ("finished", "failed")
    # One group for the sweep's jobs, named by task_name and the sweep's folder.
    runs = [wandb_records(job, "run")[0] for job in jobs]
    sweep = good.parent.relative_to(tmp_path / "outputs")
    assert [(r["run_group"], r["job_type"]) for r in runs] == [(f"train {sweep}", "train")] * 2
    assert not wandb_records(good, "artifact")  # logger.log_checkpoints=false, the default
    with (good.parent / "summary.csv").open() as file:  # the sweep's summary, best job first
        rows = list(csv.DictReader(file))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "failed")]
    assert rows[0]["monitor"] == "val/acc" and rows[1]["best"] == ""
    assert float(rows[0]["best"]) == max(m["val/acc"] for m in read_metrics(good)[1][:-1])
    assert float(rows[0]["test/acc"]) == read_test(good)["test/acc"]
    assert "data.val_size=50" in rows[0]["overrides"] and float(rows[0]["wall_s"]) > 0
    assert result.stdout.count("Sweep summary") == 1  # printed also when a job failed


@pytest.mark.unit
@pytest.mark.parametrize(("mode", "order"), [("max", [2, 0, 1, 3]), ("min", [1, 0, 2, 3])])
def test_sweep_summary_ranks_jobs_by_the_monitor_never_by_the_test(tmp_path, mode, order):
    """summary.csv: the best value of checkpoint.monitor first, as its mode says; a job without
    one (failed, or no validation split) last. The test accuracy plays no part."""
    from src.engine.app import _write

    values = [(0.5, 0.99), (0.4, 0.98), (0.7, 0.10), (None, None)]  # (best, test/acc) per job
    for job, (best, test_acc) in enumerate(values):
        (tmp_path / str(job)).mkdir()
        record = {"job": job, "overrides": "", "monitor": "val/loss", "best": best, "mode": mode,
                  "best_epoch": 1, "test/acc": test_acc, "test/loss": None, "wall_s": 1.0,
                  "status": "completed", "folder": ""}  # fmt: skip
        (tmp_path / str(job) / "job.json").write_text(json.dumps(record))
    assert [job["job"] for job in _write(tmp_path)] == order
    with (tmp_path / "summary.csv").open() as file:
        assert [int(row["job"]) for row in csv.DictReader(file)] == order


@pytest.mark.slow
def test_torch_loader_trains_exactly_like_the_tensor_loader(tmp_path, tiny_data):
    """data.loader=torch with 2 worker processes: the same metrics, to the last bit."""
    metrics = {}
    for name, extra in {"tensor": [], "torch": ["data.loader=torch", "data.num_workers=2"]}.items():
        ok(train([f"data.root={tiny_data}", *SMOKE, *extra], tmp_path / name))
        metrics[name] = read_metrics(single_run(tmp_path / name))
    assert metrics["torch"] == metrics["tensor"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "model"),
    # float16 convolutions crawl on a CPU (about 8 s a step here): float16 trains the MLP.
    [("bf16", "cnn"), ("16", "mlp")],
)
def test_mixed_precision_trains(tmp_path, tiny_data, precision, model):
    """bf16 autocast, and float16 autocast with its gradient scaler (saved for resuming)."""
    overrides = [
        f"data.root={tiny_data}",
        *SMOKE,
        f"model={model}",
        "optimizer=adam",
        "trainer.epochs=3",
    ]
    ok(train([*overrides, f"trainer.precision={precision}"], tmp_path / precision))
    ok(train(overrides, tmp_path / "32"))
    (steps, evals), (steps32, _) = (
        read_metrics(single_run(tmp_path / p)) for p in (precision, "32")
    )
    # Trains about as well as float32 (the CNN's loss falls from 2.3 to 0.68); not the same bits.
    assert steps[-1]["train/loss"] < 0.4 * steps[0]["train/loss"]
    assert steps != steps32
    saved = torch.load(single_run(tmp_path / precision) / "checkpoints" / "last.pt")
    assert bool(saved["scaler"]) == (precision == "16")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "model"), [("bf16", "mlp"), ("16", "mlp"), ("bf16", "cnn_bn")]
)
def test_fsdp_mixed_precision_trains_what_ddp_trains(tmp_path, tiny_data, precision, model):
    """FSDP's MixedPrecisionPolicy (float32 shards, forward and backward in the low precision,
    BatchNorm in float32) against DDP's autocast, 2 processes each: the same losses within that
    precision's rounding (debug=equivalence's 1e-2), float32 weights saved, and float16's
    sharded scaler saved. The BatchNorm CNN's training on the tiny data is so unstable that
    bf16's rounding alone moves later losses by 10% (one process: 1.87 against float32's 2.16),
    so its comparison is of the first step's, from the same weights."""
    overrides = [f"data.root={tiny_data}", *SMOKE, "optimizer=adam", f"model={model}"]
    overrides.append(f"trainer.precision={precision}")
    for mode in ("ddp", "fsdp"):
        ok(train([*overrides, f"parallel={mode}"], tmp_path / mode, nproc=2))
    (steps, _), (reference, _) = (read_metrics(single_run(tmp_path / m)) for m in ("fsdp", "ddp"))
    assert len(steps) == len(reference) > 1
    compared = zip(steps, reference, strict=True)
    for ours, ref in list(compared)[: 1 if model == "cnn_bn" else None]:
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-2), (ours, ref)
    assert all(math.isfinite(m["train/loss"]) for m in steps)
    saved = torch.load(single_run(tmp_path / "fsdp") / "checkpoints" / "last.pt")
    assert {t.dtype for t in saved["model"].values()} <= {torch.float32, torch.int64}
    assert bool(saved["scaler"]) == (precision == "16")


@pytest.mark.slow
def test_channels_last_cnn_trains_like_the_default_layout(tmp_path, tiny_data):
    """Without dropout (whose masks follow the memory layout), only float noise differs."""
    overrides = [
        f"data.root={tiny_data}",
        *SMOKE,
        "model=cnn",
        "model.dropout1=0",
        "model.dropout2=0",
    ]
    ok(train([*overrides, "trainer.channels_last=true"], tmp_path / "channels_last"))
    ok(train(overrides, tmp_path / "default"))
    (steps, _), (reference, _) = (
        read_metrics(single_run(tmp_path / name)) for name in ("channels_last", "default")
    )
    for ours, ref in zip(steps, reference, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-4), (ours, ref)


def warmed_up_and_plain(tmp_path, overrides, nproc=None):
    """The same run with and without trainer.warmup_steps: metrics.jsonl lines and last.pt."""
    runs = {}
    for name, extra in {"warm": ["trainer.warmup_steps=2"], "plain": []}.items():
        ok(train([*overrides, *extra], tmp_path / name, nproc=nproc))
        lines = [
            json.loads(line)
            for line in (single_run(tmp_path / name) / "metrics.jsonl").read_text().splitlines()
        ]
        saved = torch.load(single_run(tmp_path / name) / "checkpoints" / "last.pt")
        runs[name] = lines, saved
    return runs["warm"], runs["plain"]


def without_timings(lines):
    return [m for m in lines if not any(key.startswith(("time/", "memory/")) for key in m)]


@pytest.mark.slow
def test_warm_up_steps_are_undone(tmp_path, tiny_data):
    """Dropout, Adam's moments, a step-wise schedule: training after the warm-up is the same, to
    the last bit, as training without one; the warm-up's time is logged apart."""
    # 200 training images = 4 batches of 48 and a last one of 8, another shape to warm up.
    overrides = [f"data.root={tiny_data}", *SMOKE, "model=cnn", "optimizer=adam",
                 "scheduler=onecycle", "data.batch_size=48"]  # fmt: skip
    (warm, saved_warm), (plain, saved_plain) = warmed_up_and_plain(tmp_path, overrides)
    assert [m["step"] for m in warm if "time/warmup_s" in m] == [0]
    assert without_timings(warm) == without_timings(plain)
    for key in ("model", "optimizer", "scheduler", "rng"):
        assert_identical(saved_warm[key], saved_plain[key], key)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_compiled_model_under_ddp_trains_saves_plain_weights_and_undoes_its_warm_up(
    tmp_path, tiny_data, mode
):
    """torch.compile inside DDP's wrapper (around FSDP's), 2 processes: the losses of one eager
    process (which 2 eager processes train, to float32 rounding: tests/test_equivalence.py), no
    _orig_mod. prefix; and trained after 2 warm-up steps, the same run to the bit, the momentum
    buffers included."""
    overrides = [f"data.root={tiny_data}", *SMOKE, "optimizer.momentum=0.9"]
    compiled = [*overrides, f"parallel={mode}", "trainer.compile=true"]
    (warm, saved_warm), (plain, saved_plain) = warmed_up_and_plain(tmp_path, compiled, nproc=2)
    assert without_timings(warm) == without_timings(plain)
    for key in ("model", "optimizer", "rng"):
        assert_identical(saved_warm[key], saved_plain[key], key)
    assert list(saved_plain["model"]) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    ok(train(overrides, tmp_path / "eager"))
    reference, _ = read_metrics(single_run(tmp_path / "eager"))
    steps = [m for m in plain if "train/loss" in m]
    assert len(steps) == len(reference) == 8
    for ours, ref in zip(steps, reference, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-4), (ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_pictures_of_the_run_are_drawn_and_logged_to_wandb(tmp_path, tiny_data, mode):
    """curves.png and predictions.png by rank 0 of a DDP run, also logged to the wandb run (under
    FSDP every rank runs the predictions' forward, a collective)."""
    env = offline_env(HOME=str(tmp_path / "home"))
    overrides = ["data=fashion_mnist", f"data.root={tiny_data}", f"parallel={mode}", "plots=true"]
    ok(train(overrides, tmp_path, nproc=2, env=env))
    run_dir = single_run(tmp_path)
    for picture in ("curves.png", "predictions.png"):
        assert (run_dir / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = wandb_summary(run_dir)["summary"]
    assert {"curves", "predictions"} <= set(summary), summary
