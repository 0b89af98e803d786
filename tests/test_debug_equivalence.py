"""`python train.py debug=equivalence`: exit 0 where 2 DDP processes and micro-batches train the
config as one process does; exit 1, naming the likely cause, where they do not; one sentence for
what it cannot check. It compares in float64 unless asked (debug.precision=train) or the model
cannot run in it."""

import re

import pytest
import torch
from conftest import TESTS, compose_config, offline_env, ok, printed, train

from src.engine.build import read_settings
from src.engine.errors import UserError
from src.engine.tools import equivalence
from src.engine.tools.equivalence import Difference, Trace

LAYOUTS = ["1 process (reference)", "1 process × 2 micro-batches", "2 DDP processes",
           "2 DDP processes × 2 micro-batches"]  # fmt: skip
FORK = f"hydra.searchpath=[file://{TESTS}/conf]"  # tests/conf/parallel/: a fork's modes


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
    (the reference's out of the split's 50 and 100 images), and each layout's checkpoint.monitor
    value (val/acc), the reference's too. These are the README's commands,
    `python train.py debug=equivalence` (the MLP, with its default 20 steps) and
    `python train.py debug=equivalence model=cnn`."""
    overrides = [] if model == "mlp" else [f"model={model}"]  # the MLP is the default model
    output = printed(ok(check(overrides, tmp_path, tiny_data, steps=steps)))
    assert (
        f"Training {steps or 20} steps in each layout, in float64, so that rounding cannot pass "
        "for a difference (debug.precision=train: in the config's own precision), dropout off, on "
        "the CPU (gloo)"
    ) in output.splitlines()[0]
    table = [re.split(r"\s{2,}", line) for line in output[output.index("layout ") :].splitlines()]
    assert table[0] == ["layout", "loss (step)", "weights (where)", "val/acc", "val correct",
                        "test correct"]  # fmt: skip
    assert [line[0] for line in table[1:5]] == LAYOUTS
    assert table[1][4].endswith("/50") and table[1][5].endswith("/100")
    assert all(line[-2:] == ["+0", "+0"] for line in table[2:5]), table
    correct = int(table[1][4].split("/")[0])  # the reference's val/acc is its count out of 50
    assert all(line[3] == f"{correct / 50:.4f}" for line in table[1:5]), table
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


@pytest.mark.parametrize("mode", ["scaled_ddp", pytest.param("bf16_ddp", marks=pytest.mark.slow)])
def test_gradients_that_differ_are_named_at_the_first_step_whose_weights_differ(
    tmp_path, tiny_data, mode
):
    """A fork's DDP mode whose gradients differ from one process's (tests/equivalence_forks.py):
    each scaled by 1.01, or sent in bfloat16. Step 1's loss agrees, since the weights differ only
    after its update: the weights after each step name the difference, not a near tie."""
    result = check([FORK, f"parallel={mode}"], tmp_path, tiny_data, steps=2)
    output = printed(result)
    assert result.returncode == 1 and "Traceback" not in output
    assert re.search(
        rf"\n- in 2 {mode.upper()} processes, the first step whose weights differ \(step 1, by "
        r"\d\.\de-0[5-7] against the rounding bound 1e-09, in fc\d\.(weight|bias)\): the layouts "
        r"compute other gradients or updates \(the loss of step 1 agrees: the forward is the "
        r"same\)\n",
        output,
    ), output
    assert "near tie" not in output


@pytest.mark.slow
def test_a_task_with_state_is_built_afresh_for_each_layout(tmp_path, tiny_data):
    """tests/equivalence_forks.py's task halves its label smoothing after each evaluation, and
    the checkpoint holds its count: a layout that took the task the one before it had evaluated
    with would train with another loss from its first step."""
    overrides = ["task._target_=equivalence_forks.HalvesItsSmoothing", "task.label_smoothing=0.2"]
    output = printed(ok(check(overrides, tmp_path, tiny_data, steps=2)))
    assert "Equivalent: every layout trains this config as one process does" in output


@pytest.mark.slow
def test_an_average_of_the_weights_is_kept_and_evaluated_in_each_layout(tmp_path, tiny_data):
    """callbacks=ema (src/callbacks.py), an average that moves fast (decay 0.5): each layout's
    own, set up as its training starts, and its test evaluates it (the callback says so, once
    in each layout), equal to one process's in float64."""
    overrides = ["callbacks=ema", "callbacks.ema.decay=0.5"]
    output = printed(ok(check(overrides, tmp_path, tiny_data, steps=2)))
    assert output.count("The test evaluates callbacks.ema's average of these weights") == 4
    assert "Equivalent: every layout trains this config as one process does" in output


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


def difference(losses: list[float], weights: list[float], evaluated: float = 0.0) -> Difference:
    """A layout's difference from the reference with these per-step relative loss and weight
    differences (the weights' in fc2.weight) and this validation loss difference."""
    return Difference(
        steps=losses, weight_steps=[(w, "fc2.weight") for w in weights],
        weight=(max(weights), "fc2.weight"), eval_losses={"val": evaluated}, correct={},
    )  # fmt: skip


ROUNDING = [2e-16, 1e-16, 3e-16, 2e-16, 1e-16]  # what float64 rounding leaves, at each step


@pytest.mark.unit
@pytest.mark.parametrize(
    ("losses", "weights", "float64", "cause"),
    [
        (
            [3e-2, 4e-2, 5e-2], [1e-3, 2e-3, 3e-3], True,
            "in 2 DDP processes the loss differs from the first step (3.0e-02): the layouts "
            "compute something else",
        ),
        (
            ROUNDING, [5e-6, 6e-6, 7e-6, 8e-6, 9e-6], True,
            "in 2 DDP processes, the first step whose weights differ (step 1, by 5.0e-06 against "
            "the rounding bound 1e-09, in fc2.weight): the layouts compute other gradients or "
            "updates (the loss of step 1 agrees: the forward is the same)",
        ),
        (
            ROUNDING, [1e-11, 1e-10, 8e-10, 3e-9, 1e-8], True,
            "in 2 DDP processes, the first step whose weights differ (step 4, by 3.0e-09 against "
            "the rounding bound 1e-09, in fc2.weight), after a difference that grew from 1e-11 at "
            "step 1: the layouts compute other gradients or updates",
        ),
        (
            [*ROUNDING[:4], 4e-3], [*ROUNDING[:3], 5e-3, 6e-3], True,
            "in 2 DDP processes the weights agree with the reference's to rounding (3e-16) up to "
            "step 3 and jump at step 4 (by 5.0e-03 against the rounding bound 1e-09, in "
            "fc2.weight): a near tie (a ReLU, a max) that rounding tipped",
        ),
        (
            [*ROUNDING[:4], 4e-3], [*ROUNDING[:3], 5e-3, 6e-3], False,
            "in 2 DDP processes the weights agree with the reference's to rounding (3e-16) up to "
            "step 3 and jump at step 4 (by 5.0e-03 against the rounding bound 1e-09, in "
            "fc2.weight): a near tie that rounding tipped, or a difference in what that step "
            "computes; debug.precision=64 tells them apart",
        ),
    ],
)  # fmt: skip
def test_where_the_layouts_part_is_named(losses, weights, float64, cause):
    """A loss that differs from step 1 is another forward; weights that differ after step 1, or
    grow past rounding, other gradients or updates; a jump from rounding's level at one step may
    be a near tie, claimed only where the comparison is in float64."""
    rows = {"2 DDP processes": difference(losses, weights)}
    assert equivalence.course(["2 DDP processes"], rows, 1e-9, float64).startswith(cause)


@pytest.mark.unit
def test_weights_equal_to_the_bit_and_ranks_that_drifted_are_said_so():
    """Weights equal to the bit up to a jump are "exactly" so; a layout whose DDP ranks drifted
    apart has that cause, named on its own, and no course."""
    rows = {"2 DDP processes": difference([0.0, 0.0, 0.0], [0.0, 0.0, 5e-3])}
    assert equivalence.course(["2 DDP processes"], rows, 1e-9, True).startswith(
        "in 2 DDP processes the weights agree with the reference's exactly up to step 2 and jump "
        "at step 3 (by 5.0e-03"
    )
    rows["2 DDP processes"].drifted = True
    assert equivalence.course(["2 DDP processes"], rows, 1e-9, True) is None


@pytest.mark.unit
def test_layouts_that_train_alike_and_evaluate_otherwise_are_told_so():
    """Weights within rounding after every step, a validation loss 1e-3 apart: the evaluation."""
    rows = {"2 DDP processes": difference(ROUNDING, ROUNDING, evaluated=1e-3)}
    assert equivalence.course(["2 DDP processes"], rows, 1e-9, True) == (
        "in 2 DDP processes the weights agree with the reference's after every step (within "
        "1e-09), and its val loss differs (1.0e-03): the evaluation differs (the weights it "
        "evaluates, the model's evaluation mode or buffers)"
    )


@pytest.mark.unit
def test_each_step_s_weights_are_compared_through_their_projections():
    """2 numbers a tensor and step: the projections of weights 1e-6 apart (in the root mean
    square, one element's) differ by about that, the same weights' by nothing."""
    weights = torch.linspace(-0.5, 0.5, 10_000, dtype=torch.float64)
    moved = weights.clone()
    moved[7] += 1e-4  # a root mean square of 1e-6
    (a, largest), (b, _) = (equivalence.projections({"w": w})["w"] for w in (weights, moved))
    equivalence.direction.cache_clear()  # made afresh: the same
    assert largest == 0.5 and equivalence.projections({"w": weights})["w"][0] == a
    assert 1e-8 < abs(a - b) < 4e-6


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
