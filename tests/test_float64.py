"""`trainer.precision=64`: the proof that `parallel=` changes only the speed, over a whole epoch.

In float32 the modes agree to rounding only as long as no rounding difference tips a near tie
(a ReLU's input within 1e-7 of 0): tests/test_equivalence.py's 27 steps show the sums are the same
ones, and a longer run on another CPU could meet a flip. In float64 a step's rounding is 1e-16
of its terms, 5e8 times finer, and a flip needs an input within that of a tie: over this epoch's
126 steps (3,008 images, 512 hidden units) about 1.5e6 activations pass, and with their spread
of about 1, the chance that one lies within 1e-15 of 0 is about 3e-9. So here every mode must
give the reference's per-step losses and final weights to 1e-10 relative, and its evaluation
counts exactly: the margin is 4 orders above what float64 rounding moves (measured in every
mode: at most 3.3e-15 per step and 1.4e-16 in the weights on an Intel Xeon; 4.9e-15 and 1.9e-16
on an AMD EPYC, with batches of 12), not luck of the recipe.

3,008 training images in global batches of 24 make 125 batches and a last one of 8, which 3
processes split 3/3/2 and 4 split 2/2/2/2; the 50 validation images split 17/17/16 and 13/13/12/12.
(Batches of 12, 251 steps, took twice the time for the same images: each step's collectives cost
more than its arithmetic here.)
"""

import json

import pytest
import torch
from conftest import (
    TESTS,
    make_dataset,
    offline_env,
    ok,
    printed,
    read_metrics,
    run_dirs,
    single_run,
    train,
)

# Relative to the compared quantity (a tensor's largest weight where that is above 1). What
# bounds it: float64 rounding carried over the epoch (measured at most 4.9e-15), with four
# orders of margin; a real difference (a sample, a scale) is 1e-3 or more, and a float32 rounding
# that slips into a float64 run (an int64 count divided in float32 once did) 3e-8.
RELATIVE = 1e-10
RECIPE = [
    "logger=none",
    "plots=false",
    "trainer.precision=64",
    "model=mlp",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "scheduler=onecycle",
    "data.batch_size=24",
    "data.val_size=50",
    "trainer.epochs=1",
    "trainer.log_every_n_steps=1",
]
BATCH_NORM = ["model=cnn_bn", "model.dropout1=0", "model.dropout2=0"]
# The BatchNorm CNN's epoch is the first 600 images (25 steps): its float64 epoch of 3,008 took a
# minute and a half here, and its one rank reduces nothing, so any length shows the same thing.
BATCH_NORM_EPOCH = [*BATCH_NORM, "data.subset=600"]
# mode: (overrides, torchrun's processes or None, the mode it must equal). Every mode, process
# count and launcher: the main tier's float32 comparison (tests/test_equivalence.py) runs DDP on 2
# ranks under torchrun, so here they are started by train.py itself.
MODES = {
    "none": ([], None, None),
    "dp-without-gpus": (["parallel=dp"], None, "none"),
    "ddp1": (["parallel=ddp"], 1, "none"),
    "ddp2-self-launched": (["parallel=ddp", "parallel.nproc_per_node=2"], None, "none"),
    "ddp3": (["parallel=ddp"], 3, "none"),
    "ddp4": (["parallel=ddp"], 4, "none"),
    "fsdp2": (["parallel=fsdp"], 2, "none"),
    "fsdp3": (["parallel=fsdp"], 3, "none"),
    "fsdp4": (["parallel=fsdp"], 4, "none"),
    "none-accumulate2": (["trainer.accumulate_grad_batches=2"], None, "none"),
    "ddp2-accumulate2": (["parallel=ddp", "trainer.accumulate_grad_batches=2"], 2, "none"),
    "fsdp2-accumulate2": (["parallel=fsdp", "trainer.accumulate_grad_batches=2"], 2, "none"),
    # BatchNorm normalises by the batch it sees: one process and one rank of DDP see the whole
    # batch (its share under more ranks is another batch, which only SyncBatchNorm, on CUDA GPUs,
    # makes whole again: tests/test_gpu.py).
    "batchnorm": (BATCH_NORM_EPOCH, None, None),
    "batchnorm-ddp1": ([*BATCH_NORM_EPOCH, "parallel=ddp"], 1, "batchnorm"),
}
COMPARED = [m for m, (_, _, reference) in MODES.items() if reference]


@pytest.fixture(scope="module")
def epoch_data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("epoch-data"), train_size=3008 + 50, seed=3)


class Runs(dict):
    """Each mode's training lines, evaluation lines and final checkpoint, trained once."""

    def __init__(self, tmp_path_factory, data):
        super().__init__()
        self.tmp_path_factory, self.data = tmp_path_factory, data

    def __missing__(self, name: str):
        overrides, nproc, _ = MODES[name]
        tmp = self.tmp_path_factory.mktemp(name)
        ok(train([f"data.root={self.data}", *RECIPE, *overrides], tmp, nproc=nproc))
        (run_dir,) = run_dirs(tmp)
        checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
        self[name] = (*read_metrics(run_dir), checkpoint)
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, epoch_data):
    return Runs(tmp_path_factory, epoch_data)


def relative(ours: float, reference: float) -> float:
    return abs(ours - reference) / max(abs(reference), 1e-300)


# A whole epoch in each mode is the slow tier's proof (about 4 minutes of runs here); the main
# tier's float32 comparison (tests/test_equivalence.py) runs each mode on 27 steps.
@pytest.mark.slow
@pytest.mark.parametrize("mode", COMPARED)
def test_a_whole_float64_epoch_is_the_same_run_in_every_mode(runs, mode):
    """Every step's loss and learning rate, the validation and the test (their counts exactly)
    and the final float64 weights, against one process's."""
    ref_steps, ref_evals, ref_checkpoint = runs[MODES[mode][2]]
    steps, evals, checkpoint = runs[mode]
    assert (
        len(ref_steps) == (25 if "batchnorm" in mode else 126)
        and checkpoint["progress"]["epoch"] == 1
    )
    assert [m["step"] for m in steps] == [m["step"] for m in ref_steps]
    assert [m["lr"] for m in steps] == [m["lr"] for m in ref_steps]
    worst = max(
        relative(ours["train/loss"], ref["train/loss"])
        for ours, ref in zip(steps, ref_steps, strict=True)
    )
    assert [m.keys() for m in evals] == [m.keys() for m in ref_evals]  # 1 validation, 1 test
    for ours, ref in zip(evals, ref_evals, strict=True):
        split = "val" if "val/loss" in ref else "test"
        assert ours[f"{split}/correct"] == ref[f"{split}/correct"]
        worst = max(worst, relative(ours[f"{split}/loss"], ref[f"{split}/loss"]))
    weights, reference = checkpoint["model"], ref_checkpoint["model"]
    assert list(weights) == list(reference)
    floats = [name for name, tensor in reference.items() if tensor.is_floating_point()]
    assert all(weights[name].dtype == torch.float64 for name in floats)
    weight = max(
        ((weights[n] - reference[n]).abs().max() / reference[n].abs().max().clamp(min=1)).item()
        for n in floats
    )
    print(json.dumps({"mode": mode, "losses": worst, "weights": weight}))  # the note's figures
    assert worst <= RELATIVE and weight <= RELATIVE, (worst, weight)


@pytest.mark.slow
def test_the_float64_runs_really_trained(runs):
    """The comparison means something: the loss fell, the evaluation counted every image."""
    steps, evals, _ = runs["none"]
    assert steps[-1]["train/loss"] < 0.5 * steps[0]["train/loss"]
    assert evals[-1]["test/correct"] > 80 and evals[0]["val/correct"] > 40


def test_checkpoints_move_between_float64_and_float32(tmp_path, tiny_data):
    """float32 → float64 → float32, each a resume of the last: the weights and the optimizer's
    state continue in the new precision, one line saying so."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", "logger=none", "plots=false", "optimizer=adam",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    for epochs, precision in ((1, "32"), (2, "64"), (3, "32")):
        result = ok(train([*overrides, f"trainer.precision={precision}",
                           f"trainer.epochs={epochs}"], tmp_path))  # fmt: skip
        saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
        dtype = {"64": torch.float64, "32": torch.float32}[precision]
        assert saved["progress"]["epoch"] == epochs
        assert {t.dtype for t in saved["model"].values()} == {dtype}
        moments = [s["exp_avg_sq"] for s in saved["optimizer"]["state"].values()]
        assert moments and {t.dtype for t in moments} == {dtype}
        if epochs > 1:
            before = {"64": "float32", "32": "float64"}[precision]
            assert (
                f"Weights converted on load: {before} in {run_dir}/checkpoints/last.pt, "
                f"{str(dtype).removeprefix('torch.')} in this run"
            ) in printed(result)


@pytest.mark.slow
def test_sharded_fsdp_checkpoints_move_between_float64_and_float32(tmp_path, tiny_data):
    """checkpoint.sharded=true: each rank's float64 shards resumed in float32 by 2 FSDP ranks,
    then those float32 shards in float64."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", "logger=none", "plots=false", "optimizer=adam",
                 "parallel=fsdp", "checkpoint.sharded=true",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    for epochs, precision in ((1, "64"), (2, "32"), (3, "64")):
        result = ok(train([*overrides, f"trainer.precision={precision}",
                           f"trainer.epochs={epochs}"], tmp_path, nproc=2))  # fmt: skip
        if epochs > 1:
            before, now = ("float64", "float32") if precision == "32" else ("float32", "float64")
            assert (
                f"Weights converted on load: {before} in {run_dir}/checkpoints/last.pt, {now}"
                in (printed(result))
            )
    assert "epoch 3, step 12: val loss" in printed(result)


def test_a_model_that_makes_float32_tensors_is_told_what_to_do(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", "logger=none", "trainer.precision=64",
                 "model._target_=user_models.Float32Inside"]  # fmt: skip
    result = train(overrides, tmp_path, env=offline_env(PYTHONPATH=TESTS))
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert (
        "torch.float64 inputs stopped it with: expected m1 and m2 to have the same dtype, but got: "
        "double != float. Make the tensors its forward creates in the input's dtype "
        "(dtype=x.dtype), or train in trainer.precision=32."
    ) in printed(result)


@pytest.mark.slow
def test_float64_compiles_and_clips(tmp_path, tiny_data):
    """torch.compile in float64 (the BatchNorm CNN, clipped gradients): the compiled kernels sum
    in their own order, and in float64 that moves the losses by about 1e-16, within the bound."""
    overrides = [f"data.root={tiny_data}", "logger=none", "plots=false", "trainer.precision=64",
                 *BATCH_NORM, "trainer.gradient_clip_val=0.5", "trainer.max_steps=3",
                 "trainer.log_every_n_steps=1"]  # fmt: skip
    steps = {}
    for compiled in ("false", "true"):
        ok(train([*overrides, f"trainer.compile={compiled}"], tmp_path / compiled))
        steps[compiled] = read_metrics(single_run(tmp_path / compiled))[0]
    assert len(steps["true"]) == 3
    for ours, ref in zip(steps["true"], steps["false"], strict=True):
        assert relative(ours["train/loss"], ref["train/loss"]) <= RELATIVE
        assert ours["train/grad_norm"] > 0.5  # clipped: the norm before clipping is logged
