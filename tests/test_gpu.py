"""The GPU tier: what only CUDA shows. Every test here is skipped, with its reason, on a machine
without a GPU (CI's); on one, `pytest -m gpu -n 0` runs them (and the GPU tests of other files).
The tests marked for two GPUs wait for a machine with two or more.
"""

import math
import os
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    offline_env,
    ok,
    printed,
    read_metrics,
    read_test,
    single_run,
    train,
)
from torch import nn

from src.datasets import find_idx_folder
from src.engine import checkpoint
from src.engine.checkpoint import OptimizerState, RandomState, load_parts
from src.engine.parallel import Process
from src.engine.parallel.dp import DP
from src.engine.parallel.none import Single

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
SHORT = ["logger=none", "trainer.max_steps=4", "trainer.log_every_n_steps=1"]


def test_the_fast_recipe_trains_and_warms_up(tmp_path, tiny_data):
    """bf16, channels-last, torch.compile with CUDA graphs and the warm-up, on the tiny data."""
    overrides = [f"data.root={tiny_data}", "experiment=fashion_cnn_fast", "logger=none",
                 "data.batch_size=64", "trainer.epochs=2"]  # fmt: skip
    ok(train(overrides, tmp_path))
    run_dir = single_run(tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text()
    assert "time/warmup_s" in lines and "memory/peak_cuda_mb" in lines
    assert read_test(run_dir)["test/correct"] > 0


def test_float16_trains_with_its_scaler_and_resumes_a_float32_run(tmp_path, tiny_data):
    """4 steps in float32 (the tiny data's first epoch: 200 images in batches of 64), then steps
    5 to 8, its second epoch, in float16 with the loss scaler (trainer.epochs=2 leaves them)."""
    common = [f"data.root={tiny_data}", "logger=none", "model=cnn", "optimizer=adam",
              "trainer.epochs=2"]  # fmt: skip
    ok(train([*common, "trainer.max_steps=4"], tmp_path / "32"))
    last = single_run(tmp_path / "32") / "checkpoints" / "last.pt"
    resumed = [*common, "trainer.max_steps=8", f"resume={last}", "trainer.precision=16"]
    ok(train([*resumed, "trainer.log_every_n_steps=1"], tmp_path / "16"))
    state = torch.load(single_run(tmp_path / "16") / "checkpoints" / "last.pt")
    assert state["progress"]["step"] == 8 and state["scaler"]["scale"] > 0
    steps = read_metrics(single_run(tmp_path / "16"))[0]
    assert [m["step"] for m in steps] == [5, 6, 7, 8], "float16 trained steps 5 to 8"
    assert all(math.isfinite(m["train/loss"]) for m in steps)


def test_float64_on_a_gpu_trains_what_the_cpu_trains(tmp_path, tiny_data):
    """trainer.precision=64: CUDA's kernels sum in other orders than the CPU's, and in float64
    that moves the losses and weights by about 1e-15; the bound, 1e-10, is test_float64's."""
    common = [f"data.root={tiny_data}", "logger=none", "plots=false", "trainer.precision=64",
              "model=cnn", "model.dropout1=0", "model.dropout2=0", *SHORT]  # fmt: skip
    runs = {}
    for device in ("cpu", "cuda"):
        ok(train([*common, f"device={device}"], tmp_path / device))
        run_dir = single_run(tmp_path / device)
        saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
        runs[device] = (read_metrics(run_dir)[0], saved)
    (cpu_steps, cpu_weights), (gpu_steps, gpu_weights) = runs["cpu"], runs["cuda"]
    for ours, ref in zip(gpu_steps, cpu_steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-10)
    for name, weight in cpu_weights.items():  # the GPU run's checkpoint holds CPU tensors
        assert (gpu_weights[name].dtype, gpu_weights[name].device.type) == (torch.float64, "cpu")
        torch.testing.assert_close(gpu_weights[name], weight, rtol=1e-10, atol=1e-10)


def test_adam_resumes_with_its_step_counters_on_the_cpu(tmp_path):
    model = nn.Linear(8, 2).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(4, 8, device="cuda")).sum().backward()
    optimizer.step()
    path = tmp_path / "adam.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    state = checkpoint.load(path, Process(device=torch.device("cuda")), Single(), weights_only=True)
    fresh = torch.optim.Adam(model.parameters())
    state |= {"rng": [checkpoint.rng_state()]}
    parts = {
        "optimizer": OptimizerState(fresh, model),
        "rng": RandomState(Process(), 0, Single()),
    }
    load_parts(parts, state)
    assert fresh.state[model.weight]["step"].device.type == "cpu"
    assert fresh.state[model.weight]["exp_avg"].device.type == "cuda"


def test_a_gpu_that_does_not_exist_is_named(tmp_path, tiny_data):
    count = torch.cuda.device_count()
    result = train([f"data.root={tiny_data}", *SHORT, f"device=cuda:{count}"], tmp_path)
    assert result.returncode != 0
    assert f"this machine shows {count} GPU(s)" in result.stderr


def test_one_process_on_a_named_gpu_and_dataparallel_on_one(tmp_path, tiny_data):
    last = torch.cuda.device_count() - 1
    ok(train([f"data.root={tiny_data}", *SHORT, f"device=cuda:{last}"], tmp_path / "named"))
    dp = ["parallel=dp", f"parallel.device_ids=[{last}]", "model=cnn"]
    ok(train([f"data.root={tiny_data}", *SHORT, *dp], tmp_path / "dp"))


def test_a_deterministic_job_after_another_in_one_sweep_process(tmp_path, tiny_data):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG once: train.py sets it before the first job."""
    sweep = ["-m", f"data.root={tiny_data}", *SHORT, "trainer.deterministic=false,true"]
    ok(train(sweep, tmp_path))


@two_gpus
def test_ddp_over_two_gpus_with_nccl_trains_what_one_process_trains(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", *SHORT, "data.batch_size=24"]
    ok(train(overrides, tmp_path / "none"))
    result = ok(train([*overrides, "parallel=ddp"], tmp_path / "ddp", nproc=2))
    assert "backend nccl" in result.stdout + result.stderr
    steps = [read_metrics(single_run(tmp_path / mode))[0] for mode in ("ddp", "none")]
    for ours, ref in zip(*steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "16"])
def test_fsdp_on_one_gpu_in_mixed_precision(tmp_path, tiny_data, precision):
    """FSDP with nccl on one GPU (one process): its MixedPrecisionPolicy, float16's sharded
    scaler, and a plain checkpoint that one process evaluates alike."""
    overrides = [f"data.root={tiny_data}", *SHORT, f"trainer.precision={precision}"]
    result = ok(train([*overrides, "parallel=fsdp"], tmp_path / "fsdp", nproc=1))
    assert "backend nccl, this is rank 0 on cuda:0" in printed(result)
    run_dir = single_run(tmp_path / "fsdp")
    assert all(math.isfinite(m["train/loss"]) for m in read_metrics(run_dir)[0])
    evaluated = [f"data.root={tiny_data}", "logger=none", "train=false",
                 f"ckpt_path={run_dir / 'checkpoints' / 'last.pt'}"]  # fmt: skip
    ok(train(evaluated, tmp_path / "none"))
    assert read_test(single_run(tmp_path / "none"))["test/correct"] > 0


@two_gpus
def test_fsdp_over_two_gpus_with_nccl_trains_what_one_process_trains(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", *SHORT, "data.batch_size=24"]
    ok(train(overrides, tmp_path / "none"))
    result = ok(train([*overrides, "parallel=fsdp"], tmp_path / "fsdp", nproc=2))
    assert "FSDP: 2 processes, backend nccl" in printed(result)
    steps = [read_metrics(single_run(tmp_path / mode))[0] for mode in ("fsdp", "none")]
    for ours, ref in zip(*steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-4)


@two_gpus
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_debug_equivalence_compares_on_two_gpus_with_nccl(tmp_path, tiny_data, model):
    """The reference on the first GPU, the DDP layouts as nccl processes on two."""
    overrides = [f"data.root={tiny_data}", "debug=equivalence", f"model={model}", "debug.steps=6"]
    output = printed(ok(train(overrides, tmp_path)))
    assert "in each layout, dropout off, on GPUs (nccl)" in output
    assert "Equivalent: every layout trains this config as one process does" in output


@two_gpus
def test_dataparallel_over_two_gpus_refuses_compile(tmp_path, tiny_data):
    result = train([f"data.root={tiny_data}", *SHORT, "parallel=dp", "trainer.compile=true"],
                   tmp_path)  # fmt: skip
    assert result.returncode != 0
    assert "cannot run a torch.compile'd model" in result.stderr


@two_gpus
def test_dataparallel_replicas_draw_their_own_dropout_masks():
    torch.manual_seed(1)
    replicas = DP()
    replicas.ids = [0, 1]
    replicas.seed_devices(1)
    masks = [torch.rand(8, device=f"cuda:{i}").cpu() for i in (0, 1)]
    assert not torch.equal(*masks)


def test_sync_batchnorm_converts_and_its_checkpoint_evaluates_alike(tmp_path, tiny_data):
    """One DDP rank on the GPU with parallel.sync_batchnorm=true: the model trains as
    nn.SyncBatchNorm, and its last.pt (plain BatchNorm keys) counts under parallel=none what the
    run counted."""
    overrides = [f"data.root={tiny_data}", *SHORT, "model=cnn_bn", "parallel=ddp",
                 "parallel.sync_batchnorm=true", "trainer.test_weights=last"]  # fmt: skip
    ok(train(overrides, tmp_path / "ddp", nproc=1))
    last = single_run(tmp_path / "ddp") / "checkpoints" / "last.pt"
    evaluated = [f"data.root={tiny_data}", "logger=none", "model=cnn_bn", "train=false",
                 f"ckpt_path={last}"]  # fmt: skip
    ok(train(evaluated, tmp_path / "none"))
    ran, alone = (read_test(single_run(tmp_path / m)) for m in ("ddp", "none"))
    assert ran["test/correct"] == alone["test/correct"]


def test_gloo_ddp_with_two_processes_sharing_one_gpu(tmp_path, tiny_data):
    """One GPU is enough for DDP: two gloo processes on it (a cluster showing each job one GPU),
    training what one process trains."""
    overrides = [f"data.root={tiny_data}", *SHORT, "data.batch_size=24"]
    ok(train(overrides, tmp_path / "none"))
    shared = offline_env(CUDA_VISIBLE_DEVICES="0")
    ddp = [*overrides, "parallel=ddp", "parallel.backend=gloo"]
    result = ok(train(ddp, tmp_path / "ddp", nproc=2, env=shared))
    assert "backend gloo, this is rank 0 on cuda:0" in result.stdout + result.stderr
    steps = [read_metrics(single_run(tmp_path / mode))[0] for mode in ("ddp", "none")]
    for ours, ref in zip(*steps, strict=True):
        assert math.isclose(ours["train/loss"], ref["train/loss"], rel_tol=1e-4)


@pytest.mark.parametrize(("saved_on", "evaluated_on"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_evaluates_alike_on_the_other_device(tmp_path, tiny_data, saved_on,
                                                          evaluated_on):  # fmt: skip
    """Saved on the GPU, evaluated on the CPU, and the reverse: the same count (the MLP in
    float32 at full matmul precision, so the devices round alike enough to agree on every
    image)."""
    ok(train([f"data.root={tiny_data}", *SHORT, f"device={saved_on}"], tmp_path / "saved"))
    last = single_run(tmp_path / "saved") / "checkpoints" / "last.pt"
    evaluated = [f"data.root={tiny_data}", "logger=none", "train=false", f"ckpt_path={last}",
                 f"device={evaluated_on}", "trainer.test_weights=last"]  # fmt: skip
    ok(train(evaluated, tmp_path / "evaluated"))
    saved = train([f"data.root={tiny_data}", "logger=none", "train=false", f"ckpt_path={last}",
                   f"device={saved_on}"], tmp_path / "again")  # fmt: skip
    ok(saved)
    there, here = (read_test(single_run(tmp_path / d)) for d in ("again", "evaluated"))
    assert there["test/correct"] == here["test/correct"]
    assert math.isclose(there["test/loss"], here["test/loss"], rel_tol=1e-4)


def test_the_fast_recipe_reaches_its_accuracy_on_fashion_mnist(tmp_path):
    """experiment=fashion_cnn_fast as the README shows it, on the real Fashion-MNIST (FASHION_MNIST,
    else .devdata/fashion-mnist or Debian's folder): the 0.91 it aims at."""
    roots = [os.environ.get("FASHION_MNIST"), REPO / ".devdata" / "fashion-mnist",
             "/usr/share/datasets/fashion-mnist"]  # fmt: skip
    root = next((Path(r) for r in roots if r and find_idx_folder(Path(r), "FashionMNIST")), None)
    if root is None:
        pytest.skip("needs Fashion-MNIST: set FASHION_MNIST to a folder of its four IDX files")
    ok(train(["experiment=fashion_cnn_fast", f"data.root={root}", "logger=none"], tmp_path))
    assert read_test(single_run(tmp_path))["test/acc"] >= 0.91
