"""What the first run on GPUs would meet, reproduced on the CPU where PyTorch's behaviour shows
there (its own internals, a 'meta' device standing in for a GPU); each test fails without its fix.
"""

import threading

import pytest
import torch
from conftest import a_run, compose_config
from hydra.utils import instantiate
from torch import nn

from src.engine import checkpoint
from src.engine.build import configure_kernels
from src.engine.config import Trainer
from src.engine.core.context import Parts, Progress, Schedule
from src.engine.errors import UserError
from src.engine.parallel import Process, rank_gpu
from src.engine.parallel.dp import check_data_parallel
from src.engine.parallel.none import Single
from src.engine.tools.warmup import WarmUp


@pytest.mark.unit
def test_checkpoints_are_read_into_cpu_memory_whatever_the_device(tmp_path):
    """Read onto the GPU, Adam's `step` counters would stay there after `load_state_dict`, and
    Adam reads them with .item(): two device syncs per parameter per step. Read into CPU memory,
    the model copies its weights over and the optimizer places its state by its own rule."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    path = tmp_path / "weights.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    state = checkpoint.load(path, Process(device=torch.device("meta")), Single(), weights_only=True)
    tensors = [*state["model"].values(), *state["optimizer"]["state"][0].values()]
    assert {t.device.type for t in tensors} == {"cpu"}
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(state["optimizer"])
    assert fresh.state[model.weight]["step"].device.type == "cpu"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("ids", "output", "compile", "precision", "message"),
    [
        ([0, 1], 1, False, "32", "output_device=1 is not the first of parallel.device_ids"),
        ([0, 1], 0, True, "32", "cannot run a torch.compile'd model"),
        ([0, 1], 0, "reduce-overhead", "32", "cannot run a torch.compile'd model"),
        ([0, 1], 0, False, "bf16", "autocasts to float16 in its threads"),
        ([0, 1], 0, False, "16", "autocasts to float16 in its threads"),
        (
            [0, 1],
            0,
            False,
            "64",
            "precision=64 with parallel=dp over 2 GPUs: DataParallel's float64",
        ),
        ([0, 7], 0, False, "32", "name GPUs \\[7\\] that do not exist: 4 are visible"),
    ],
)
def test_data_parallel_refuses_what_it_gets_wrong(ids, output, compile, precision, message):
    with pytest.raises(UserError, match=message):
        check_data_parallel(ids, output, 4, compile, precision)


@pytest.mark.unit
@pytest.mark.parametrize("ids", [[0], [2, 3]])
def test_data_parallel_takes_what_it_gets_right(ids):
    check_data_parallel(ids, ids[0], 4, False, "32")
    if len(ids) == 1:  # one GPU: DataParallel calls the model itself, no replicas, no threads
        check_data_parallel(ids, ids[0], 4, True, "bf16")
        check_data_parallel(ids, ids[0], 4, False, "64")


@pytest.mark.unit
def test_why_dp_refuses_compile_a_replica_of_a_compiled_model_overwrites_it():
    """What DataParallel does on every forward over 2+ GPUs, done here on the CPU."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torch.compile(model)
    compiled._replicate_for_data_parallel()
    assert len(list(model.parameters())) == 0  # the replica's empty parameters replaced them


def test_why_dp_refuses_mixed_precision_the_autocast_dtype_is_per_thread():
    """DataParallel's worker threads enter autocast without a dtype: each thread's default."""
    seen = []
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        thread = threading.Thread(target=lambda: seen.append(torch.get_autocast_dtype("cuda")))
        thread.start()
        thread.join()
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert seen == [torch.float16]


@pytest.mark.unit
def test_kernels_autotune_unless_deterministic_and_matmuls_follow_the_setting():
    try:
        configure_kernels(Trainer(matmul_precision="high"))
        assert torch.backends.cudnn.benchmark  # the warm-up's autotuning happens
        assert torch.get_float32_matmul_precision() == "high"
        configure_kernels(Trainer(deterministic=True))
        assert not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        configure_kernels(Trainer())
    assert not torch.are_deterministic_algorithms_enabled()


class Sizes(nn.Module):
    """The MLP, noting the batch size of every training forward."""

    def __init__(self):
        super().__init__()
        self.inner, self.seen = nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), []

    def forward(self, x):
        if self.training:
            self.seen.append(len(x))
        return self.inner(x)


@pytest.mark.unit
def test_warm_up_runs_each_batch_shape_twice(tiny_data):
    """CUDA graph trees run a new graph once and record it the second time: the warm-up runs the
    full batches and the last, smaller one twice each, so recording happens before the clock."""
    data = instantiate(compose_config(f"data.root={tiny_data}", "data.val_size=50").data)
    data.setup(Process())
    model = Sizes()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    parts = Parts(model, optimizer, Schedule(scheduler), torch.amp.GradScaler("cpu", enabled=False))
    WarmUp().active(a_run(data=data, warmup_steps=1), parts, Progress())
    assert model.seen == [64, 64, 8, 8]  # 200 training images: 3 batches of 64, then 8


@pytest.mark.unit
def test_each_ddp_rank_finds_its_gpu():
    assert [rank_gpu(r, 4, None) for r in range(4)] == [0, 1, 2, 3]
    assert rank_gpu(3, 1, "3") == 0  # a cluster showing each rank its own GPU
    with pytest.raises(UserError, match="more processes on this machine than the 2 GPUs"):
        rank_gpu(2, 2, None)
    with pytest.raises(UserError, match="Use --nproc_per_node=1 or fewer"):
        rank_gpu(1, 1, None)  # two ranks on one visible GPU
