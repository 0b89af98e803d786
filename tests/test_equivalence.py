"""`parallel=` changes only the speed: none, dp, ddp and fsdp train the same run in float32, and so
does `trainer.accumulate_grad_batches`.

Every mode trains the same config (SGD with momentum, a one-cycle schedule, 27 steps), and the
per-step losses, the validations, the test and the final weights must agree to float32
reduction-order noise. 200 training images in global batches of 24 end each epoch with a batch of
8, which 3 processes split 3/3/2; the 50 validation images split 17/17/16.

What float32 can show: that every mode sums the same terms (a skipped sample or an unscaled
partial batch moves a loss by 1e-2 or more), in the precision users train in. What it cannot:
that a long run stays together, since a rounding difference that tips a near tie (a ReLU's input
within 1e-7 of 0) sends the modes on visibly different runs from that step on, rightly; these 27
steps meet none, on this CPU. tests/test_float64.py proves the whole epoch, in float64, in every
mode, on 1 to 4 processes: the process counts, launchers and settings that are the same code as
a mode here, and differ from it only in where float32 rounds, run there alone.
"""

import math
import socket
import subprocess
import sys

import pytest
import torch
from conftest import (
    EVAL_LOSS_ATOL,
    LOSS_ATOL,
    REPO,
    TESTS,
    VAL_SIZE,
    WEIGHT_ATOL,
    a_run,
    make_dataset,
    offline_env,
    ok,
    read_metrics,
    readme_command,
    run_dirs,
    train,
)
from hydra.utils import instantiate

from src.engine.core.evaluate import evaluate
from src.engine.data import Data
from src.engine.parallel import Process

RECIPE = [
    "logger=none",
    "model=mlp",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "scheduler=onecycle",
    "data.batch_size=24",
    "trainer.epochs=3",
    "trainer.log_every_n_steps=1",
    f"data.val_size={VAL_SIZE}",
]
MODES = {
    "none": ([], None),
    # Without CUDA, parallel=dp trains on the one device (with a warning): this run checks that
    # fallback, not DataParallel, which needs GPUs (tests/test_gpu.py).
    "dp-without-gpus": (["parallel=dp"], None),
    "ddp1": (["parallel=ddp"], 1),
    "ddp2": (["parallel=ddp"], 2),
    "ddp3": (["parallel=ddp"], 3),
    # Gradient accumulation: the same global batches in micro-batches of 6 (the last batch's 8
    # images in 2s), all-reduced once per step under DDP.
    "none-accumulate4": (["trainer.accumulate_grad_batches=4"], None),
    "ddp2-accumulate2": (["parallel=ddp", "trainer.accumulate_grad_batches=2"], 2),
    # FSDP: each rank holds a shard of every layer (Linear units, then the root).
    "fsdp2": (["parallel=fsdp"], 2),
    "fsdp-self-launched": (["parallel=fsdp"], None),  # 2 processes on a machine without GPUs
    "fsdp2-root-only": (["parallel=fsdp", "parallel.shard_modules=[]"], 2),
    "fsdp2-kept-gathered": (["parallel=fsdp", "parallel.reshard_after_forward=false"], 2),
    # A mode of a fork's, outside src/: DDP with a communication hook of its own.
    "hooked-ddp2": ([f"hydra.searchpath=[file://{TESTS}/conf]", "parallel=hooked_ddp"], 2),
}
# The main tier runs each mode, launcher and kind of split once: one process in micro-batches,
# dp's fallback, DDP on 1, 2 and 3 ranks (3 split unevenly), in micro-batches, FSDP on 2 ranks and
# self-launched. FSDP's other settings run with the slow tests; 4 processes, DDP self-launched and
# FSDP on 3 and 4 ranks and in micro-batches run there in float64 (tests/test_float64.py).
SLOW = ("fsdp2-root-only", "fsdp2-kept-gathered")
COMPARED = [
    pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODES if m != "none"
]


class Runs(dict):
    """Each mode's metrics and final checkpoint, trained the first time a test asks for it."""

    def __init__(self, tmp_path_factory, data):
        super().__init__()
        self.tmp_path_factory, self.data = tmp_path_factory, data
        self.launched = {}  # each mode's finished process, its folder and its TMPDIR

    def __missing__(self, name: str):
        overrides, nproc = MODES[name]
        tmp = self.tmp_path_factory.mktemp(name)
        temporary = self.tmp_path_factory.mktemp(f"{name}-temporary")  # its TMPDIR
        env = offline_env(TMPDIR=str(temporary), PYTHONPATH=TESTS)  # a fork's mode is in tests/
        result = ok(
            train([f"data.root={self.data}", *RECIPE, *overrides], tmp, nproc=nproc, env=env)
        )
        (run_dir,) = run_dirs(tmp)  # one run folder, whatever the number of processes
        checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
        self.launched[name] = (result, tmp, temporary)
        self[name] = (*read_metrics(run_dir), checkpoint)
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    """The modes' runs, each trained once for all the tests below (the slow two-machine test
    needs only none's)."""
    return Runs(tmp_path_factory, tiny_data)


# parallel=dp without GPUs (one device) and DDP with one process reduce nothing: not even noise.
BITWISE = ("dp-without-gpus", "ddp1")


@pytest.mark.parametrize("mode", COMPARED)
def test_every_mode_trains_the_same_run(runs, mode):
    """The per-step losses and learning rates, the validations and the test (their counts
    exactly), and the final weights (without a "module." prefix) of one run in this mode."""
    ref_steps, ref_evals, ref_checkpoint = runs["none"]
    steps, evals, checkpoint = runs[mode]
    assert len(ref_steps) == 27
    assert [m["step"] for m in steps] == [m["step"] for m in ref_steps]
    assert [m["lr"] for m in steps] == [m["lr"] for m in ref_steps]
    for ours, ref in zip(steps, ref_steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=0, abs_tol=LOSS_ATOL), (
            ours,
            ref,
        )
    assert [m.keys() for m in evals] == [m.keys() for m in ref_evals]  # 3 validations, 1 test
    for ours, ref in zip(evals, ref_evals, strict=True):
        split = "val" if "val/loss" in ref else "test"
        loss = f"{split}/loss"
        assert math.isclose(ours[loss], ref[loss], rel_tol=0, abs_tol=EVAL_LOSS_ATOL), (ours, ref)
        assert ours[f"{split}/correct"] == ref[f"{split}/correct"]
        assert ours.get("test/weights_epoch") == ref.get("test/weights_epoch")
    reference, weights = ref_checkpoint["model"], checkpoint["model"]
    assert list(weights) == list(reference)  # no "module." prefix, whatever the mode
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=0, atol=WEIGHT_ATOL)
    if mode in BITWISE:
        assert (steps, evals) == (ref_steps, ref_evals)
        assert all(torch.equal(weights[name], reference[name]) for name in reference)


def test_a_mode_of_a_forks_own_trains_through_its_strategy(runs):
    """tests/hooked_ddp.py and its YAML file, nothing of src/ touched: its hook reduced the
    gradients (and test_every_mode_trains_the_same_run holds its run to one process's)."""
    runs["hooked-ddp2"]
    result = runs.launched["hooked-ddp2"][0]
    assert "the gradients are averaged by its own communication hook" in result.stdout


def test_ddp_prints_from_rank_0_and_writes_only_its_run_folder(runs):
    """torchrun with 2 ranks: rank 0's output only (rank 1 had nothing to warn about), and
    nothing written beside the one run folder, nor left in the temporary directory (torchrun's
    torchelastic_* folder is removed)."""
    runs["ddp2"]  # trained here, if no test has asked for it yet
    result, folder, temporary = runs.launched["ddp2"]
    assert "DDP: 2 processes, backend gloo" in result.stdout
    assert "[rank 1]" not in result.stdout + result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["outputs"]
    assert not [p.name for p in temporary.iterdir() if p.name.startswith("torchelastic_")]


def test_the_runs_really_trained(runs):
    """The comparison means something: the weights moved, the loss fell, and the validations
    and the test counted every image of their split."""
    steps, evals, checkpoint = runs["none"]
    assert steps[-1]["train/loss"] < 0.5 * steps[0]["train/loss"]
    assert checkpoint["progress"]["step"] == 27 and checkpoint["progress"]["epoch"] == 3
    assert [m["epoch"] for m in evals] == [1, 2, 3, 3]
    assert evals[-1]["test/correct"] > 50 and evals[-2]["val/correct"] > 25


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_evaluation_is_exact_with_3_processes(tmp_path, mode):
    """3,001 validation images (1001/1000/1000) and 10,000 test images (3334/3333/3333) over 3
    ranks: the same counts as one process evaluating the same weights. (In batches of 1,000,
    under FSDP ranks 1 and 2 run an empty batch beside rank 0's second validation batch.)"""
    data_dir = make_dataset(tmp_path / "data", train_size=48 + 3001, test_size=10_000, seed=7)
    overrides = [f"data.root={data_dir}", *RECIPE, "trainer.epochs=1", "data.val_size=3001"]
    ok(train([*overrides, f"parallel={mode}"], tmp_path / mode, nproc=3))
    (run_dir,) = run_dirs(tmp_path / mode)
    _, (validated, logged) = read_metrics(run_dir)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)

    # The same weights, evaluated in this one process through the same code.
    cfg = checkpoint["config"]
    model = instantiate(cfg["model"])
    model.load_state_dict(checkpoint["model"])
    data = instantiate({**cfg["data"], "root": str(data_dir)})
    data.setup(Process())
    assert isinstance(data, Data) and data.size("test") == 10_000 and data.size("val") == 3001
    for split, record in (("val", validated), ("test", logged)):
        single = evaluate(a_run(data=data), model, split)
        assert record[f"{split}/correct"] == single[f"{split}/correct"]
        assert record[f"{split}/acc"] == single[f"{split}/acc"]
        assert math.isclose(record[f"{split}/loss"], single[f"{split}/loss"], rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [None, 2])
def test_deterministic_runs_are_bitwise_identical(tmp_path, tiny_data, nproc):
    """trainer.deterministic=true: the CNN, dropout on, trained twice gives the very same bits.

    What this proves is repeatability: seeds, sample order and dropout streams are the same run to
    run. On the CPU it also holds without the flag; what the flag switches (deterministic kernels,
    no cuDNN autotuning) is checked in tests/test_cuda_paths.py and matters on GPUs."""
    overrides = [
        f"data.root={tiny_data}",
        "logger=none",
        "model=cnn",
        "trainer.deterministic=true",
        "trainer.max_steps=5",
        "trainer.log_every_n_steps=1",
    ]
    if nproc:
        overrides.append("parallel=ddp")
    results = []
    for attempt in ("first", "second"):
        ok(train(overrides, tmp_path / attempt, nproc=nproc))
        (run_dir,) = run_dirs(tmp_path / attempt)
        weights = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
        results.append((read_metrics(run_dir), weights))
    (metrics_a, weights_a), (metrics_b, weights_b) = results
    assert metrics_a == metrics_b
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_machines_on_loopback_train_the_same_run(runs, tmp_path, tiny_data, mode):
    """The README's command for each of two machines, run by two torchrun agents here (both on
    127.0.0.1, HEAD_NODE), 2 processes each (under FSDP too): they meet through torchrun's c10d
    rendezvous, 4 ranks, one run folder, one wandb run, and the same training as one process (a
    rank that did not train its share would change the losses)."""
    env = offline_env(HOME=str(tmp_path / "home"), WANDB_MODE="offline")
    machine = readme_command("torchrun --nnodes=2 ")
    words = machine.replace("$HEAD_NODE:29500", f"127.0.0.1:{free_port()}").split()
    assert words[0] == "torchrun" and "--nnodes=2" in words and words[-1] == "parallel=ddp"
    words = [str(REPO / "train.py") if w == "train.py" else w for w in words[1:-1]]
    command = [sys.executable, "-m", "torch.distributed.run", *words, f"parallel={mode}",
               f"data.root={tiny_data}", *RECIPE, "logger=wandb",
               f"paths.log_dir={tmp_path / 'outputs'}"]  # fmt: skip
    agents = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert f"{mode.upper()}: 4 processes" in "".join(outputs)
    (run_dir,) = run_dirs(tmp_path)
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 1
    steps, evals = read_metrics(run_dir)
    ref_steps, ref_evals, _ = runs["none"]
    for ours, ref in zip(steps + evals, ref_steps + ref_evals, strict=True):
        loss = next(key for key in ("train/loss", "val/loss", "test/loss") if key in ref)
        atol = LOSS_ATOL if loss == "train/loss" else EVAL_LOSS_ATOL
        assert math.isclose(ours[loss], ref[loss], rel_tol=0, abs_tol=atol), (ours, ref)
