"""Optimizer parameter groups: `trainer.weight_decay_on=matrices` (weight decay on the weights of 2
or more dimensions, none on biases and normalisation layers) and a model's own
`param_groups(weight_decay)`, in this process (the rule, the checks of a model's groups, the
optimizer's state with several groups, plain and under FSDP), then for real: the groups in the
optimizer of none, ddp and fsdp runs (torchrun, gloo), a resume with them exact, a resume whose
groups differ refused. parallel=dp needs GPUs and is not run here; it builds its optimizer over
the same plain model's parameters as every mode (`build_parts`).

The models a run names (`model._target_=test_param_groups.OwnGroups`) are here, imported with
tests/ on PYTHONPATH, as tests/user_models.py's are."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import (
    LOSS_ATOL,
    TESTS,
    WEIGHT_ATOL,
    assert_same_training,
    compose_config,
    last,
    offline_env,
    ok,
    printed,
    read_metrics,
    run_dirs,
    train,
)
from torch import nn

from src.engine.build import param_groups, read_settings
from src.engine.checkpoint import OptimizerState
from src.engine.errors import UserError
from src.engine.parallel import fsdp
from src.models import MLP


class Mixed(nn.Module):
    """A layer of each kind the rule sorts: an embedding, a convolution and a linear layer (their
    weights decay), BatchNorm and LayerNorm (their weights do not), and biases (nor do they)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(4, 3)
        self.ln = nn.LayerNorm(3)


class OwnGroups(MLP):
    """A fork's model with groups of its own: the output layer's bias without weight decay, the
    rest with the optimizer's (3 and 1 parameters: not the rule's 2 and 2)."""

    def param_groups(self, weight_decay: float) -> list[dict]:
        rest = [p for name, p in self.named_parameters() if name != "fc2.bias"]
        return [
            {"params": rest, "weight_decay": weight_decay},
            {"params": [self.fc2.bias], "weight_decay": 0.0},
        ]


class LeavesOut(MLP):
    """Groups that forget the biases."""

    def param_groups(self, weight_decay: float) -> list[dict]:
        return [{"params": [self.fc1.weight, self.fc2.weight], "weight_decay": weight_decay}]


class Gives(nn.Module):
    """Two linear layers whose `param_groups` is what `groups(self)` gives."""

    def __init__(self, groups) -> None:
        super().__init__()
        self.fc1, self.fc2, self.groups = nn.Linear(4, 3), nn.Linear(3, 2), groups

    def param_groups(self, weight_decay: float):
        return self.groups(self)


def names(model: nn.Module, groups: list[dict]) -> list[list[str]]:
    """Each group's parameters, by their names in `model`."""
    named = {id(p): name for name, p in model.named_parameters()}
    return [[named[id(p)] for p in group["params"]] for group in groups]


@pytest.mark.unit
def test_matrices_decay_and_biases_and_normalisation_layers_do_not():
    model = Mixed()
    groups = param_groups(model, "matrices", 0.1)
    assert names(model, groups) == [
        ["embed.weight", "conv.weight", "fc.weight"],
        ["conv.bias", "bn.weight", "bn.bias", "fc.bias", "ln.weight", "ln.bias"],
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.3)  # the decay: the optimizer's
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.3, 0.0]
    # all: torch's default, one group of every parameter in the model's order, as before the key.
    (group,) = param_groups(model, "all", 0.1)
    assert group.keys() == {"params"}
    assert names(model, [group]) == [[name for name, _ in model.named_parameters()]]
    # A model without biases or normalisation layers: one group, not an empty second.
    matrices = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))
    assert names(matrices, param_groups(matrices, "matrices", 0.1)) == [["0.weight", "1.weight"]]


@pytest.mark.unit
def test_a_models_own_groups_come_first_and_are_given_the_decay(caplog):
    model = OwnGroups(1, 4, 8, 3)
    with caplog.at_level("INFO", logger="train"):
        groups = param_groups(model, "all", 0.25)
    assert not caplog.records  # nothing to say: the key was left at its default
    assert names(model, groups) == [["fc1.weight", "fc1.bias", "fc2.weight"], ["fc2.bias"]]
    assert [g["weight_decay"] for g in groups] == [0.25, 0.0]
    with caplog.at_level("INFO", logger="train"):
        assert names(model, param_groups(model, "matrices", 0.25)) == names(model, groups)
    assert [r.getMessage() for r in caplog.records] == [
        "OwnGroups.param_groups gives the optimizer's groups: trainer.weight_decay_on=matrices is "
        "not used."
    ]
    # A frozen parameter may be left out; a parameter as a group's "params", or a generator, is
    # taken as torch takes it.
    frozen = Gives(lambda m: [{"params": m.fc1.parameters()}, {"params": m.fc2.weight}])
    frozen.fc2.bias.requires_grad_(False)
    assert names(frozen, param_groups(frozen, "all", 0.0)) == [
        ["fc1.weight", "fc1.bias"],
        ["fc2.weight"],
    ]


WHAT_IT_RETURNS = (
    ": it returns the optimizer's groups as torch's optimizers take them, a list of dicts each "
    'with "params" (some of the model\'s parameters) and the settings they change, e.g. '
    '[{"params": matrices}, {"params": biases, "weight_decay": 0.0}].'
)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("groups", "said"),
    [
        (lambda m: m.parameters(), "returned a generator" + WHAT_IT_RETURNS),
        (lambda m: [], "returned no group" + WHAT_IT_RETURNS),
        (lambda m: [list(m.parameters())], "returned a group that is a list" + WHAT_IT_RETURNS),
        (
            lambda m: [{"parameters": list(m.parameters()), "lr": 0.1}],
            'returned a group without "params" (its keys: parameters, lr)' + WHAT_IT_RETURNS,
        ),
        (
            lambda m: [{"params": [m.fc1.weight, m.fc2.weight]}],
            "leaves out 2 of the model's parameters (fc1.bias, fc2.bias), which would never "
            "train: give each a group (or freeze one not to train, requires_grad=False).",
        ),
        (
            lambda m: [{"params": m.parameters()}, {"params": [m.fc2.bias], "weight_decay": 0}],
            "puts fc2.bias in more than one group (or twice in one): torch's optimizers take each "
            "parameter once; give each one group.",
        ),
        (
            lambda m: [{"params": [*m.parameters(), m.fc1.weight]}],
            "puts fc1.weight in more than one group (or twice in one)",
        ),
        (
            lambda m: [{"params": [*m.parameters(), torch.zeros(3, requires_grad=True)]}],
            "gives 1 value that is not among the model's parameters (a tensor of shape (3,)): "
            "take them from self.named_parameters() as it is called (FSDP replaces the parameters "
            "as it wraps the model, before the optimizer's groups are made).",
        ),
        (
            lambda m: [{"params": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]}],
            "gives 4 values that are not among the model's parameters ('fc1.weight', 'fc1.bias', "
            "'fc2.weight', …)",
        ),
    ],
    ids=[
        "generator",
        "empty",
        "list",
        "no-params",
        "left-out",
        "twice",
        "twice-in-one",
        "stranger",
        "names",
    ],  # fmt: skip
)
def test_a_models_groups_that_do_not_fit_it_are_one_sentence(groups, said):
    """Named by the model's class and file; the whole sentence, no more."""
    with pytest.raises(UserError) as refused:
        param_groups(Gives(groups), "matrices", 0.1)
    message = str(refused.value)
    assert message.startswith("Gives.param_groups (tests/test_param_groups.py) " + said), message
    assert ". " not in message.replace("e.g. ", "") and refused.value.every_rank  # every rank's


@pytest.mark.unit
def test_the_key_is_a_trainer_setting_with_its_choices():
    assert read_settings(compose_config()).trainer.weight_decay_on == "all"
    settings = read_settings(compose_config("trainer.weight_decay_on=matrices"))
    assert settings.trainer.weight_decay_on == "matrices"
    with pytest.raises(UserError, match=r"^trainer.weight_decay_on=biases is not allowed: use "
                       r"all or matrices\.$"):  # fmt: skip
        read_settings(compose_config("trainer.weight_decay_on=biases"))


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    images = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad()
    F.cross_entropy(model(images), torch.arange(8) % 3).backward()
    optimizer.step()


REFUSED = (
    "The checkpoint's optimizer was saved with 2 parameter groups (of 2 and 2 parameters), and "
    "this run's has 1 (of 4): resume with the model and trainer.weight_decay_on it was trained "
    "with, or start a new run from its weights with init_from=PATH."
)


@pytest.mark.unit
def test_an_optimizer_state_of_other_groups_is_refused_and_one_of_the_same_keeps_our_settings():
    torch.manual_seed(0)
    model = MLP(1, 4, 8, 3)
    saved = torch.optim.SGD(param_groups(model, "matrices", 0), lr=0.1, momentum=0.9,
                            weight_decay=0.5)  # fmt: skip
    sgd_step(model, saved)
    state = OptimizerState(saved, model).state_dict()
    other = torch.optim.SGD(param_groups(model, "all", 0), lr=0.1, momentum=0.9)
    with pytest.raises(UserError) as refused:
        OptimizerState(other, model).load_state_dict(copy.deepcopy(state))
    assert str(refused.value) == REFUSED and refused.value.every_rank
    assert not other.state  # nothing loaded
    three = [{"params": [model.fc1.weight]}, {"params": [model.fc1.bias]},
             {"params": [model.fc2.weight, model.fc2.bias]}]  # fmt: skip
    with pytest.raises(UserError, match=r"saved with 2 parameter groups \(of 2 and 2 parameters"
                       r"\), and this run's has 3 \(of 1, 1 and 2\): "):  # fmt: skip
        OptimizerState(torch.optim.SGD(three, lr=0.1), model).load_state_dict(state)
    # The same groups: the moments continue, each group's settings are this run's.
    alike = torch.optim.SGD(param_groups(model, "matrices", 0), lr=0.2, momentum=0.9,
                            weight_decay=0.1)  # fmt: skip
    OptimizerState(alike, model).load_state_dict(copy.deepcopy(state))
    assert [(g["lr"], g["weight_decay"]) for g in alike.param_groups] == [(0.2, 0.1), (0.2, 0.0)]
    for p in model.parameters():
        assert torch.equal(alike.state[p]["momentum_buffer"], saved.state[p]["momentum_buffer"])


@pytest.fixture
def one_rank():
    """A process group of this one process (gloo), as FSDP needs one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.unit
def test_fsdps_optimizer_state_with_groups_is_a_plain_optimizers_and_loads_back(one_rank):
    """FSDP names its parameters (fully qualified names), a plain optimizer numbers them in the
    groups' order, which the rule changes (fc1.weight, fc2.weight, fc1.bias, fc2.bias): gathered,
    the state equals a plain optimizer's after the same step, and loads back into the groups."""
    torch.manual_seed(0)
    plain = MLP(1, 4, 8, 3)
    sharded = fsdp.shard(copy.deepcopy(plain), ["Linear"], True, None, torch.device("cpu"))
    optimizers = [
        torch.optim.AdamW(param_groups(m, "matrices", 0), lr=0.1, weight_decay=0.3)
        for m in (plain, sharded)
    ]
    for model, optimizer in zip((plain, sharded), optimizers, strict=True):
        sgd_step(model, optimizer)
    saved, expected = (
        OptimizerState(optimizers[1], sharded).state_dict(),
        optimizers[0].state_dict(),
    )
    assert saved["param_groups"] == expected["param_groups"]
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]]
    for number, moments in expected["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(saved["state"][number][key], value, rtol=0, atol=0)
    fresh = fsdp.shard(MLP(1, 4, 8, 3), ["Linear"], True, None, torch.device("cpu"))
    optimizer = torch.optim.AdamW(param_groups(fresh, "matrices", 0), lr=0.2, weight_decay=0.7)
    OptimizerState(optimizer, fresh).load_state_dict(copy.deepcopy(saved))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.7, 0.0]  # this run's
    reloaded = OptimizerState(optimizer, fresh).state_dict()
    for number, moments in saved["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(reloaded["state"][number][key], value, rtol=0, atol=0)
    with pytest.raises(UserError, match="saved with 2 parameter groups"):
        one = torch.optim.AdamW(param_groups(fresh, "all", 0), lr=0.2)
        OptimizerState(one, fresh).load_state_dict(copy.deepcopy(saved))


# test_equivalence.py's recipe (SGD with momentum, 27 steps of the MLP), with weight decay and no
# schedule (a resume re-plans none): each mode's losses and weights agree to its bounds.
RECIPE = [
    "logger=none",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "optimizer.momentum=0.9",
    "optimizer.weight_decay=0.1",
    "data.batch_size=24",
    "trainer.log_every_n_steps=1",
]
MODES = {"none": ([], None), "ddp2": (["parallel=ddp"], 2), "fsdp2": (["parallel=fsdp"], 2)}
SLOW = pytest.mark.slow  # a torchrun run beyond each mode's one


MATRICES = "trainer.weight_decay_on=matrices"
OWN = "model._target_=test_param_groups.OwnGroups " + MATRICES  # the model's groups win


class Runs(dict):
    """Each (mode, overrides) run's folder and output, trained for 3 epochs (27 steps) the first
    time a test asks for it."""

    def __init__(self, tmp_path_factory, data):
        super().__init__()
        self.tmp_path_factory, self.data = tmp_path_factory, data

    def __missing__(self, key: tuple[str, str]):
        mode, extra = key
        overrides, nproc = MODES[mode]
        tmp = self.tmp_path_factory.mktemp(mode)
        given = [f"data.root={self.data}", *RECIPE, "trainer.epochs=3", *overrides, *extra.split()]
        result = ok(train(given, tmp, nproc=nproc, env=offline_env(PYTHONPATH=TESTS)))
        (run_dir,) = run_dirs(tmp)
        self[key] = run_dir, printed(result)
        return self[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory, tiny_data)


def groups_saved(run_dir) -> list[tuple[int, float, list[int]]]:
    """The optimizer's groups in last.pt: each one's size, weight decay, and its parameters'
    dimensions (those of their momentum buffers, whole however the mode held them)."""
    state = last(run_dir)["optimizer"]
    return [
        (len(g["params"]), g["weight_decay"],
         [state["state"][n]["momentum_buffer"].dim() for n in g["params"]])
        for g in state["param_groups"]
    ]  # fmt: skip


def assert_trains_as_one_process(run_dir, reference) -> None:
    """The per-step losses and the final weights of `run_dir` are `reference`'s, to the bounds
    test_equivalence.py holds every mode to (conftest.py says why they are what they are)."""
    weights, expected = last(run_dir)["model"], last(reference)["model"]
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=WEIGHT_ATOL)
    steps, expected_steps = read_metrics(run_dir)[0], read_metrics(reference)[0]
    assert len(steps) == len(expected_steps) == 27
    for ours, ref in zip(steps, expected_steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=0, abs_tol=LOSS_ATOL)


@pytest.mark.parametrize("mode", ["none", *(pytest.param(m, marks=SLOW) for m in list(MODES)[1:])])
def test_the_rules_groups_train_in_every_mode(runs, mode):
    """The optimizer of every mode holds the rule's groups, the MLP's two weight matrices with
    the optimizer's decay and its two biases without, and trains what one process trains."""
    run_dir, _ = runs[mode, MATRICES]
    assert groups_saved(run_dir) == [(2, 0.1, [2, 2]), (2, 0.0, [1, 1])]
    assert_trains_as_one_process(run_dir, runs["none", MATRICES][0])


def test_the_groups_settings_are_what_trains(runs):
    """The default, every parameter in one group, decays the biases too: they end far from the
    rule's, by more than 100 times the bound the modes are held to (measured: 0.025 and 0.028
    apart, where ddp2's and fsdp2's weights are 3.7e-8 from one process's)."""
    everything, undecayed = runs["none", ""][0], runs["none", MATRICES][0]
    assert groups_saved(everything) == [(4, 0.1, [2, 1, 2, 1])]
    decayed, kept = last(everything)["model"], last(undecayed)["model"]
    for name in ("fc1.bias", "fc2.bias"):
        assert (decayed[name] - kept[name]).abs().max() > 100 * WEIGHT_ATOL, name


@pytest.mark.parametrize("mode", ["none", pytest.param("fsdp2", marks=SLOW)])
def test_a_models_own_groups_train_and_the_key_is_said_to_be_unused(runs, mode):
    """FSDP's parameters are new ones after wrapping: the model's groups are made of those."""
    run_dir, output = runs[mode, OWN]
    assert groups_saved(run_dir) == [(3, 0.1, [2, 1, 2]), (1, 0.0, [1])]
    unused = "OwnGroups.param_groups gives the optimizer's groups: trainer.weight_decay_on="
    assert output.count(unused + "matrices is not used.") == 1, output
    assert_trains_as_one_process(run_dir, runs["none", OWN][0])


@pytest.mark.parametrize("mode", ["none", pytest.param("fsdp2", marks=SLOW)])
def test_a_resume_with_groups_continues_exactly(runs, mode, tmp_path, tiny_data):
    """1 epoch, then resumed to 3: the uninterrupted run's weights, best.pt and metrics."""
    overrides, nproc = MODES[mode]
    parts = tmp_path / "parts"
    common = [f"data.root={tiny_data}", *RECIPE, *overrides, MATRICES, f"hydra.run.dir={parts}"]
    ok(train([*common, "trainer.epochs=1"], tmp_path, nproc=nproc))
    result = ok(train([*common, "trainer.epochs=3"], tmp_path, nproc=nproc))
    assert "Resuming at epoch 2, after 0 of its batches, step 9" in printed(result)
    assert groups_saved(parts) == [(2, 0.1, [2, 2]), (2, 0.0, [1, 1])]
    assert_same_training(parts, runs[mode, MATRICES][0])


@pytest.mark.parametrize("mode", ["none", pytest.param("fsdp2", marks=SLOW)])
def test_a_resume_whose_groups_differ_is_refused_in_one_sentence(runs, mode, tmp_path, tiny_data):
    """The rule's checkpoint (2 groups) resumed with the default (1): before training, nothing
    written; under torchrun said once, by rank 0."""
    overrides, nproc = MODES[mode]
    saved, run_dir = runs[mode, MATRICES][0] / "checkpoints" / "last.pt", tmp_path / "run"
    given = [f"data.root={tiny_data}", *RECIPE, *overrides, "trainer.epochs=4", f"resume={saved}",
             f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = train(given, tmp_path, nproc=nproc)
    assert result.returncode != 0
    said = printed(result).split("FAILED\n")[0]  # under torchrun: before torchrun's report
    assert said.count(REFUSED) == 1, said
    assert printed(result).count("Traceback") == (1 if nproc else 0)  # torchrun's own, if any
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_a_models_groups_that_leave_a_parameter_out_stop_the_run_before_training(
    tmp_path, tiny_data
):
    given = [f"data.root={tiny_data}", *RECIPE, "model._target_=test_param_groups.LeavesOut"]
    result = train(given, tmp_path, env=offline_env(PYTHONPATH=TESTS))
    assert result.returncode != 0
    said = "test_param_groups.py) leaves out 2 of the model's parameters (fc1.bias, fc2.bias), "
    assert printed(result).count(said) == 1 and "Traceback" not in printed(result)
    assert not list((tmp_path / "outputs").rglob("metrics.jsonl"))


@pytest.mark.slow
def test_a_sharded_resume_trains_with_this_configs_group_settings(tmp_path, tiny_data):
    """checkpoint.sharded=true loads the optimizer from each rank's shards (DCP), which hold the
    saved groups' settings: the resumed run still trains with this config's learning rate and
    its weight decay, as a plain checkpoint's resume does."""
    run_dir = tmp_path / "run"
    common = [f"data.root={tiny_data}", *RECIPE, "parallel=fsdp", "checkpoint.sharded=true",
              MATRICES, f"hydra.run.dir={run_dir}"]  # fmt: skip
    ok(train([*common, "trainer.epochs=1"], tmp_path, nproc=2))
    ok(train([*common, "trainer.epochs=2", "optimizer.lr=0.5", "optimizer.weight_decay=0.2"],
             tmp_path, nproc=2))  # fmt: skip
    steps = read_metrics(run_dir)[0]
    assert {m["lr"] for m in steps if m["epoch"] == 1} == {0.05}
    assert {m["lr"] for m in steps if m["epoch"] == 2} == {0.5}
