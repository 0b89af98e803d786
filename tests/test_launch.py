"""Every way of launching DDP, for real: sweeps of self-launched DDP jobs, failures that stop every
process, the launchers' guards, the legacy launcher, and SLURM's launcher config."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TESTS,
    defaults_for_tests,
    offline_env,
    ok,
    read_metrics,
    readme_command,
    run,
    run_dirs,
    torchrun_through_shell,
    train,
    wandb_summary,
)
from hydra import compose, initialize_config_dir

from src.engine import config, launch  # noqa: F401 - config registers the schema conf/ composes from
from src.engine.errors import UserError


def processes_in(folder: Path) -> list[int]:
    """Processes still running with `folder` as their working directory (left-behind workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.readlink(entry / "cwd")) == folder:
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def printed(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_multirun_runs_each_job_as_its_own_ddp_group(tmp_path, tiny_data, mode):
    """The README's sweep of DDP jobs (and the same under FSDP), which test_readme leaves here.
    Each job starts its own processes, in the job's environment of the moment: a callback sets
    WANDB_MODE=disabled for the second job, whose workers then log nothing to wandb."""
    sweep = readme_command("python train.py -m parallel=ddp ").split()[2:]
    assert "optimizer.lr=0.1,0.01" in sweep
    env = offline_env(HOME=str(tmp_path / "home"), PYTHONPATH=TESTS)
    result = train(
        [
            *(w.replace("parallel=ddp", f"parallel={mode}") for w in sweep),
            f"data.root={tiny_data}",
            "trainer.max_steps=3",
            "trainer.log_every_n_steps=1",
            "+hydra.callbacks.mode._target_=user_models.WandbModeByJob",
        ],
        tmp_path,
        env=env,
    )
    ok(result)
    jobs = sorted((tmp_path / "outputs" / "multirun").glob("*/*/[0-9]*"))
    assert [job.name for job in jobs] == ["0", "1"]
    assert "Sweep summary" in printed(result) and (jobs[0].parent / "summary.csv").is_file()
    for job, lr in zip(jobs, [0.1, 0.01], strict=True):
        steps, evals = read_metrics(job)
        assert [m["lr"] for m in steps] == [lr] * 3 and evals
        assert f"{mode.upper()}: 2 processes" in (job / "train.log").read_text()
    assert len(list(jobs[0].glob("wandb/offline-run-*"))) == 1
    assert wandb_summary(jobs[0])["state"] == "finished"
    assert not list(jobs[1].glob("wandb/offline-run-*")), "WANDB_MODE=disabled in job 1"
    assert processes_in(tmp_path) == []


@pytest.mark.slow
def test_a_failing_multirun_job_leaves_no_process_behind(tmp_path, tiny_data):
    result = train(
        [
            "-m",
            f"data.root={tiny_data}",
            "logger=none",
            "parallel=ddp",
            "parallel.nproc_per_node=2",
            "trainer.max_steps=2",
            "data.batch_size=32,3",
        ],
        tmp_path,
    )
    assert result.returncode != 0
    assert "data.batch_size=3 does not divide over 2 processes" in printed(result)
    assert "Traceback" not in printed(result)
    first = sorted((tmp_path / "outputs" / "multirun").glob("*/*/0"))[0]
    assert read_metrics(first)[1], "the good job ran"
    assert processes_in(tmp_path) == []


def wait_until(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_killed_self_launched_worker_stops_the_run(tmp_path, tiny_data):
    """SIGKILL one of the processes `python train.py parallel=ddp` started: the others stop,
    the command fails within 30 s naming the rank, and no process is left, nor any folder in
    the temporary directory (the workers' error files)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir(parents=True)
    main = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            f"data.root={tiny_data}",
            "logger=none",
            "parallel=ddp",
            "parallel.nproc_per_node=2",
            "data.batch_size=8",
            "trainer.epochs=200",
            f"paths.log_dir={tmp_path / 'outputs'}",
            *defaults_for_tests([]),
        ],
        cwd=tmp_path,
        env=offline_env(TMPDIR=str(temporary)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: list((tmp_path / "outputs").rglob("last.pt")))
    workers = [
        p for p in children(main.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(workers) == 2
    killed = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    output, _ = main.communicate(timeout=60)
    assert time.monotonic() - killed < 30
    assert main.returncode != 0
    assert "rank 1: Signal 9 (SIGKILL)" in output, output
    wait_until(lambda: processes_in(tmp_path) == [], timeout=10)
    assert not [p for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "train-"))]


def test_under_torchrun_one_failing_rank_stops_every_rank(tmp_path, tiny_data):
    """Only rank 1 gets a bad value; rank 0 waits for it at the rendezvous until torchrun stops
    it. The command fails within 60 s (about 20 here, start included; rank 0 alone would wait
    parallel.timeout, 1,800 s) and shows rank 1's message."""
    rank_1_is_wrong = '[ "$RANK" = 1 ] && set -- "$@" data.subset=0'
    started = time.monotonic()
    result = run(
        torchrun_through_shell(
            rank_1_is_wrong,
            [f"data.root={tiny_data}", "logger=none", "parallel=ddp"],
            tmp_path / "outputs",
        ),
        cwd=tmp_path,
    )
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    output = printed(result)
    assert "data.subset=0 is not allowed" in output
    assert output.count("Root Cause") == 1 and "rank      : 1" in output, output
    assert processes_in(tmp_path) == []


def test_a_multirun_under_torchrun_is_told_once_and_quoted_by_torchruns_report(tmp_path, tiny_data):
    """`torchrun --nproc_per_node=2 train.py -m ...`: the sentence is printed once, by local rank
    0, and torchrun's report quotes it from rank 0's error file as the root cause; no run folder."""
    overrides = ["-m", "optimizer.lr=0.1,0.01", f"data.root={tiny_data}", "logger=none"]
    result = train(overrides, tmp_path, nproc=2)
    assert result.returncode == 1
    output = printed(result)
    sentence = (
        "Hydra multirun cannot run inside torchrun: every rank would start its own sweep. Run it "
        "without torchrun (each job starts its DDP processes): python train.py -m ..."
    )
    told, report = output.split("Failures:")
    assert told.count(sentence) == 1, output  # by local rank 0 alone, before torchrun's report
    root_cause = report.split("Root Cause")[1]
    assert "rank      : 0 (local_rank: 0)" in root_cause and sentence in root_cause
    assert "error_file: <N/A>" not in root_cause
    assert run_dirs(tmp_path) == []


@pytest.mark.slow
def test_a_bug_in_every_worker_is_shown_once_with_its_traceback(tmp_path, tiny_data):
    """Not a user mistake: a model whose forward raises a RuntimeError on every rank; one
    traceback, the first failing rank's, is printed."""
    overrides = [f"data.root={tiny_data}", "logger=none", "parallel=ddp",
                 "model._target_=user_models.Broken"]  # fmt: skip
    tests = str(Path(__file__).parent)  # user_models.py's folder
    result = run(
        torchrun_through_shell("true", overrides, tmp_path / "outputs"),
        cwd=tmp_path,
        env=offline_env(PYTHONPATH=tests),
    )
    assert result.returncode != 0
    output = printed(result)
    root_cause = output.split("Root Cause")[1]
    assert "Traceback" in root_cause and "RuntimeError: a bug in the model's forward" in root_cause
    assert "Error executing job" not in output  # not printed again by each rank
    assert processes_in(tmp_path) == []


def test_partial_distributed_environment_and_busy_port(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", "logger=none", "parallel=ddp"]
    env = offline_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    result = train(overrides, tmp_path, env=env)
    assert result.returncode != 0
    assert (
        "partial distributed environment: RANK, LOCAL_RANK, WORLD_SIZE set but MASTER_ADDR, "
        "MASTER_PORT missing" in printed(result)
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        result = train(overrides, tmp_path, env=env)
    assert result.returncode != 0
    assert f"Port {port} of the rendezvous (env://, MASTER_PORT) is in use" in printed(result)
    assert "Traceback" not in printed(result)


@pytest.mark.slow
def test_a_busy_port_of_a_tcp_rendezvous_is_one_sentence_self_launched(tmp_path, tiny_data):
    """Rank 0 hosts a tcp:// rendezvous under any launcher, and checks its port first."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        tcp = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        overrides = [f"data.root={tiny_data}", "logger=none", "parallel=ddp",
                     "parallel.nproc_per_node=2", f"parallel.init_method={tcp}"]  # fmt: skip
        result = train(overrides, tmp_path)
    assert result.returncode != 0
    busy = f"of the rendezvous (parallel.init_method={tcp}) is in use, probably by another run"
    assert printed(result).count(busy) == 1, printed(result)
    assert "Traceback" not in printed(result)


def test_a_tcp_rendezvous_on_torchruns_own_port_is_one_sentence(tmp_path, tiny_data):
    """`torchrun --master_port=P` with parallel.init_method=tcp://...:P: the port is busy with
    torchrun's own store, and rank 0 says to leave env://, which joins it; every rank stops."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tcp = f"tcp://127.0.0.1:{port}"
    outputs = tmp_path / "outputs"
    overrides = [f"data.root={tiny_data}", "logger=none", "parallel=ddp",
                 f"parallel.init_method={tcp}", f"paths.log_dir={outputs}"]  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={port}", str(REPO / "train.py"), *overrides,
               *defaults_for_tests(overrides)]  # fmt: skip
    result = run(command, cwd=tmp_path)
    assert result.returncode == 1
    told, report = printed(result).split("Failures:")
    sentence = (
        f"Port {port} of parallel.init_method={tcp} is torchrun's own rendezvous (--master_port): "
        "under torchrun leave parallel.init_method=env://, which joins it."
    )
    assert told.count(sentence) == 1 and sentence in report.split("Root Cause")[1], told + report
    assert printed(result).count("Traceback") == 1  # torchrun's own report's
    assert processes_in(tmp_path) == []


@pytest.mark.unit
@pytest.mark.parametrize(
    ("init_method", "message"),
    [
        ("file:///no/such/folder/rendezvous", "folder /no/such/folder does not exist"),
        ("tcp://nohost.invalid:29500", "host nohost.invalid is not known"),
    ],
)
def test_a_rendezvous_that_cannot_be_reached_is_named(init_method, message):
    """Checked on every rank before init_process_group, which would wait without a word (file://)
    or fail with C++ frames (tcp://)."""
    with pytest.raises(UserError, match=f"^parallel.init_method={init_method}: {message}"):
        launch.check_rendezvous(init_method)
    launch.check_rendezvous("env://")
    launch.check_rendezvous("tcp://127.0.0.1:29500")


DELAYED_START = """
import os, runpy, sys, time
if os.environ.get("LOCAL_RANK") == "1" or "--local-rank=1" in sys.argv:
    time.sleep(2)
args = sys.argv[1:]  # the legacy launcher puts --local-rank=N first: keep it, after the script
script = next(arg for arg in args if not arg.startswith("--"))
args.remove(script)
sys.argv, sys.path[0] = [script, *args], os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("torch.distributed.run", marks=pytest.mark.slow),  # and in test_train.py
        pytest.param("torch.distributed.launch", marks=pytest.mark.slow),
    ],
)
def test_ranks_starting_seconds_apart_share_one_run_folder(tmp_path, tiny_data, launcher):
    """torchrun and the legacy launcher (which appends --local-rank=N), rank 1 starting 2 s late
    (through a script that waits, then runs train.py with the arguments it was given)."""
    delayed = tmp_path / "delayed.py"
    delayed.write_text(DELAYED_START)
    result = ok(
        run(
            [
                sys.executable,
                "-m",
                launcher,
                "--nproc_per_node=2",
                str(delayed),
                str(REPO / "train.py"),
                f"data.root={tiny_data}",
                "logger=none",
                "parallel=ddp",
                "trainer.max_steps=2",
                f"paths.log_dir={tmp_path / 'outputs'}",
                *defaults_for_tests([]),
            ],
            cwd=tmp_path,
        )
    )
    (run_dir,) = run_dirs(tmp_path)
    assert read_metrics(run_dir)[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delayed.py", "outputs"]
    legacy = "torch.distributed.launch is deprecated; launch with torchrun"
    assert printed(result).count(legacy) == int(launcher == "torch.distributed.launch")


@pytest.mark.unit
@pytest.mark.extra("slurm")
def test_slurm_launcher_config_composes():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=slurm", "parallel=ddp", "parallel.nproc_per_node=4"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    )
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (1, 1, 4)


@pytest.mark.unit
@pytest.mark.extra("slurm")
@pytest.mark.parametrize("mode", ["parallel=none", "parallel=dp", "parallel=fsdp", "parallel=ddp"])
def test_a_slurm_job_asks_for_a_gpu_in_every_mode(mode):
    """A job that would ask for none trains on the node's CPU (device=auto) without a word: every
    mode asks for one GPU at least, one per process where parallel.nproc_per_node says."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", mode],
                      return_hydra_config=True)  # fmt: skip
    assert cfg.hydra.launcher.gpus_per_node == 1


@pytest.mark.slow
@pytest.mark.extra("slurm")
def test_jobs_through_the_submitit_launcher_run_ddp(tmp_path, tiny_data):
    """The README's command for the SLURM launcher's machinery without SLURM: submitit's local
    executor runs each job (a pickled Hydra job in a new process), which starts its own 2 DDP
    processes."""
    sweep = readme_command("python train.py -m hydra/launcher=submitit_local ").split()[2:]
    assert {"parallel=ddp", "parallel.nproc_per_node=2", "optimizer.lr=0.1,0.01"} <= set(sweep)
    result = train(
        [*sweep, f"data.root={tiny_data}", "logger=none", "trainer.max_steps=2"], tmp_path
    )
    ok(result)
    jobs = sorted((tmp_path / "outputs" / "multirun").glob("*/*/[0-9]*"))
    assert [job.name for job in jobs] == ["0", "1"]
    assert all(read_metrics(job)[1] for job in jobs)


# A job's process as a launcher that pickles by value leaves it (submitit does so with train.py's
# functions): the training function arrives as a pickle of its code, not as a reference to
# src/engine/app.py, and this process hands it to the self-launched DDP workers.
BY_VALUE_JOB = """
import pickle, sys
import hydra
from src.engine import config, launch  # config: the schema conf/config.yaml starts from

@hydra.main(version_base="1.3", config_path={conf!r}, config_name="config")
def job(cfg):
    train = pickle.loads(open({payload!r}, "rb").read())
    # By reference, it would be the module's own function (the sweep's Hydra callback imports it).
    module = sys.modules.get("src.engine.app")
    assert train is not getattr(module, "train", None), "the function was pickled by reference"
    print("rank 0 returned", launch.start_workers(train, cfg, cfg.parallel.nproc_per_node))

if __name__ == "__main__":  # the DDP workers import this file too
    job()
"""


@pytest.mark.slow
def test_a_training_function_pickled_by_value_runs_self_launched_ddp(tmp_path, tiny_data):
    """Whatever cloudpickle is installed: the workers import the function by module and name,
    never from the file its code object names (cloudpickle 3.1.3 names '<dynamic-code>'). The
    workers' error files leave no folder behind in the temporary directory."""
    payload, script, temporary = tmp_path / "train.pkl", tmp_path / "job.py", tmp_path / "tmp"
    temporary.mkdir()
    pickle_it = (
        "import cloudpickle, src.engine.app; cloudpickle.register_pickle_by_value(src.engine.app); "
        f"open({str(payload)!r}, 'wb').write(cloudpickle.dumps(src.engine.app.train))"
    )
    env = offline_env(PYTHONPATH=str(REPO))
    ok(run([sys.executable, "-c", pickle_it], cwd=tmp_path, env=env))
    script.write_text(BY_VALUE_JOB.format(conf=str(REPO / "conf"), payload=str(payload)))
    overrides = [
        f"data.root={tiny_data}", "logger=none", "parallel=ddp", "parallel.nproc_per_node=2",
        "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", *defaults_for_tests([]),
    ]  # fmt: skip
    env["TMPDIR"] = str(temporary)
    result = ok(run([sys.executable, str(script), *overrides], cwd=tmp_path, env=env))
    assert not [p for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "train-"))]
    assert "rank 0 returned" in result.stdout
    assert "DDP: 2 processes" in printed(result)
    assert read_metrics(tmp_path / "run")[1], "the job trained and evaluated"


@pytest.mark.unit
def test_a_function_workers_could_not_import_is_refused_before_any_process_starts():
    from src.engine.app import train as run_train
    from src.engine.launch import importable_name

    assert importable_name(run_train) == ("src.engine.app", "train")
    with pytest.raises(ValueError, match="import the training function by module and name"):
        importable_name(lambda cfg: None)


@pytest.mark.slow
def test_parallel_timeout_bounds_a_collective_waiting_for_a_frozen_rank(tmp_path, tiny_data):
    """Rank 1 is frozen (SIGSTOP) during training: rank 0's next collective fails after
    parallel.timeout=5 seconds instead of waiting the default 30 minutes."""
    # Frozen once rank 0 has logged training losses, however long the start took on this machine;
    # the file `frozen` marks the moment. Thawed once rank 0 has ended (its timeout is then
    # measured), so that it takes the SIGTERM torchrun sent it instead of torchrun's SIGKILL 30 s
    # later; the thawing shell ignores that SIGTERM, which torchrun sends the worker's whole group.
    training = "[ $(cat outputs/*/*/metrics.jsonl 2>/dev/null | wc -l) -ge 2 ]"
    # Ended: gone, or a zombie that torchrun has not reaped yet (its state in /proc is Z).
    rank_0_ended = "s=$(cut -d' ' -f3 /proc/$(cat pid-0)/stat 2>/dev/null); [ \"${s:-Z}\" = Z ]"
    freeze_rank_1 = (
        'echo $$$$ > pid-$RANK; if [ "$RANK" = 1 ]; then (until '
        f"{training}; do sleep 0.1; done; touch frozen; kill -STOP $$$$; trap '' TERM; "
        f"until {rank_0_ended}; do sleep 0.1; done; kill -CONT $$$$) & fi"
    )
    overrides = [
        f"data.root={tiny_data}",
        "logger=none",
        "parallel=ddp",
        "parallel.timeout=5",
        "data.batch_size=8",
        "trainer.epochs=1000",
    ]
    result = run(
        torchrun_through_shell(freeze_rank_1, overrides, tmp_path / "outputs"), cwd=tmp_path
    )
    assert result.returncode != 0
    assert "Timed out waiting 5000ms" in printed(result).split("Root Cause")[1]
    # From the freeze: 5 s to the timeout, then rank 1 ends within its own 5 s; 90 s leaves a
    # loaded machine room, and is far from the default's 1,800 s.
    assert time.time() - (tmp_path / "frozen").stat().st_mtime < 90
    assert processes_in(tmp_path) == []
