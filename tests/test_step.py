"""The training step: gradient accumulation, clipping, the stop on a non-finite loss, BatchNorm.

The pieces are tested in this process first (seconds); then real runs, under torchrun where the
promise is about ranks.
"""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from conftest import LOSS_ATOL, WEIGHT_ATOL, a_run, ok, read_metrics, run_dirs, train
from hydra.utils import instantiate
from torch import nn

from src.engine.checkpoint import Checkpointer, OptimizerState, RandomState, load_parts, rng_state
from src.engine.config import Checkpointing
from src.engine.core.context import Hooks, Parts, Progress, Schedule
from src.engine.core.evaluate import evaluate
from src.engine.core.loop import save, train_step
from src.engine.data import Data
from src.engine.errors import UserError
from src.engine.guards import NonFinite, NonFiniteLoss, UnwrittenMetrics
from src.engine.parallel import Process
from src.engine.parallel.none import Single
from src.tasks import Classification

CLASSIFY = Classification()


def parts(precision: str = "32", init_scale: float = 2.0**16) -> Parts:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the step is minus the gradient
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=precision == "16")
    return Parts(model, optimizer, Schedule(scheduler), scaler)


def batch(size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 28, 28, generator=generator), torch.randint(10, (size,))


def weights_after_step(images, labels, global_size, **trainer) -> list[torch.Tensor]:
    trained = parts()
    train_step(a_run(**trainer), trained, (images, labels, global_size))
    return [p.detach().clone() for p in trained.model.parameters()]


@pytest.mark.unit
@pytest.mark.parametrize("size", [24, 10])  # 10 images in 4 micro-batches: 3, 3, 2 and 2
def test_accumulated_micro_batches_step_by_the_mean_gradient(size):
    images, labels = batch(size)
    whole = weights_after_step(images, labels, size)
    for micro in (2, 4):
        accumulated = weights_after_step(images, labels, size, accumulate_grad_batches=micro)
        for ours, reference in zip(accumulated, whole, strict=True):
            torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


@pytest.mark.unit
def test_uneven_shares_of_two_ranks_add_up_to_the_global_mean():
    """A last batch of 7 over two ranks (4 and 3 images), each in micro-batches: the ranks'
    gradients, averaged as DDP averages them, are the gradient of the mean over all 7."""
    model = parts().model
    images, labels = batch(7)
    grads = []
    for share in (slice(0, 7, 2), slice(1, 7, 2)):
        model.zero_grad()
        pieces = zip(images[share].tensor_split(2), labels[share].tensor_split(2), strict=True)
        for x, y in pieces:  # the sum over each micro-batch, by the global count per rank
            (CLASSIFY.loss(model(x), x, y) / (7 / 2)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    nn.functional.cross_entropy(model(images), labels).backward()
    for rank0, rank1, p in zip(*grads, model.parameters(), strict=True):
        torch.testing.assert_close((rank0 + rank1) / 2, p.grad, rtol=0, atol=1e-6)


@pytest.mark.unit
def test_clipping_bounds_the_global_norm_and_reports_it_unclipped():
    trained, (images, labels) = parts(), batch(16)
    before = [p.detach().clone() for p in trained.model.parameters()]
    _, norm = train_step(a_run(gradient_clip_val=0.01), trained, (images, labels, 16))
    assert norm > 0.1  # the norm before clipping, far above the bound
    moved = [b - p.detach() for b, p in zip(before, trained.model.parameters(), strict=True)]
    assert math.isclose(torch.nn.utils.get_total_norm(moved).item(), 0.01, rel_tol=1e-4)


@pytest.mark.unit
def test_a_batch_the_task_counts_nothing_in_stops_with_one_sentence():
    """In one process the count is known on the host: a step over none stops before its 0 / 0."""

    class NothingCounted(Classification):
        def count(self, inputs, targets):
            return 0

    images, labels = batch(16)
    with pytest.raises(UserError, match=r"^The task counts no loss terms in a training batch "):
        train_step(a_run(NothingCounted()), parts(), (images, labels, 16))


@pytest.mark.unit
def test_the_norm_is_measured_without_clipping_only_when_asked():
    images, labels = batch(16)
    assert train_step(a_run(), parts(), (images, labels, 16))[1] is None
    _, norm = train_step(a_run(), parts(), (images, labels, 16), measure_norm=True)
    assert norm > 0


def checked(checkpointer=None, **trainer):
    """A run whose one hook is the non-finite check (src/engine/guards.py), and that hook."""
    run, hook = a_run(**trainer), NonFinite()
    run.checkpointer, run.hooks = checkpointer, Hooks([hook])
    return run, hook


@pytest.mark.unit
def test_float16_steps_the_scaler_skips_are_not_errors():
    """A loss scale so large that the scaled gradients overflow: the scaler skips the steps and
    lowers the scale, the loss itself stays finite, and the watch lets training go on."""
    trained, (images, labels) = parts("16", init_scale=2.0**127), batch(16)
    before = [p.detach().clone() for p in trained.model.parameters()]
    run, looking = checked(precision="16")
    for step in (1, 2):
        loss, _ = train_step(run, trained, (images, labels, 16))
        looking.after_step(run, trained, Progress(step=step), loss)
    assert trained.scaler.get_scale() < 2.0**127  # steps were skipped: the scale came down
    assert all(torch.equal(b, p) for b, p in zip(before, trained.model.parameters(), strict=True))
    assert math.isfinite(run.hooks.check(run, Progress(step=2), loss.item(), trained.model))


@pytest.mark.unit
def test_a_non_finite_loss_stops_with_the_step_and_what_to_try(tmp_path):
    checkpointer = Checkpointer(Checkpointing(), tmp_path, Process(), Single(), {}, {})
    run, looking = checked(checkpointer)
    looking.losses = [
        (5, torch.tensor(2.0)),
        (6, torch.tensor(float("inf"))),
        (7, torch.tensor(torch.nan)),
    ]
    with pytest.raises(
        NonFiniteLoss, match="loss was not finite at step 6 .*no checkpoint before it"
    ):
        run.hooks.check(run, Progress(step=7))


@pytest.mark.unit
def test_non_finite_weights_are_never_saved(tmp_path):
    trained = parts()
    checkpointer = Checkpointer(Checkpointing(), tmp_path, Process(), Single(), {}, {})
    with torch.no_grad():
        trained.model[1].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLoss, match="weights were not finite after step 3"):
        save(checked(checkpointer)[0], trained, Progress(step=3))
    assert not checkpointer.last.exists()


@pytest.mark.unit
def test_the_guards_share_one_all_reduce_per_check():
    """At a logging step the loss and every guard's votes travel in one all-reduce, as before the
    guards were hooks: the loss, a bad loss, bad weights, refused metrics, a signal."""

    @dataclasses.dataclass(frozen=True)
    class Counting(Process):
        reduced: list = dataclasses.field(default_factory=list)

        def sum_over_ranks(self, values: list[float]) -> list[float]:
            self.reduced.append(list(values))
            return values

    process = Counting()
    run = a_run(process=process)
    run.hooks = Hooks([UnwrittenMetrics(), NonFinite()])  # and the loop's stop signal
    run.checkpointer = Checkpointer(Checkpointing(), Path("unused"), process, parts(), {}, None)
    run.hooks.call("after_step", run, parts(), Progress(step=1), torch.tensor(0.5))
    assert run.hooks.check(run, Progress(step=1), 0.5, parts().model) == 0.5
    assert process.reduced == [[0.5, False, False, False, False]]


def test_accumulation_that_leaves_a_micro_batch_empty_is_refused(tmp_path, tiny_data):
    """33 micro-batches of a 32-image batch: one would be empty, refused before training."""
    overrides = [f"data.root={tiny_data}", "logger=none", "data.batch_size=32",
                 "trainer.accumulate_grad_batches=33"]  # fmt: skip
    result = train(overrides, tmp_path)
    assert result.returncode != 0
    assert "Use at most 32, or a larger data.batch_size" in result.stdout + result.stderr


def test_a_nan_under_ddp_stops_every_rank_and_keeps_last_pt_finite(tmp_path, tiny_data):
    """A learning rate that diverges: both ranks stop together at a check, with one message and
    a failing exit, and last.pt holds the last finite weights."""
    overrides = [f"data.root={tiny_data}", "logger=none", "optimizer.lr=1000",
                 "trainer.epochs=5", "trainer.log_every_n_steps=3", "parallel=ddp",
                 "checkpoint.every_n_steps=2"]  # fmt: skip
    result = train(overrides, tmp_path, nproc=2)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Stopped: the training loss was not finite at step" in output, output[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert all(tensor.isfinite().all() for tensor in state["model"].values())
    assert f"last.pt holds step {state['progress']['step']}, before it" in output
    assert not list(run_dir.glob("checkpoints/.*.partial"))


def test_clipping_under_ddp_clips_what_one_process_clips(tmp_path, tiny_data):
    """The clip acts on the all-reduced gradient, so 2 ranks clip exactly as one process does;
    train/grad_norm is logged at every logging step."""
    overrides = [
        f"data.root={tiny_data}",
        "logger=none",
        "trainer.gradient_clip_val=0.5",
        "optimizer.lr=0.5",
        "trainer.log_every_n_steps=2",
        "data.batch_size=16",
    ]
    runs = {}
    for name, extra, nproc in (("none", [], None), ("ddp", ["parallel=ddp"], 2)):
        ok(train([*overrides, *extra], tmp_path / name, nproc=nproc))
        (run_dir,) = run_dirs(tmp_path / name)
        state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
        runs[name] = (read_metrics(run_dir)[0], state["model"])
    (steps, weights), (ddp_steps, ddp_weights) = runs["none"], runs["ddp"]
    assert len(steps) == 6 and steps[0]["train/grad_norm"] > 0.5  # it clipped
    for ours, reference in zip(ddp_steps, steps, strict=True):
        assert math.isclose(ours["train/grad_norm"], reference["train/grad_norm"], rel_tol=1e-5)
        assert math.isclose(
            ours["train/loss"], reference["train/loss"], rel_tol=0, abs_tol=LOSS_ATOL
        )
    for name, tensor in weights.items():
        torch.testing.assert_close(ddp_weights[name], tensor, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_batchnorm_model_under_ddp_counts_what_its_checkpoint_counts(tmp_path, tiny_data, nproc):
    """BatchNorm's running statistics come from each rank's share: before each evaluation every
    rank takes rank 0's, which the checkpoint saves. So the counts the DDP run reports are those
    of its last.pt evaluated in one process."""
    overrides = [f"data.root={tiny_data}", "logger=none", "model=cnn_bn", "trainer.epochs=2",
                 "data.batch_size=48", "trainer.test_weights=last", "parallel=ddp"]  # fmt: skip
    ok(train(overrides, tmp_path, nproc=nproc))
    (run_dir,) = run_dirs(tmp_path)
    _, (*_, validated, tested) = read_metrics(run_dir)
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["model"]["bn2.num_batches_tracked"] == 10  # 5 steps an epoch, 2 epochs
    model = instantiate(state["config"]["model"])
    model.load_state_dict(state["model"])
    data = instantiate(state["config"]["data"])
    data.setup(Process())
    assert isinstance(data, Data)
    for split, logged in (("val", validated), ("test", tested)):
        single = evaluate(a_run(data=data), model, split)
        assert logged[f"{split}/correct"] == single[f"{split}/correct"]
        assert math.isclose(logged[f"{split}/loss"], single[f"{split}/loss"], rel_tol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm runs on 2+ CUDA GPUs")
def test_sync_batchnorm_trains_on_gpus(tmp_path, tiny_data):
    overrides = [
        f"data.root={tiny_data}",
        "logger=none",
        "model=cnn_bn",
        "trainer.epochs=1",
        "parallel=ddp",
        "parallel.sync_batchnorm=true",
        "trainer.test_weights=last",
    ]
    result = ok(train(overrides, tmp_path, nproc=2))
    (run_dir,) = run_dirs(tmp_path)
    assert read_metrics(run_dir)[1], result.stdout


@pytest.mark.unit
def test_float16_resumes_from_a_checkpoint_saved_without_loss_scaling():
    """A run saved at precision 32 or bf16 holds "scaler": {}; resumed with precision=16, the
    enabled scaler starts from its initial scale instead of refusing the empty state."""
    saved, resumed = parts(), parts("16")
    state = {
        "optimizer": saved.optimizer.state_dict(),
        "scheduler": saved.schedule.state_dict(),
        "scaler": saved.scaler.state_dict(),
        "rng": [rng_state()],
    }
    assert state["scaler"] == {}
    streams = RandomState(Process(), 0, Single())
    load_parts(
        {
            "optimizer": OptimizerState(resumed.optimizer, resumed.model),
            "scheduler": resumed.schedule,
            "scaler": resumed.scaler,
            "rng": streams,
        },
        state,
    )
    assert rng_state() == state["rng"][0]  # the random streams continued
    assert resumed.scaler.get_scale() == 2.0**16
