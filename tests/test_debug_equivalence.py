"""`python train.py debug=equivalence`: exit 0 where 2 DDP processes and micro-batches train the
config as one process does; exit 1, naming the likely cause, where they do not; one sentence for
what it cannot check. It compares in float64 unless asked (debug.precision=train) or the model
cannot run in it."""

import pytest
import torch
from conftest import TESTS, compose_config, offline_env, ok, printed, train

from src.engine.build import read_settings
from src.engine.errors import UserError
from src.engine.tools import equivalence
from src.engine.tools.equivalence import Difference, Trace

LAYOUTS = ["1 process (reference)", "1 process × 2 micro-batches", "2 DDP processes",
           "2 DDP processes × 2 micro-batches"]  # fmt: skip


def check(overrides: list[str], tmp_path, data, nproc: int | None = None, steps: int | None = 6):
    """debug=equivalence on `data` with `overrides`, `steps` steps (6: 1.5 epochs of the tiny
    data; None: the default), tests/ importable for the user models."""
    overrides = ["debug=equivalence", f"data.root={data}", *overrides]
    if steps is not None:
        overrides.append(f"debug.steps={steps}")
    return train(overrides, tmp_path, nproc=nproc, env=offline_env(PYTHONPATH=TESTS))


def user_model(name: str) -> str:
    return f"model._target_=user_models.{name}"


@pytest.mark.parametrize(
    ("model", "steps"), [("mlp", None), pytest.param("cnn", 6, marks=pytest.mark.slow)]
)
def test_the_template_models_are_equivalent(tmp_path, tiny_data, model, steps):
    """Four layouts in the table, each within float64 rounding, every evaluation count the same
    (the reference's out of the split's 50 and 100 images). These are the README's commands,
    `python train.py debug=equivalence` (the MLP, with its default 20 steps) and
    `python train.py debug=equivalence model=cnn`."""
    overrides = [] if model == "mlp" else [f"model={model}"]  # the MLP is the default model
    output = printed(ok(check(overrides, tmp_path, tiny_data, steps=steps)))
    assert (
        f"Training {steps or 20} steps in each layout, in float64, so that rounding cannot pass "
        "for a difference (debug.precision=train: in the config's own precision), dropout off, on "
        "the CPU (gloo)"
    ) in output.splitlines()[0]
    table = output[output.index("layout ") :].splitlines()
    assert [line.split("  ")[0] for line in table[1:5]] == LAYOUTS
    assert "/50 " in table[1] and table[1].endswith("/100")
    assert all(line.split()[-2:] == ["+0", "+0"] for line in table[2:5]), table
    assert "Equivalent: every layout trains this config as one process does, within float64 " in (
        output
    )


@pytest.mark.slow
def test_fsdp_processes_are_compared_when_the_config_chose_fsdp(tmp_path, tiny_data):
    """parallel=fsdp in the overrides: the processes compared shard the model, under the user's
    own FSDP settings (here the whole model as one unit)."""
    overrides = ["parallel=fsdp", "parallel.shard_modules=[]"]
    output = printed(ok(check(overrides, tmp_path, tiny_data)))
    table = output[output.index("layout ") :].splitlines()
    assert [line.split("  ")[0] for line in table[1:5]] == [
        name.replace("DDP", "FSDP") for name in LAYOUTS
    ]
    assert "Equivalent: every layout trains this config as one process does" in output
    assert "parallel=fsdp and trainer.accumulate_grad_batches change only the speed" in output


@pytest.mark.slow
def test_batchnorm_without_sync_is_named(tmp_path, tiny_data):
    result = check(["model=cnn_bn"], tmp_path, tiny_data)
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert (
        "Not equivalent: 1 process × 2 micro-batches and 2 DDP processes and 2 DDP processes × 2 "
        "micro-batches trained something else than 1 process did (tolerance 1e-09). Likely causes:"
        "\n- BatchNorm layers (bn1, bn2) normalise each process's share and each micro-batch by "
        "its own statistics"
    ) in printed(result)


@pytest.mark.slow
def test_a_parameter_without_gradient_is_named(tmp_path, tiny_data):
    """DDP (find_unused_parameters=false) fails at the second step; the cause names the
    parameters that got no gradient."""
    result = check([user_model("UnusedBranch")], tmp_path, tiny_data)
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert (
        "- 2 DDP processes and 2 DDP processes × 2 micro-batches stopped at step 2: Expected to "
        "have finished reduction in the prior iteration before starting a new one\n"
        "- parameters that get no gradient: aux_head.weight, aux_head.bias. DDP with "
        "parallel.find_unused_parameters=false fails on them: set it true"
    ) in printed(result)


@pytest.mark.slow
def test_unused_parameters_are_equivalent_once_ddp_looks_for_them(tmp_path, tiny_data):
    """The fix the cause suggests: the user's own DDP settings are the ones checked."""
    overrides = [user_model("UnusedBranch"), "parallel=ddp", "parallel.find_unused_parameters=true"]
    assert "Equivalent: every layout" in printed(ok(check(overrides, tmp_path, tiny_data)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "cause"),
    [
        ("Noisy", "- the model draws random numbers in training (not in a dropout layer"),
        ("Drifting", "- in 2 DDP processes, rank 1's fc2.bias differed from rank 0's after step 3"),
    ],
)
def test_randomness_and_weights_changed_on_one_rank_are_named(tmp_path, tiny_data, model, cause):
    result = check([user_model(model)], tmp_path, tiny_data)
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert cause in printed(result)


@pytest.mark.slow
def test_a_transformer_with_adam_is_equivalent_in_float64(tmp_path, tiny_data):
    """A small ViT (biased attention projections) with Adam, 20 steps: the key projection's bias
    has a gradient that is 0 up to rounding, which Adam turns into steps; in float64 that noise
    is 1e-16 of the terms and the layouts agree."""
    overrides = [user_model("SmallViT"), "optimizer=adam"]
    output = printed(ok(check(overrides, tmp_path, tiny_data, steps=None)))
    assert "Equivalent: every layout trains this config as one process does, within float64 " in (
        output
    )


@pytest.mark.slow
def test_in_float32_a_transformer_with_adam_names_the_rounding(tmp_path, tiny_data):
    """The same ViT in its training precision (debug.precision=train): it differs by more than
    float32's tolerance, and the cause named is the bias whose gradient is rounding."""
    overrides = [user_model("SmallViT"), "optimizer=adam", "debug.precision=train"]
    result = check(overrides, tmp_path, tiny_data, steps=None)
    output = printed(result)
    assert result.returncode == 1 and "Traceback" not in output
    assert "in trainer.precision=32 (debug.precision=train)" in output.splitlines()[0]
    assert (
        "- parameters whose gradient is zero up to rounding (at most 1e-06 of the largest, in the "
        "reference): blocks.layers.0.self_attn.in_proj_bias (32 of 96); the largest weight "
        "difference is in blocks.layers.0.self_attn.in_proj_bias. The optimizer divides each "
        "gradient by its own running size"
    ) in output


@pytest.mark.slow
def test_a_model_that_cannot_run_in_float64_is_compared_in_its_own_precision(tmp_path, tiny_data):
    result = check([user_model("Float32Inside")], tmp_path, tiny_data, steps=2)
    output = printed(ok(result))
    assert (
        "Comparing in trainer.precision=32 instead, with its tolerance: the model fails in "
        "float64 (expected m1 and m2 to have the same dtype"
    ) in output
    assert "within float32 rounding (tolerance 1e-05)" in output


def test_under_torchrun_it_says_how_to_run_it(tmp_path, tiny_data):
    result = check([], tmp_path, tiny_data, nproc=1)
    assert result.returncode != 0
    assert (
        "debug=equivalence starts its own DDP processes: run python train.py debug=equivalence "
        "... without torchrun."
    ) in printed(result)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.batch_size=63", r"data.batch_size=63 does not split in 2: use an even one"),
        ("debug.steps=0", r"debug.steps=0: train at least 1 step in each layout"),
        ("debug.tolerance=0", r"debug.tolerance=0: use a bound above 0, or null"),
        ("debug.precision=32", r"debug.precision=32: use 64 .compare in float64. or train"),
    ],
)
def test_what_it_cannot_check_is_refused_in_one_sentence(override, message):
    with pytest.raises(UserError, match=message):
        equivalence.check(compose_config("debug=equivalence", override))


@pytest.mark.unit
def test_the_layouts_follow_the_config():
    """Micro-batches: the config's own accumulation, else 2; none where a process's share is
    too small to split, or DDP's static_graph cannot accumulate."""
    cases = {
        "": 2,
        "trainer.accumulate_grad_batches=4": 4,
        "data.batch_size=2": None,
        "parallel=ddp parallel.static_graph=true": None,
    }
    for overrides, micro in cases.items():
        cfg = compose_config("debug=equivalence", *overrides.split())
        assert equivalence.micro_batches(cfg, read_settings(cfg)) == micro, overrides
    assert equivalence.layout_names(4) == [
        "1 process (reference)", "1 process × 4 micro-batches", "2 DDP processes",
        "2 DDP processes × 4 micro-batches",
    ]  # fmt: skip
    assert equivalence.layout_names(None) == ["1 process (reference)", "2 DDP processes"]


def difference(steps: list[float]) -> Difference:
    """A layout's difference from the reference with these per-step relative loss differences."""
    worst = max(steps)
    return Difference((worst, steps.index(worst) + 1), (worst, "fc1.weight"), 0.0, {}, None,
                      True, False, {}, steps)  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("steps", "cause"),
    [
        ([3e-2, 4e-2, 5e-2], "in 2 DDP processes the loss differs from the first step (3.0e-02)"),
        (
            [1e-7, 2e-7, 1e-7, 4e-3, 5e-3],
            "in 2 DDP processes the loss jumps at step 4, from rounding (2e-07 up to there) to "
            "4.0e-03: a near tie",
        ),
        (
            [1e-6, 4e-6, 9e-6, 3e-5],
            "in 2 DDP processes the loss difference grows from step 1 (1e-06) to 3.0e-05 at step 4",
        ),
    ],
)
def test_the_course_of_the_loss_difference_is_named(steps, cause):
    """A difference from the first step is a real one; a jump from rounding level at one step is
    a near tie that flipped; a steady growth compounds."""
    rows = {"2 DDP processes": difference(steps)}
    assert equivalence.loss_course(["2 DDP processes"], rows, 1e-5).startswith(cause)


@pytest.mark.unit
def test_gradients_that_are_rounding_are_named_under_an_adaptive_optimizer():
    """From the reference's own gradients: elements at most 1e-6 of the largest, not exactly 0
    (those stay 0 in every layout), under an optimizer that divides by the gradients' size."""
    gradients = {"fc.weight": torch.tensor([0.5, 0.01, 0.0]), "k.bias": torch.tensor([3e-9, 0.2])}
    reference = Trace(gradients=gradients, adaptive=True)
    cause = equivalence.zero_gradients(reference, "k.bias")
    assert cause.startswith(
        "parameters whose gradient is zero up to rounding (at most 1e-06 of the largest, in the "
        "reference): k.bias (1 of 2); the largest weight difference is in k.bias."
    )
    assert equivalence.zero_gradients(Trace(gradients=gradients, adaptive=False), "k.bias") is None
