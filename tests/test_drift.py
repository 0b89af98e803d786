"""The drift guard under DDP: ranks that would train different models are stopped with one
sentence naming what differs (the initial weights, the data, a parameter and its step), and
normal runs go through it, also when it checks after every step."""

import math

import pytest
import torch
from conftest import (
    TESTS,
    make_dataset,
    offline_env,
    ok,
    printed,
    run,
    run_dirs,
    torchrun_through_shell,
    train,
)

from src.engine.guards import fingerprint


def user_model(name: str) -> list[str]:
    """The overrides that train `tests/user_models.py`'s `name` in place of the MLP."""
    return [f"model._target_=user_models.{name}"]


def ddp(overrides: list[str], tmp_path, data, torchrun: bool = False):
    """A run of 2 DDP processes on `data` (self-launched, or under torchrun), with tests/
    importable for the user models."""
    overrides = [f"data.root={data}", "logger=none", "parallel=ddp", *overrides]
    if not torchrun:
        overrides.append("parallel.nproc_per_node=2")
    nproc = 2 if torchrun else None
    return train(overrides, tmp_path, nproc=nproc, env=offline_env(PYTHONPATH=TESTS))


@pytest.mark.unit
def test_a_fingerprint_changes_with_any_element():
    """One bit of one element changes it; equal tensors of any dtype and layout share it."""
    weights = torch.randn(1000)
    nudged = weights.clone()
    nudged[537] = torch.nextafter(nudged[537], torch.tensor(math.inf))
    images = torch.randn(2, 3, 4, 4)
    tensors = [weights, torch.arange(5), torch.tensor(True), weights.bfloat16(), torch.zeros(0),
               images.to(memory_format=torch.channels_last), torch.randn(3, 2)[:, 1],
               torch.randn(4, dtype=torch.complex128)]  # fmt: skip
    assert [int(f) for f in fingerprint(tensors)] == [int(f) for f in fingerprint(tensors)]
    assert [f.dtype for f in fingerprint(tensors)] == [torch.int64] * len(tensors)
    assert fingerprint([weights]) != fingerprint([nudged])
    assert fingerprint([images]) == fingerprint([images.to(memory_format=torch.channels_last)])


@pytest.mark.parametrize(
    ("every", "step"), [("eval", 4), pytest.param("1", 3, marks=pytest.mark.slow)]
)
def test_a_rank_that_changes_a_weight_stops_the_run(tmp_path, tiny_data, every, step):
    """Rank 1 nudges fc2.bias in its third step: by default the check before the epoch's
    validation (step 4) stops both ranks, before anything is saved; checking every step stops them
    at step 3."""
    overrides = [*user_model("Drifting"), f"parallel.check_sync_every_n_steps={every}"]
    result = ddp(overrides, tmp_path, tiny_data)
    assert result.returncode != 0 and "Traceback" not in printed(result)
    assert (
        f"Stopped at step {step}: DDP rank 1's fc2.bias differs from rank 0's, so the ranks no "
        "longer train one model, and nothing after it was saved (no checkpoint before it)."
    ) in printed(result)
    (run_dir,) = run_dirs(tmp_path)
    assert not (run_dir / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
def test_ranks_that_start_from_other_weights_are_stopped(tmp_path, tiny_data):
    """A model seeded by its rank: DDP would copy rank 0's weights over rank 1's and hide it."""
    result = ddp(user_model("RankSeeded"), tmp_path, tiny_data)
    assert result.returncode != 0 and "Traceback" not in printed(result)
    assert "DDP rank 1 starts from other weights than rank 0 (fc1.weight differs)" in printed(
        result
    )


@pytest.mark.slow
def test_ranks_that_build_another_model_are_stopped(tmp_path, tiny_data):
    """Rank 1 started with model.hidden=64: named before DDP's own check fails with a
    traceback."""
    rank_1_differs = '[ "$RANK" = 1 ] && set -- "$@" model.hidden=64'
    overrides = [f"data.root={tiny_data}", "logger=none", "parallel=ddp"]
    result = run(torchrun_through_shell(rank_1_differs, overrides, tmp_path / "out"), tmp_path)
    assert result.returncode != 0
    assert (
        "DDP rank 1 built another model than rank 0 (it has fc1.weight [64, 784] where rank 0 has "
        "fc1.weight [512, 784])"
    ) in printed(result)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        pytest.param(
            {"seed": 1},
            "DDP rank 1 reads other labels for the first batch than rank 0 does",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"train_size": 260},
            "The DDP ranks hold different training splits ([200, 210] images",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_ranks_with_other_data_files_are_stopped(tmp_path, tiny_data, other, message):
    """As on two machines whose data.root differ: each rank reads its own folder (data0 or
    data1, chosen by the LOCAL_RANK torchrun gives it), and the second holds other images."""
    make_dataset(tmp_path / "data0")
    make_dataset(tmp_path / "data1", **other)
    root = str(tmp_path / "data") + "${oc.env:LOCAL_RANK}"
    result = ddp([], tmp_path, root, torchrun=True)
    assert result.returncode != 0
    assert message in printed(result)
    assert printed(result).count("Traceback") == 1  # torchrun's own, for the failed worker


@pytest.mark.slow
def test_normal_runs_pass_the_guard_at_every_step(tmp_path, tiny_data):
    """The CNN (each rank its own dropout masks) in micro-batches, checked after every step.
    (Every other DDP run of the tests passes the default guard.)"""
    overrides = ["model=cnn", "trainer.accumulate_grad_batches=2",
                 "parallel.check_sync_every_n_steps=1", "trainer.epochs=2"]  # fmt: skip
    ok(ddp(overrides, tmp_path, tiny_data))
