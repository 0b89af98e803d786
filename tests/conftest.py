"""Shared test helpers: tiny datasets in the real IDX format, and running train.py for real."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import logging
import math
import os
import re
import runpy
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Two tests run at a time here (pytest_cmdline_main, below), each with its processes, on a machine
# of few cores: every process computes on one thread, as torchrun's workers do, rather than one
# per core waiting for cores the other test holds (that cost the main tier 15% of its CPU time on
# 2 cores). Set before torch is imported, so it holds in this process and in those it starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
TESTS = str(REPO / "tests")  # on PYTHONPATH, runs import tests/user_models.py's models
CONF = REPO / "conf"
README = (REPO / "README.md").read_text()
# Where commands are shown: the README, and the pages its depth moved to.
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/README.md"]
# The training files hold 250 images: 50 held out for validation (data.val_size, as train() sets
# it) and 200 to train on, 3 global batches of 64 and a partial one of 8.
TRAIN_SIZE, VAL_SIZE, TEST_SIZE = 200, 50, 100

# What float32 rounding moves when the sums of a run are taken in another order (other ranks,
# micro-batches), for tests/test_equivalence.py's recipe (27 steps of the MLP) and the others':
# - A training loss, by an absolute amount: the mean of a batch's per-sample losses rounds in its
#   last bits, and a loss near zero is still computed from logits of size ~10 (logsumexp(z) - z_y),
#   whose rounding does not shrink with the loss. So the bound is 4 float32 ulps at the first
#   loss, ln(10) = 2.3 (an ulp there is 2.4e-7): 1e-6, never relative to a loss that falls to 1e-7
#   here (a relative bound failed on another CPU at step 9: 0.0013373408 against 0.0013373558,
#   1.5e-8 apart). Measured on this project's AMD EPYC over these 27 steps: at most 3.2e-7, at the
#   first three steps (1 to 2 ulps); a real difference there (a skipped sample, an unscaled
#   partial batch) moves the loss by 1e-2 or more. After step 9 the losses are below 1e-3 and
#   carry little; the weights and the evaluation counts carry the comparison.
# - The weights: within 7.5e-8 measured (2.7e-7 of the largest weight); bound 1e-6.
# - The validation and test losses, sums over their split: measured equal here, 2.4e-9 apart with
#   3 processes elsewhere; bound 1e-7. The counts of correct predictions must agree exactly.
LOSS_ATOL = 1e-6
WEIGHT_ATOL = 1e-6
EVAL_LOSS_ATOL = 1e-7


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """Write `array` (uint8) as an IDX file: magic 0x0000080N, each dimension, then the bytes."""
    data = struct.pack(f">BBBB{array.ndim}I", 0, 0, 8, array.ndim, *array.shape) + array.tobytes()
    path = path.with_name(path.name + ".gz") if gz else path
    path.parent.mkdir(parents=True, exist_ok=True)
    # The fastest level: gzip's default (9) takes 15 s on 10,000 of these images, level 1 0.06 s.
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    return path


def make_dataset(
    folder: Path,
    train_size: int = TRAIN_SIZE + VAL_SIZE,
    test_size: int = TEST_SIZE,
    gz: bool = True,
    seed: int = 0,
) -> Path:
    """Four IDX files of learnable 28×28 images: a sparse stroke pattern per class, with noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.random((10, 28, 28)) < 0.15
    for prefix, size in (("train", train_size), ("t10k", test_size)):
        labels = rng.integers(0, 10, size).astype(np.uint8)
        kept = patterns[labels] & (rng.random((size, 28, 28)) < 0.8)
        speckle = rng.random((size, 28, 28)) < 0.05
        images = (kept | speckle).astype(np.uint8) * 255
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz)
    return folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("tiny-mnist"))


def offline_env(**extra: str) -> dict[str, str]:
    """The environment for a run: downloads fail at once (proxy on a closed port), no wandb key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PYTEST_"))}
    closed = "http://127.0.0.1:9"
    env.update(http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed, HTTPS_PROXY=closed)
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    env.update(extra)
    return env


def run(
    command: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    own_process: bool = False,
) -> subprocess.CompletedProcess:
    """Run a command line to its end and return what it printed (stdout and stderr);
    `own_process` for a `python train.py` whose exit is under test (what it prints then)."""
    if not own_process and runs_here(command, cwd):
        return run_train_py_here(command, cwd=cwd, env=env or offline_env())
    return subprocess.run(
        command, cwd=cwd, env=env or offline_env(), capture_output=True, text=True, timeout=timeout
    )


def train(
    overrides: list[str],
    tmp_path: Path,
    *,
    nproc: int | None = None,
    env: dict[str, str] | None = None,
    own_process: bool = False,
) -> subprocess.CompletedProcess:
    """`python train.py` (or torchrun with nproc processes), run folders under tmp_path;
    `own_process`: a process of its own even where the test's process could run it."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
    command = [
        *launcher,
        str(REPO / "train.py"),
        *overrides,
        *defaults_for_tests(overrides),
        f"paths.log_dir={tmp_path / 'outputs'}",
    ]
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run(command, cwd=tmp_path, env=env, own_process=own_process)


# What keeps `python train.py` a real subprocess: another launcher or sweeper (submitit starts
# its jobs as processes, which the tests of it look at).
_NOT_HERE = re.compile(r"hydra/.*")


def runs_here(command: list[str], cwd: Path) -> bool:
    """Whether `command` is `python train.py ...`, which then runs in the test's own process
    (run_train_py_here), unless TESTS_IN_SUBPROCESSES=1 asks for every run as a process of its
    own. The processes such a run starts (self-launched DDP workers, debug=equivalence's) are
    real ones, started by the same code as from the command line."""
    return (
        len(command) > 1
        and command[0] == sys.executable
        and (Path(cwd) / command[1]).resolve() == REPO / "train.py"
        and os.environ.get("TESTS_IN_SUBPROCESSES") != "1"
        and not any(_NOT_HERE.fullmatch(arg) for arg in command[2:])
    )


# The signals whose handlers a run may set (its own stop signals; the DDP launcher's), reset
# after it: a handler a run left behind would act on this test process's next signal.
HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def run_train_py_here(
    command: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in this process: train.py's own `__main__` block, with the command's
    environment, working folder and arguments, its output captured and its exit status kept.

    The same code runs as from the command line (Hydra's real parsing, run folder, logging and
    error reports); what it saves is the start of a process, 3 to 5 s here (torch, torch._dynamo
    and Hydra imported), paid once per test worker instead of once per run. The output is taken
    from the file descriptors, so that what the processes the run starts print is in it too."""
    saved_env, saved_argv, saved_cwd, saved_path = dict(os.environ), sys.argv, os.getcwd(), sys.path
    handlers = {signum: signal.getsignal(signum) for signum in HANDLED}
    code = 0
    # The helper process multiprocessing starts once for this process, when a run first starts
    # processes, and which outlives the run: started here, not in the run's folder.
    resource_tracker.ensure_running()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [str(REPO / "train.py"), *command[2:]]
    # What a new interpreter would import from: the script's folder, then PYTHONPATH.
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path = [str(REPO), *pythonpath, *sys.path]
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        sys.stdout.flush()
        sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        os.dup2(out_file.fileno(), 1)
        os.dup2(err_file.fileno(), 2)
        out = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the descriptor stays
        err = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        try:
            with (
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
                warnings.catch_warnings(),  # shown as a new process shows them, not kept by pytest
            ):
                warnings.simplefilter("default")
                try:
                    runpy.run_path(str(REPO / "train.py"), run_name="__main__")
                except SystemExit as exit:  # as the interpreter turns it into an exit status
                    code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
                    if isinstance(exit.code, str):
                        print(exit.code, file=sys.stderr)
                except Exception:  # noqa: BLE001 (what Hydra did not catch: a traceback, exit 1)
                    traceback.print_exc()
                    code = 1
        finally:
            for handler in logging.getLogger().handlers[:]:  # Hydra's, on this run's streams
                logging.getLogger().removeHandler(handler)
                handler.close()
            out.flush()
            err.flush()
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            os.close(kept[0])
            os.close(kept[1])
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            os.environ.clear()
            os.environ.update(saved_env)
            # urllib's opener is built at its first use, with that moment's proxies.
            urllib.request.install_opener(None)
            os.chdir(saved_cwd)
            sys.argv, sys.path = saved_argv, saved_path
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = (file.read().decode(errors="replace") for file in (out_file, err_file))
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def defaults_for_tests(overrides: list[str]) -> list[str]:
    """What every test run sets unless it says otherwise: a validation split that fits the tiny
    data, and no pictures (they cost a second or two per run; the tests of them ask for them)."""
    given = {o.split("=")[0] for o in overrides}
    defaults = {"data.val_size": str(VAL_SIZE), "plots": "false"}
    return [f"{key}={value}" for key, value in defaults.items() if key not in given]


def torchrun_through_shell(
    script: str, overrides: list[str], outputs: Path, *torchrun_args: str
) -> list[str]:
    """torchrun (2 processes) starting each worker as `sh -c '<script>; exec python "$@"'` on
    train.py and the overrides: a per-rank twist (a late start, a bad value, a freeze) on a real
    run. torchrun substitutes $-templates in its arguments: the script writes the shell's $$ as
    $$$$."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        *torchrun_args, "--no-python", "sh", "-c", f'{script}; exec {sys.executable} "$@"', "sh",
        str(REPO / "train.py"), *overrides, *defaults_for_tests(overrides),
        f"paths.log_dir={outputs}",
    ]  # fmt: skip


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )
    return result


def run_dirs(tmp_path: Path) -> list[Path]:
    """The run folders Hydra made under tmp_path/outputs (those holding a .hydra folder)."""
    return sorted(p.parent for p in (tmp_path / "outputs").rglob(".hydra"))


def single_run(tmp_path: Path) -> Path:
    """The one run folder Hydra made under tmp_path/outputs."""
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 1, dirs
    return dirs[0]


def files(folder: Path) -> dict[Path, bytes]:
    """Every file under `folder`, by its path there, with its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl split into training lines and evaluation lines: a validation after each
    epoch, then the one test."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [m for m in lines if "val/loss" in m or "test/loss" in m]  # any task's
    return [m for m in lines if "train/loss" in m], evaluations


def read_test(run_dir: Path) -> dict:
    """The run's one test line (the last line of metrics.jsonl with test/loss)."""
    evaluations = read_metrics(run_dir)[1]
    assert [m for m in evaluations if "test/loss" in m] == evaluations[-1:], "one test, at the end"
    return evaluations[-1]


def assert_identical(ours, reference, where: str = "") -> None:
    """Two nested structures of tensors and plain values (a checkpoint, a state_dict) are the same
    to the bit: every tensor by torch.equal (dtype and shape too), everything else by ==."""
    import torch

    if isinstance(reference, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == reference.dtype, where
        assert torch.equal(ours, reference), where
    elif isinstance(reference, dict):
        assert list(ours) == list(reference), where
        for key in reference:
            assert_identical(ours[key], reference[key], f"{where}/{key}")
    elif isinstance(reference, (list, tuple)):
        assert type(ours) is type(reference) and len(ours) == len(reference), where
        for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
            assert_identical(a, b, f"{where}[{i}]")
    else:
        assert ours == reference, where


def compose_config(*overrides: str):
    """The run's config with `overrides`, composed by Hydra's compose API as train.py does (with
    the schema registered, as importing train.py's modules does)."""
    from hydra import compose, initialize_config_dir

    import src.engine.config  # noqa: F401 - registers the schema in Hydra's ConfigStore

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def mode_command(overrides: list[str], nproc: int | None) -> str:
    """The command line of an equivalence test's mode, as the README writes it (the test's recipe
    left out): tests/test_readme.py leaves the README's commands that are such modes to them."""
    launcher = f"torchrun --nproc_per_node={nproc} train.py" if nproc else "python train.py"
    return " ".join([launcher, *overrides])


def readme_commands() -> list[str]:
    """Each command in the bash blocks of the README and of the pages it links (docs/*.md,
    bench/README.md), comments dropped, `a && b` split in two."""
    commands = []
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def readme_command(start: str) -> str:
    """The one command of the README (or its pages) that starts with `start`."""
    (command,) = [c for c in readme_commands() if c.startswith(start)]
    return command


def wandb_summary(run_dir: Path) -> dict:
    """What the offline wandb run recorded, read back with wandb's own reader."""
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    result = subprocess.run(
        ["wandb", "leet", "inspect", "--summary", "--json", str(wandb_run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)


def wandb_records(run_dir: Path, kind: str) -> list[dict]:
    """The offline wandb run's records of one `kind` (run, metric, artifact, ...), read back with
    wandb's own reader."""
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    result = subprocess.run(
        ["wandb", "leet", "inspect", "--json", str(wandb_run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return [record[kind] for record in records if record.get("type") == kind]


def printed(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def last(run_dir: Path) -> dict:
    return load(run_dir / "checkpoints" / "last.pt")


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Same final weights, the same best.pt and record of it (early stopping's counter too), and
    the same metrics.jsonl, the test included (to float32 noise: measured exactly equal)."""
    import torch

    for name in ("last.pt", "best.pt"):
        got, want = (load(d / "checkpoints" / name) for d in (run_dir, reference))
        assert (got["progress"]["step"], got["progress"]["best"]) == (
            want["progress"]["step"],
            want["progress"]["best"],
        ), name
        for key, tensor in want["model"].items():
            torch.testing.assert_close(got["model"][key], tensor, rtol=0, atol=1e-6)
    lines, expected = (
        [
            m
            for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
            if "time/train_s" not in m
        ]  # timings differ
        for d in (run_dir, reference)
    )
    assert [m.keys() for m in lines] == [m.keys() for m in expected]
    for a, b in zip(lines, expected, strict=True):
        for key in b:
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-7), (key, a, b)


def start(
    overrides: list[str],
    cwd: Path,
    nproc: int | None = None,
    env: dict[str, str] | None = None,
    **popen: Any,
) -> subprocess.Popen:
    """train.py (or torchrun) in the background, its output in cwd/log; `popen` are more of
    Popen's arguments."""
    launcher = [sys.executable]
    if nproc:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [*launcher, str(REPO / "train.py"), *overrides, *defaults_for_tests(overrides)],
        cwd=cwd,
        env=env or offline_env(),
        stdout=(cwd / "log").open("w"),
        stderr=subprocess.STDOUT,
        **popen,
    )


def wait_for(condition, process: subprocess.Popen | None, timeout: float = 120) -> None:
    """Poll until `condition()` holds, failing if `process` (when given) ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process is None or process.poll() is None, "the run ended before it held"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Two tests at a time, unless `-n` says otherwise: two keep a 2-core machine busy. Without
    pytest-xdist (or with `-p no:xdist`) the tests run one at a time."""
    worker = hasattr(config, "workerinput")  # a worker of xdist's: its own tests, one at a time
    if (
        config.pluginmanager.hasplugin("xdist")
        and not worker
        and config.option.numprocesses is None
    ):
        config.option.numprocesses = 2
        if config.option.dist == "no":
            config.option.dist = "worksteal"  # tests of uneven lengths: an idle worker takes more


# The optional extras (requirements-*.txt), each by a module it installs. A test that needs one
# is marked `extra(NAME)` and skipped, naming the install command, where it is missing; .ci/run
# sets TESTS_NEED_EXTRAS=1, under which a missing extra fails the test instead.
EXTRAS = {
    "optuna": ("hydra_plugins.hydra_optuna_sweeper", "requirements-optuna.txt"),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "requirements-slurm.txt"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first (in file order), then the others: two workers then end the run on
    short tests, instead of one finishing a minute-long test while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in item.iter_markers("extra"):
        (name,) = marker.args
        module, requirements = EXTRAS[name]
        if not installed(module):
            skip_for_extra(f"needs the {name} extra ({module}): pip install -r {requirements}")


def installed(module: str) -> bool:
    """Whether `module` can be imported (find_spec raises where its parent package is missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def skip_for_extra(reason: str) -> None:
    """Skip the test for a missing optional package; fail it where TESTS_NEED_EXTRAS is set."""
    if os.environ.get("TESTS_NEED_EXTRAS"):
        pytest.fail(f"{reason} (TESTS_NEED_EXTRAS is set: no test may skip for a missing extra)")
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test marked `unit` that starts a process fails: the tier stays in-process and fast."""
    if request.node.get_closest_marker("unit"):
        start = subprocess.Popen.__init__

        def refuse(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
            # matplotlib asks fontconfig for the fonts once, when it builds its font cache.
            if isinstance(args, list) and args[:1] == ["fc-list"]:
                return start(self, args, *rest, **kwargs)
            raise AssertionError(f"a unit test started a process: {args!r}")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def write_image_folder(
    root: Path,
    classes: dict[str, int] | None = None,
    size: tuple[int, int] = (12, 12),
    mode: str = "RGB",
    seed: int = 0,
    splits: tuple[str, ...] = ("train", "test"),
) -> Path:
    """An ImageFolder of PNG files, `root/<split>/<class>/<n>.png`: a learnable colour pattern
    per class (the tiny data's idea), with noise; `classes` maps a class name to its count."""
    from PIL import Image

    classes = classes or {"cat": 30, "dog": 30, "fox": 30}
    rng = np.random.default_rng(seed)
    channels = len(mode)
    patterns = rng.random((len(classes), size[1], size[0], channels)) < 0.3
    for split in splits:
        for label, (name, count) in enumerate(classes.items()):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            noise = rng.random((count, size[1], size[0], channels)) < 0.1
            for i, image in enumerate((patterns[label] ^ noise).astype(np.uint8) * 255):
                Image.fromarray(image.squeeze(-1) if channels == 1 else image, mode).save(
                    folder / f"{i:03d}.png"
                )
    return root


def _cifar10_written_here():
    """torchvision's CIFAR10, with the md5 of the files a test wrote in place of the real
    dataset's: everything else (the integrity check itself, the unpickling) is torchvision's."""
    import hashlib

    from torchvision.datasets import CIFAR10

    class CIFAR10WrittenHere(CIFAR10):
        def __init__(self, root, *args, **kwargs):
            folder = Path(root) / self.base_folder
            md5 = lambda name: hashlib.md5((folder / name).read_bytes()).hexdigest()  # noqa: E731
            if folder.is_dir():
                self.train_list = [[name, md5(name)] for name, _ in CIFAR10.train_list]
                self.test_list = [[name, md5(name)] for name, _ in CIFAR10.test_list]
                self.meta = {**CIFAR10.meta, "md5": md5(CIFAR10.meta["filename"])}
            super().__init__(root, *args, **kwargs)

    return CIFAR10WrittenHere


def __getattr__(name: str):  # torchvision is imported only by the tests that use the class
    if name == "CIFAR10WrittenHere":
        return _cifar10_written_here()
    raise AttributeError(name)


def a_run(task: Any = None, data: Any = None, process: Any = None, **trainer: Any) -> Any:
    """The run context the core's functions take (src/engine/core/context.py), for calling them in
    this process: the task (classification by default), the data, this process, and
    `Trainer(**trainer)` settings. It monitors val/loss, which every task returns."""
    from src.engine.config import Checkpointing, Settings, Trainer
    from src.engine.core.context import Run
    from src.engine.parallel import Process
    from src.tasks import Classification

    checkpoint = Checkpointing(monitor="val/loss", mode="min")
    settings = Settings(Trainer(**trainer), checkpoint, task or Classification())
    return Run(process or Process(), settings, data)
