"""Tasks (src/tasks.py): the contract of the template's two, the masked-token loss over uneven
ranks and micro-batches, exact evaluation, one sentence for each mistake a fork makes, and the
worked fork of docs/tasks.md, trained in every mode from the page's own code and commands.

The page's code blocks, each under the path named above it (`fork/mytask.py`:), are saved as
shown into a folder of the test's, and its `sh` block's commands are run from there as written,
with the overrides that make the runs small."""

import copy
import importlib
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    CONF,
    EVAL_LOSS_ATOL,
    LOSS_ATOL,
    REPO,
    VAL_SIZE,
    WEIGHT_ATOL,
    a_run,
    load,
    offline_env,
    ok,
    printed,
    read_metrics,
    train,
)
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from src.engine.build import build_model, read_settings
from src.engine.core.context import Parts, Run
from src.engine.core.evaluate import evaluate, float64_sum
from src.engine.core.loop import train_step
from src.engine.errors import UserError
from src.engine.guards import check_contract, check_first_batch
from src.engine.parallel import Process
from src.tasks import Classification, Regression

PAGE = REPO / "docs" / "tasks.md"

# A fork's mistakes, each a class a test names by `_target_` (written beside mytask.py).
MISTAKES = '''"""A fork's mistakes, one per class."""

import torch.nn.functional as F
from hydra.utils import get_class
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics.classification import MulticlassF1Score

import f1task
import mytask
from src.tasks import Classification


class PerToken(mytask.NextToken):
    """Returns each token's loss (reduction="none"), not their sum."""

    def loss(self, outputs, inputs, targets):
        return F.cross_entropy(
            outputs.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
        )


class MeanLoss(mytask.NextToken):
    """The mean over the batch's tokens (cross_entropy's default reduction), not their sum."""

    def loss(self, outputs, inputs, targets):
        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100)


class CountsBatches(MeanLoss):
    """The plain-PyTorch habit whole: the mean loss, and a count of 1 for a batch."""

    def count(self, inputs, targets):
        return 1


class OwnShareAccuracy(mytask.NextToken):
    """Its accuracy from the tokens this rank evaluated (state kept in the task), not from the
    sums summed over the ranks: a hand-written metric with the same flaw as a torchmetrics
    object with its sync off."""

    seen = right = 0

    def sums(self, outputs, inputs, targets):
        found = super().sums(outputs, inputs, targets)
        self.seen += int((targets != -100).sum())
        self.right += int(found["correct"].sum())
        return found

    def metrics(self, sums):
        metrics = {**super().metrics(sums), "acc": self.right / max(self.seen, 1)}
        self.seen = self.right = 0
        return metrics


class NothingCounted(mytask.NextToken):
    """Counts the targets of a label no token has: none, in every batch."""

    def count(self, inputs, targets):
        return (targets == -1).sum()


class Unfinished:
    """A loss and its count, but no sums or metrics for evaluation."""

    count, loss = mytask.NextToken.count, mytask.NextToken.loss


class MetricElsewhere(f1task.NextTokenF1):
    """Its metric made in sums() on a device the outputs are not on: meta, as a CPU machine has
    no other (on a GPU machine, the CPU, where a metric object is made by default)."""

    def sums(self, outputs, inputs, targets):
        self.f1 = MulticlassF1Score(32, average="macro", ignore_index=-100).to("meta")
        return super().sums(outputs, inputs, targets)


class Returns(nn.Module):
    """A model (`of`, built from the other keys) that returns its output with the features it
    computed from (its input, here): as a tuple, a list or a dict (`kind`)."""

    def __init__(self, kind, of="src.models.MLP", **keys):
        super().__init__()
        self.kind, self.net = kind, get_class(of)(**keys)

    def forward(self, x):
        y = self.net(x)
        return {"tuple": (y, x), "list": [y, x], "dict": {"logits": y, "features": x}}[self.kind]


class TakesLogitsAndFeatures(Classification):
    """Not a mistake: a task that takes a model's (logits, features), and learns from the logits."""

    takes = "a tuple (logits, features)"

    def check(self, outputs, inputs, targets):
        super().check(outputs[0], inputs, targets)

    def loss(self, outputs, inputs, targets):
        return super().loss(outputs[0], inputs, targets)

    def sums(self, outputs, inputs, targets):
        return super().sums(outputs[0], inputs, targets)


class FloatCounting(mytask.Counting):
    """The counting sequences, with their targets as floats."""

    def split(self, name):
        inputs, targets = super().split(name).tensors
        return TensorDataset(inputs, targets.float())
'''


def fork_files() -> dict[str, str]:
    """The page's files: each code block whole, under the line that names it (`fork/<path>`:)."""
    blocks = re.findall(
        r"^`(fork/\S+)`:\n\n```(?:python|yaml)\n(.*?)```", PAGE.read_text(), re.S | re.M
    )
    return dict(blocks)


def fork_commands(block: int = 0) -> list[str]:
    """The page's commands, a command a line: its first `sh` block (the fork's), or the second
    (the macro-F1 task's)."""
    return re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.S)[block].splitlines()


def write_fork(folder: Path) -> Path:
    """The page's files under `folder` (`folder/fork/mytask.py`, ...), and the mistakes."""
    for path, text in fork_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    (folder / "fork" / "mistakes.py").write_text(MISTAKES)
    return folder


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    """The fork written once for the in-process tests, `mytask` and `mistakes` importable."""
    folder = write_fork(tmp_path_factory.mktemp("fork")) / "fork"
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def compose_with_fork(fork: Path, *overrides: str):
    """The run's config as train.py composes it, with the fork's conf/ on Hydra's search path
    (what `--config-dir fork/conf` does on the command line)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        searchpath = f"hydra.searchpath=[file://{fork / 'conf'}]"
        return compose("config", overrides=[searchpath, *overrides])


def start_of_run(cfg):
    """What `train` (src/engine/app.py) does before training, in this process: the settings (the
    task built and checked against the monitor), the data and the first batch's count of loss
    terms, and the model with its preflight on two samples."""
    settings = read_settings(cfg)
    data = instantiate(cfg.data)
    data.setup(Process())
    run = Run(Process(), settings, data)
    check_first_batch(data, run.process, run.task)
    return settings, data, build_model(cfg, run, None)


# ---------------------------------------------------------------------------------------------
# The contract, in this process


@pytest.mark.unit
def test_the_page_lists_its_files_with_their_line_counts():
    """The table names each file the page's blocks hold, with its number of lines."""
    files = fork_files()
    listed = dict(re.findall(r"^\| `(fork/[^`]+)` \| (\d+) \|", PAGE.read_text(), re.M))
    assert {path: len(text.splitlines()) for path, text in files.items()} == {
        path: int(lines) for path, lines in listed.items()
    }
    assert set(files) >= {"fork/mytask.py", "fork/conf/experiment/counting.yaml"}


@pytest.mark.unit
def test_classification_keeps_the_contract():
    """One count per target (per pixel for N×H×W targets), the summed cross-entropy (label
    smoothing in the training loss only), per-sample sums the engine adds up, metrics from them,
    and a sentence for targets it cannot take."""
    inputs = torch.zeros(4, 3)
    outputs = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0], [1.0, 1.0, 0.0], [-2.0, 0.0, 2.0]])
    targets = torch.tensor([0, 2, 1, 0])  # argmax 0, 2, 0, 2: two right
    task = Classification()
    assert task.count(inputs, targets) == 4
    plain = F.cross_entropy(outputs, targets, reduction="none")
    torch.testing.assert_close(task.loss(outputs, inputs, targets), plain.sum())
    sums = task.sums(outputs, inputs, targets)
    torch.testing.assert_close(sums["loss"], plain)
    assert sums["correct"].tolist() == [True, True, False, False]
    totals = {"count": 4.0, **{key: float64_sum(value) for key, value in sums.items()}}
    metrics = task.metrics(totals)
    assert metrics == {"loss": totals["loss"] / 4, "acc": 0.5, "correct": 2}
    assert math.isclose(metrics["loss"], plain.double().mean().item(), rel_tol=1e-7)

    smoothed = Classification(label_smoothing=0.1)
    expected = F.cross_entropy(outputs, targets, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(smoothed.loss(outputs, inputs, targets), expected)
    assert not torch.allclose(expected, plain.sum())
    torch.testing.assert_close(smoothed.sums(outputs, inputs, targets)["loss"], plain)

    pixels = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 3, (2, 4, 5), generator=torch.Generator().manual_seed(1))
    assert task.count(pixels, labels) == 40
    torch.testing.assert_close(
        task.loss(pixels, pixels, labels), F.cross_entropy(pixels, labels, reduction="sum")
    )
    task.check(pixels, pixels, labels)  # one score per class for each pixel: taken
    with pytest.raises(UserError, match=r"^task=classification takes class numbers as targets"):
        task.check(outputs, inputs, targets.float())
    with pytest.raises(UserError, match=r"output is \(4, 3\) for targets of \(4, 1\), so it "):
        task.check(outputs, inputs, targets[:, None])


@pytest.mark.unit
def test_metrics_outside_the_tasks_bounds_break_the_contract():
    """A metric of two samples' sums outside the task's `bounds` is refused before training: an
    accuracy in percent (100 for two right predictions), a mean absolute error that is negative.
    The template's tasks, kept, are within them."""

    class PercentAccuracy(Classification):
        def metrics(self, sums):
            return {**super().metrics(sums), "acc": 100 * sums["correct"] / sums["count"]}

    class SignedError(Regression):
        def sums(self, outputs, inputs, targets):
            return {**super().sums(outputs, inputs, targets), "mae": outputs - targets}

    def check_metrics(task, outputs, inputs, targets):  # with the loss the preflight computes
        check_contract(task, outputs, inputs, targets, float(task.loss(outputs, inputs, targets)))

    inputs, targets = torch.zeros(2, 3), torch.tensor([0, 2])
    outputs = F.one_hot(targets, 3).float()  # both right
    check_metrics(Classification(), outputs, inputs, targets)
    with pytest.raises(UserError) as refused:
        check_metrics(PercentAccuracy(), outputs, inputs, targets)
    assert str(refused.value) == (
        "The task's metrics(sums) give acc=100 for two training samples, outside its bounds (0 to "
        "1): sums() must return each batch's terms summed over what count() counts, and metrics() "
        "divide those sums by sums['count'] (the task contract, src/engine/core/task.py)."
    )
    values = torch.tensor([[1.0], [2.0]])
    check_metrics(Regression(), values - 3, inputs, values)
    with pytest.raises(
        UserError, match=r"^The task's metrics\(sums\) give mae=-3 for two .* \(0 to ∞\)"
    ):
        check_metrics(SignedError(), values - 3, inputs, values)


@pytest.mark.unit
def test_regression_keeps_the_contract():
    """One count per target value, the summed squared error, squared and absolute errors the
    engine adds up; `target=input` learns the inputs; a sentence for what it cannot take."""
    inputs = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]])
    outputs = torch.tensor([[1.5, 2.0, 2.0], [0.0, 1.0, 4.0]])
    targets = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    task = Regression()
    assert task.count(inputs, targets) == 6
    torch.testing.assert_close(task.loss(outputs, inputs, targets), torch.tensor(12.25))
    sums = task.sums(outputs, inputs, targets)
    totals = {"count": 6.0, **{key: float64_sum(value) for key, value in sums.items()}}
    assert task.metrics(totals) == {"loss": 12.25 / 6, "mae": 6.5 / 6}

    autoencoder = Regression(target="input")
    assert autoencoder.count(inputs, targets[:, :1]) == 6  # the inputs' values, not the targets'
    torch.testing.assert_close(autoencoder.loss(outputs, inputs, targets), torch.tensor(5.25))
    with pytest.raises(UserError, match=r"^task.target=label is not allowed: use target or "):
        Regression(target="label")
    with pytest.raises(UserError, match=r"^task=regression learns real values, and the data's "):
        task.check(outputs, inputs, targets.long())
    with pytest.raises(UserError, match=r"the output is \(2, 3\) and the targets \(2, 1\)\.$"):
        task.check(outputs, inputs, targets[:, :1])


def next_token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 of the fork's counting sequences, of 16, 2 and 3 tokens, in an order that gives the 2
    ranks' shares (every 2nd sequence, as the sampler splits a batch) 36 and 12 tokens, in
    micro-batches of 32 and 4, and 6 and 6; the whole batch's 2 micro-batches hold 38 and 10."""
    mytask = importlib.import_module("mytask")
    inputs, targets = mytask.Counting(32, 300, 16, data_seed=0).split("train").tensors
    lengths = (targets != -100).sum(1)
    long, short, three = ((lengths == n).nonzero().flatten().tolist() for n in (16, 2, 3))
    order = [long[0], three[0], long[1], three[1], short[0], three[2], short[1], three[3]]
    return inputs[order], targets[order]


@pytest.mark.unit
def test_a_masked_loss_is_the_mean_over_the_global_batchs_tokens(fork):
    """Each share's loss sum divided by (global count / world size), its micro-batches'
    gradients added and the 2 ranks' averaged as DDP does, is the gradient of the mean over the
    whole batch's unmasked tokens; the mean of the ranks' own means is not. train_step itself,
    in one process over 2 micro-batches of uneven counts, gives that same gradient."""
    mytask = importlib.import_module("mytask")
    task, world = mytask.NextToken(), 2
    inputs, targets = next_token_batch()
    torch.manual_seed(0)
    model = mytask.TokenMLP(32, 16)

    def gradients(module):
        return torch.cat([p.grad.flatten() for p in module.parameters()])

    whole = copy.deepcopy(model)
    F.cross_entropy(whole(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    expected = gradients(whole)

    shares = [
        list(zip(inputs[r::world].tensor_split(2), targets[r::world].tensor_split(2), strict=True))
        for r in range(world)
    ]
    counts = [[int(task.count(x, y)) for x, y in share] for share in shares]
    assert counts == [[32, 4], [6, 6]]
    per_rank = sum(map(sum, counts)) / world

    def averaged_over_ranks(divisor) -> torch.Tensor:
        ranks = []
        for r, share in enumerate(shares):
            replica = copy.deepcopy(model)
            for x, y in share:
                (task.loss(replica(x), x, y) / divisor(r)).backward()  # the micro-batches add
            ranks.append(gradients(replica))
        return torch.stack(ranks).mean(0)  # DDP's all-reduce: the ranks' average

    torch.testing.assert_close(averaged_over_ranks(lambda r: per_rank), expected)
    means_of_ranks = averaged_over_ranks(lambda r: sum(counts[r]))
    # 39% off here: the 12 tokens of rank 1 weigh as much as the 36 of rank 0.
    assert (means_of_ranks - expected).norm() > 0.1 * expected.norm()

    engine = copy.deepcopy(model)
    parts = Parts(
        engine,
        torch.optim.SGD(engine.parameters(), lr=0.0),
        None,
        torch.amp.GradScaler("cpu", enabled=False),
    )
    micro = [
        int(task.count(x, y))
        for x, y in zip(inputs.tensor_split(2), targets.tensor_split(2), strict=True)
    ]
    assert micro == [38, 10]
    loss, _ = train_step(
        a_run(task, accumulate_grad_batches=2), parts, (inputs, targets, len(inputs))
    )
    torch.testing.assert_close(gradients(engine), expected)
    mean = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, mean.detach())


@pytest.mark.unit
def test_evaluation_is_exact_for_any_batch_size(fork):
    """The core's evaluate on the fork's real Data: the same metrics for evaluation batches of
    7, 64 and 1000 sequences (the loss to EVAL_LOSS_ATOL, float64 sums of float32 per-token
    losses taken in another order; the counts exactly), equal to the whole split's in one
    forward, and 2 ranks' shares of the split count every token once between them."""
    mytask = importlib.import_module("mytask")
    task = mytask.NextToken()
    found = {}
    for size in (7, 64, 1000):
        cfg = compose_with_fork(
            fork,
            "experiment=counting",
            "data.count=150",
            f"data.val_size={VAL_SIZE}",
            f"data.test_batch_size={size}",
        )
        _, data, model = start_of_run(cfg)
        found[size] = {
            split: evaluate(a_run(task, data), model, split) for split in ("val", "test")
        }
    reference = found[1000]
    for size, metrics in found.items():
        for split, values in metrics.items():
            ref = reference[split]
            assert values[f"{split}/correct"] == ref[f"{split}/correct"], size
            assert values[f"{split}/acc"] == ref[f"{split}/acc"], size
            loss = f"{split}/loss"
            assert math.isclose(values[loss], ref[loss], rel_tol=0, abs_tol=EVAL_LOSS_ATOL), size

    inputs, targets = data.val
    with torch.no_grad():
        outputs = model(inputs)
    tokens = targets != -100
    mean = F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert math.isclose(reference["val"]["val/loss"], mean.item(), rel_tol=1e-6)
    correct = int(((outputs.argmax(-1) == targets) & tokens).sum())
    assert reference["val"]["val/correct"] == correct
    assert reference["val"]["val/acc"] == correct / int(tokens.sum())

    shares = []
    for rank in range(2):
        data.setup(Process(rank=rank, world_size=2))
        shares.append(evaluate(a_run(task, data, Process(rank=rank, world_size=2)), model, "val"))
    assert sum(s["val/correct"] for s in shares) == correct
    assert all(0 < s["val/correct"] < correct for s in shares), shares


# Each mistake a fork can make, as the config says it; the sentence that stops it.
MISTAKES_REFUSED = {
    "a loss that is not a scalar": (
        ["experiment=counting", "task._target_=mistakes.PerToken"],
        r"^The task's loss of a batch is \(32,\), not a scalar: return the sum over the batch's "
        r"terms \(reduction='sum'\); the engine divides it by the global count\.$",
    ),
    "a monitor the task does not return": (
        ["experiment=counting", "checkpoint.monitor=val/f1"],
        r"^checkpoint.monitor=val/f1 is not a metric this task returns: use val/loss or "
        r"val/acc\.$",
    ),
    "a mean loss": (
        ["experiment=counting", "task._target_=mistakes.MeanLoss"],
        r"^The task's loss\(outputs, inputs, targets\) is (\S+) for two training samples and "
        r"\S+ and \S+ for each alone: it must be the sum over the batch's terms "
        r"\(reduction='sum'\), not their mean, as the engine divides it by the global count "
        r"\(the task contract, src/engine/core/task.py\)\.$",
    ),
    "a count of 1 for a batch": (
        ["experiment=counting", "task._target_=mistakes.CountsBatches"],
        r"^The task's count\(inputs, targets\) is 1 for two training samples and 1 and 1 for each "
        r"alone: it must add up, counting the terms the loss sums over \(samples, pixels, "
        r"unmasked tokens\), as the engine divides the summed loss by the global count \(the "
        r"task contract, src/engine/core/task.py\)\.$",
    ),
    "a count that is always 0": (
        ["experiment=counting", "task._target_=mistakes.NothingCounted"],
        r"^The task counts no loss terms in the first training batch \(every target masked\?\): "
        r"the loss's mean over it is undefined\. Check the task's count and the data\.$",
    ),
    "a task without sums and metrics": (
        ["experiment=counting", "task._target_=mistakes.Unfinished"],
        r"^task=mistakes.Unfinished has no sums, metrics: a task needs count, loss, sums and "
        r"metrics \(see src/tasks.py\)\.$",
    ),
    "classification of float targets": (
        ["experiment=counting", "task=classification", "data.dataset=mistakes.FloatCounting"],
        r"^task=classification takes class numbers as targets, and the data's are torch.float32: "
        r"for real-valued targets use task=regression \(or your own\)\.$",
    ),
    "targets the fork's own check refuses": (
        ["task=next_token", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^task=NextToken takes N×T token targets and N×T×V scores: the targets are torch.int64 "
        r"\(2,\), the outputs \(2, 10\)\.$",
    ),
    "a model that cannot take the samples": (
        ["model.image_size=32", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^model=src.models.MLP cannot take the data's samples: a batch of \(2, 1, 28, 28\) "
        r"torch.float32 inputs stopped it with: mat1 and mat2 shapes cannot be multiplied "
        r"\(2x784 and 1024x512\)\. Give the model the data's shape ",
    ),
    "an image model for samples that are not images": (
        ["experiment=counting", "model=mlp"],
        r"^model.in_channels takes the data's in_channels, and .* gives int64 16 samples, not "
        r"images: pick a model that takes the data's input_shape, or set model.in_channels=\.\.\. "
        r"yourself\.$",
    ),
    "a model with more classes than the data": (
        ["model.num_classes=12", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^model.num_classes=12, but the data have 10 classes: a score for each is what the model "
        r"gives\. Set model.num_classes to 10, or leave it to the data "
        r"\(\$\{data.num_classes\}\)\.$",
    ),
    "a model with fewer classes than the data": (
        ["model.num_classes=5", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^model.num_classes=5, but the data have 10 classes",
    ),
    "a hidden layer of size 0": (
        ["model.hidden=0", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^model=src.models.MLP has a layer of size 0 \(fc1.weight: \(0, 784\)\), which learns "
        r"nothing: give its size key \(hidden, code, ...\) a value of 1 or more\.$",
    ),
    "an autoencoder's code of size 0": (
        [
            "model=autoencoder",
            "task=regression",
            "task.target=input",
            "model.code=0",
            "checkpoint.monitor=val/loss",
            "data.root={tiny_data}",
            f"data.val_size={VAL_SIZE}",
        ],
        r"^model=src.models.AutoEncoder has a layer of size 0 ",
    ),  # fmt: skip
    "a metric object on another device than the outputs": (
        ["experiment=counting", "task=next_token_f1", "task._target_=mistakes.MetricElsewhere"],
        r"^The task's sums\(\) stopped with: Tensor on device cpu is not on the expected device "
        r"meta! The model's outputs are on cpu: make a metric object \(torchmetrics\) in the "
        r"task's __init__, and the engine keeps it on the model's device, or move it in sums\(\) "
        r"with \.to\(outputs\.device\)\.$",
    ),
    "a classifier that returns (logits, features)": (
        [
            "model._target_=mistakes.Returns",
            "+model.kind=tuple",
            "data.root={tiny_data}",
            f"data.val_size={VAL_SIZE}",
        ],
        r"^model=mistakes.Returns returns a tuple \(tensor \(2, 10\), tensor \(2, 1, 28, 28\)\), "
        r"and the task \(Classification\) takes a tensor of logits \(N, classes\), or \(N, "
        r"classes, H, W\) for N×H×W targets: return that alone from the model's forward, or use "
        r"a task that takes its output\.$",
    ),
    "an autoencoder that returns a dict": (
        [
            "model=autoencoder",
            "task=regression",
            "task.target=input",
            "checkpoint.monitor=val/loss",
            "model._target_=mistakes.Returns",
            "+model.kind=dict",
            "+model.of=src.models.AutoEncoder",
            "data.root={tiny_data}",
            f"data.val_size={VAL_SIZE}",
        ],
        r"^model=mistakes.Returns returns a dict \(logits: tensor \(2, 1, 28, 28\), features: "
        r"tensor \(2, 1, 28, 28\)\), and the task \(Regression\) takes a tensor of the targets' "
        r"shape \(the inputs' with task.target=input\): return that alone ",
    ),
    "a token model that returns a list": (
        [
            "experiment=counting",
            "model._target_=mistakes.Returns",
            "+model.kind=list",
            "+model.of=mytask.TokenMLP",
        ],
        r"^model=mistakes.Returns returns a list \(tensor \(2, 16, 32\), tensor \(2, 16\)\), and "
        r"the task \(NextToken\) takes a tensor of scores \(N, T, vocabulary\): return that ",
    ),
    "an image for each class number": (
        ["model=autoencoder", "data.root={tiny_data}", f"data.val_size={VAL_SIZE}"],
        r"^task=classification takes one score per class for each target, the classes in "
        r"dimension 1 \(as cross_entropy\): the model's output is \(2, 1, 28, 28\) for targets of "
        r"\(2,\), so it should be \(2, 'classes'\)\.$",
    ),
    "class scores for each image to reconstruct": (
        [
            "task=regression",
            "task.target=input",
            "checkpoint.monitor=val/loss",
            "data.root={tiny_data}",
            f"data.val_size={VAL_SIZE}",
        ],
        r"^task=regression compares the model's output with the targets value by value: the "
        r"output is \(2, 10\) and the targets \(2, 1, 28, 28\)\.$",
    ),
    "label smoothing of 2": (
        ["task.label_smoothing=2"],
        r"^task.label_smoothing=2 is not allowed: use 0 \(none\) up to below 1, e.g. 0.1\.$",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("mistake", MISTAKES_REFUSED)
def test_each_mistake_stops_before_training_with_one_sentence(mistake, fork, tiny_data):
    """Composed by Hydra (the fork's conf/ on the search path), the run's first steps stop with
    the one sentence (a UserError, which Hydra prints alone) before any training."""
    overrides, message = MISTAKES_REFUSED[mistake]
    cfg = compose_with_fork(fork, *(o.format(tiny_data=tiny_data) for o in overrides))
    with pytest.raises(UserError, match=message) as refused:
        start_of_run(cfg)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------------------------------------
# The worked fork, trained for real from the page's commands

# What makes the page's runs small: 250 sequences, 50 held out, 200 to train on in global batches
# of 24 (9 steps an epoch, the last of 8 sequences: 4 on each of 2 ranks); each step logged.
SMALL = [
    "logger=none",
    "plots=false",
    "device=cpu",
    "data.count=250",
    f"data.val_size={VAL_SIZE}",
    "data.batch_size=24",
    "trainer.log_every_n_steps=1",
]


def launch(command: str, cwd: Path, *overrides: str):
    """One of the page's commands, run from `cwd` (which holds fork/) as written, then
    `overrides`: `VAR=value` before it goes into the environment, torchrun's processes to
    conftest.train."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    nproc = None
    if words[0] == "torchrun":
        nproc = int(words.pop(1).removeprefix("--nproc_per_node="))
    assert words[:2] in (["python", "train.py"], ["torchrun", "train.py"]), command
    return train([*words[2:], *overrides], cwd, nproc=nproc, env=offline_env(**env))


def commands() -> dict[str, str]:
    """The page's four commands, by what they run."""
    found = dict(zip(("one", "ddp", "fsdp", "equivalence"), fork_commands(), strict=True))
    assert found["one"].endswith("experiment=counting") and "torchrun" in found["ddp"]
    assert found["fsdp"].endswith("parallel=fsdp")
    assert found["equivalence"].endswith("debug=equivalence")
    return found


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["train/loss"]) for m in read_metrics(run_dir)[0]]


def assert_same_losses(ours: list, reference: list) -> None:
    """Each step's training loss to float32 rounding: LOSS_ATOL, 4 ulps at the first loss. Here
    that is ln(32) = 3.47, whose ulp is 2.4e-7; measured at most 4.8e-7 (2 ulps)."""
    assert [step for step, _ in ours] == [step for step, _ in reference]
    for (step, loss), (_, expected) in zip(ours, reference, strict=True):
        assert math.isclose(loss, expected, rel_tol=0, abs_tol=LOSS_ATOL), (step, loss, expected)


def assert_same_evaluation(ours: dict, reference: dict) -> None:
    """One validation or test line: its tokens right exactly, its loss to EVAL_LOSS_ATOL."""
    split = "val" if "val/loss" in reference else "test"
    assert ours[f"{split}/correct"] == reference[f"{split}/correct"], (ours, reference)
    loss = f"{split}/loss"
    assert math.isclose(ours[loss], reference[loss], rel_tol=0, abs_tol=EVAL_LOSS_ATOL), (
        ours,
        reference,
    )


def test_the_worked_fork_trains_the_same_in_every_mode(tmp_path):
    """The page's fork, from its own blocks and commands: 2 epochs in one process; under 2 DDP
    processes (torchrun) for 1 epoch, then resumed in one process to 2; under FSDP (2 processes,
    gloo). Every step's loss, every validation and the test agree, and so do the final weights
    of the run that changed modes. FSDP's best.pt, evaluated alone in one process
    (train=false ckpt_path=...), gives the validation and the test the FSDP run logged.

    The ranks' shares hold different numbers of tokens at every step, and the mean of the ranks'
    means at the first step is not the global mean by far more than LOSS_ATOL: a DDP step that
    averaged the ranks' means would fail the comparison."""
    write_fork(tmp_path)
    run = commands()
    folder = {name: tmp_path / "outputs" / name for name in ("one", "ddp", "fsdp", "eval")}

    def here(name: str) -> str:
        return f"hydra.run.dir={folder[name]}"

    ok(launch(run["one"], tmp_path, *SMALL, "trainer.epochs=2", here("one")))
    ok(launch(run["ddp"], tmp_path, *SMALL, "trainer.epochs=1", here("ddp")))
    logged = (folder["ddp"] / "train.log").read_text()
    assert "DDP: 2 processes" in logged and re.search(r"trained in .* \(\d+ samples/s\)", logged)
    ok(launch(run["one"], tmp_path, *SMALL, "trainer.epochs=2", here("ddp")))  # resume=auto
    ok(
        launch(
            run["fsdp"],
            tmp_path,
            *SMALL,
            "trainer.epochs=2",
            "parallel.nproc_per_node=2",
            here("fsdp"),
        )
    )
    best = folder["fsdp"] / "checkpoints" / "best.pt"
    ok(launch(run["one"], tmp_path, *SMALL, "train=false", f"ckpt_path={best}", here("eval")))

    reference = losses(folder["one"])
    assert len(reference) == 18
    _, expected = read_metrics(folder["one"])
    assert [m.get("epoch") for m in expected] == [1, 2, 2]  # 2 validations, then the test
    for name in ("ddp", "fsdp"):
        assert_same_losses(losses(folder[name]), reference)
        evaluations = read_metrics(folder[name])[1]
        assert len(evaluations) == len(expected), name
        for ours, ref in zip(evaluations, expected, strict=True):
            assert_same_evaluation(ours, ref)
    weights, ref_weights = (
        load(folder[n] / "checkpoints" / "last.pt")["model"] for n in ("ddp", "one")
    )
    assert list(weights) == list(ref_weights)
    for key, tensor in ref_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=WEIGHT_ATOL)

    fsdp_evaluations = read_metrics(folder["fsdp"])[1]
    best_epoch = load(best)["progress"]["epoch"]
    (validated,) = [m for m in fsdp_evaluations if "val/loss" in m and m["epoch"] == best_epoch]
    alone = read_metrics(folder["eval"])[1]
    assert [("val/loss" in m, "test/loss" in m) for m in alone] == [(True, False), (False, True)]
    assert_same_evaluation(alone[0], validated)
    assert_same_evaluation(alone[1], fsdp_evaluations[-1])

    # The data makes the comparison count: uneven shares, and a mean of means far off.
    counts, sums = first_epoch_by_rank(tmp_path / "fork")
    assert all(a != b for a, b in zip(*counts, strict=True)), counts
    tokens = counts[0][0] + counts[1][0]
    assert math.isclose(reference[0][1], sum(sums) / tokens, rel_tol=0, abs_tol=LOSS_ATOL)
    means_of_ranks = (sums[0] / counts[0][0] + sums[1] / counts[1][0]) / 2
    assert abs(means_of_ranks - sum(sums) / tokens) > 100 * LOSS_ATOL  # 2.1e-3 here


def first_epoch_by_rank(fork: Path) -> tuple[list[list[int]], list[float]]:
    """The tokens of each of 2 ranks' shares of the first epoch's batches, for the fork's config
    as the runs above have it, and each share's loss sum at the first step, from the first
    weights."""
    sys.path.insert(0, str(fork))
    try:
        settings, data, model = start_of_run(compose_with_fork(fork, "experiment=counting", *SMALL))
    finally:
        sys.path.remove(str(fork))
    task, counts, sums = settings.task, [], []
    for rank in range(2):
        data.setup(Process(rank=rank, world_size=2))
        batches = list(data.train_batches(1))
        counts.append([int(task.count(x, y)) for x, y, _ in batches])
        x, y, _ = batches[0]
        with torch.no_grad():
            sums.append(task.loss(model(x), x, y).item())
    return counts, sums


def test_a_torchmetrics_metric_is_the_same_in_one_process_and_under_ddp(tmp_path):
    """The page's macro-F1 task (a torchmetrics object), from its own blocks and commands: an
    epoch in one process and one under 2 DDP processes log the same val/f1 and test/f1 (as they
    count the same tokens right: the weights agree to WEIGHT_ATOL, no prediction near a tie); the
    first run's best.pt evaluated under 2 processes gives exactly the F1 it logged, from the same
    weights: each rank's counts summed by torchmetrics, every token counted once."""
    write_fork(tmp_path)
    one, ddp = fork_commands(block=1)
    folder = {name: tmp_path / "outputs" / name for name in ("one", "ddp", "eval")}
    ok(launch(one, tmp_path, *SMALL, "trainer.epochs=1", f"hydra.run.dir={folder['one']}"))
    ok(launch(ddp, tmp_path, *SMALL, "trainer.epochs=1", f"hydra.run.dir={folder['ddp']}"))
    logged = (folder["ddp"] / "train.log").read_text()
    assert "DDP: 2 processes" in logged and re.search(r"trained in .* \(\d+ samples/s\)", logged)
    best = folder["one"] / "checkpoints" / "best.pt"
    evaluated = ["train=false", f"ckpt_path={best}", f"hydra.run.dir={folder['eval']}"]
    ok(launch(ddp, tmp_path, *SMALL, *evaluated))
    (val, test), (ddp_val, ddp_test) = (read_metrics(folder[n])[1] for n in ("one", "ddp"))
    assert 0 < val["val/f1"] < 1 and 0 < test["test/f1"] < 1, (val, test)
    for ours, reference in ((ddp_val, val), (ddp_test, test)):
        assert_same_evaluation(ours, reference)
        split = "val" if "val/f1" in reference else "test"
        assert ours[f"{split}/f1"] == reference[f"{split}/f1"], (ours, reference)
    alone = read_metrics(folder["eval"])[1]
    assert [(m.get("val/f1"), m.get("test/f1")) for m in alone] == [
        (val["val/f1"], None),
        (None, test["test/f1"]),
    ]


@pytest.mark.slow
def test_debug_equivalence_passes_for_the_worked_fork(tmp_path):
    """The page's `debug=equivalence` command on the fork: one process, micro-batches and 2 DDP
    processes train it alike (exit 0, the verdict printed)."""
    write_fork(tmp_path)
    result = ok(launch(commands()["equivalence"], tmp_path, *SMALL))
    assert "Equivalent: every layout trains this config as one process does, within float64 " in (
        printed(result)
    )


def test_a_mistake_on_the_command_line_stops_with_one_sentence(tmp_path):
    """The page's first command with a task whose loss is not a sum: exit 1 with the sentence
    alone, no traceback, before any training and with nothing saved."""
    write_fork(tmp_path)
    result = launch(commands()["one"], tmp_path, *SMALL, "task._target_=mistakes.PerToken")
    assert result.returncode == 1
    output = printed(result)
    assert output.count("The task's loss of a batch is (32,), not a scalar: return the sum") == 1
    assert "Traceback" not in output and "epoch 1" not in output
    assert not list(tmp_path.rglob("*.pt"))


@pytest.mark.slow
def test_debug_equivalence_names_the_contract_for_a_mean_loss(tmp_path):
    """A mean loss fails `debug=equivalence` with the sum/count contract named, not a vague
    difference between the layouts."""
    write_fork(tmp_path)
    result = launch(commands()["equivalence"], tmp_path, *SMALL, "task._target_=mistakes.MeanLoss")
    assert result.returncode == 1
    output = printed(result)
    assert "it must be the sum over the batch's terms (reduction='sum'), not their mean" in output
    assert "Traceback" not in output and "Comparing in" not in output, output


def test_ranks_that_disagree_on_a_metric_stop_at_once(tmp_path):
    """A metric each of 2 DDP ranks computes from its own share: every rank stops at the first
    validation with one sentence naming the metric and each rank's value (not a hang until
    parallel.timeout, set short here so that a hang fails fast), and the folder is released."""
    write_fork(tmp_path)
    result = launch(
        commands()["ddp"], tmp_path, *SMALL, "task._target_=mistakes.OwnShareAccuracy",
        "parallel.timeout=60",
    )  # fmt: skip
    assert result.returncode == 1
    output = printed(result)
    found = re.search(
        r"Stopped: val/acc differs between the ranks \(rank 0 (\S+), rank 1 (\S+)\)", output
    )
    assert found and found[1] != found[2], output
    assert "torchmetrics object with its sync off" in output
    # torchrun's own report of the failure holds its one traceback; the workers print none.
    assert output.count("Traceback") == 1 and "timed out" not in output.lower(), output
    assert not list(tmp_path.rglob("run.lock"))


# ---------------------------------------------------------------------------------------------
# A model's output the task cannot take (a tuple, a list, a dict), from the command line

RETURNS_TUPLE = ["model._target_=mistakes.Returns", "+model.kind=tuple"]


@pytest.mark.unit
def test_a_task_that_takes_the_models_tuple_is_not_refused(fork, tiny_data):
    """The output is refused only where the task cannot take it: a task that takes (logits,
    features) passes the checks before training."""
    task = "task._target_=mistakes.TakesLogitsAndFeatures"
    overrides = [*RETURNS_TUPLE, task, f"data.root={tiny_data}", f"data.val_size={VAL_SIZE}"]
    start_of_run(compose_with_fork(fork, *overrides))


def test_a_model_that_returns_a_tuple_stops_with_one_sentence(tmp_path, tiny_data):
    """`python train.py` with a classifier that returns (logits, features): exit 1 with the
    sentence alone, before any training and with nothing saved."""
    write_fork(tmp_path)
    env = offline_env(PYTHONPATH=str(tmp_path / "fork"))
    result = train([f"data.root={tiny_data}", "logger=none", *RETURNS_TUPLE], tmp_path, env=env)
    assert result.returncode == 1
    output = printed(result)
    sentence = (
        "model=mistakes.Returns returns a tuple (tensor (2, 10), tensor (2, 1, 28, 28)), and the "
        "task (Classification) takes a tensor of logits (N, classes), or (N, classes, H, W) for "
        "N×H×W targets: return that alone from the model's forward, or use a task that takes "
        "its output."
    )
    assert output.count(sentence) == 1, output
    assert "Traceback" not in output and "epoch 1" not in output
    assert not list(tmp_path.rglob("*.pt"))


def test_under_torchrun_a_model_output_the_task_cannot_take_stops_every_rank(tmp_path):
    """The page's DDP command with a token model that returns a list: both ranks stop before
    training, the sentence told by local rank 0 and quoted by torchrun's report, no traceback."""
    write_fork(tmp_path)
    model = ["model._target_=mistakes.Returns", "+model.kind=list", "+model.of=mytask.TokenMLP"]
    result = launch(commands()["ddp"], tmp_path, *SMALL, *model)
    assert result.returncode == 1
    output = printed(result)
    sentence = (
        "model=mistakes.Returns returns a list (tensor (2, 16, 32), tensor (2, 16)), and the task "
        "(NextToken) takes a tensor of scores (N, T, vocabulary): return that alone from the "
        "model's forward, or use a task that takes its output."
    )
    told, report = output.split("Failures:")
    assert told.count(sentence) == 1, output  # by local rank 0 alone, before torchrun's report
    assert sentence in report.split("Root Cause")[1]
    assert output.count("Traceback") == 1  # torchrun's own report's, which holds the sentence
    assert "epoch 1" not in output and not list(tmp_path.rglob("*.pt"))
