"""The pieces of parallel=fsdp, in this process: which modules become units, the plain optimizer
state FSDP's is converted to and from, and the even evaluation batches FSDP's collective forward
needs. (Training under FSDP, with 2 to 4 processes, is tests/test_equivalence.py's.)"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import compose_config, make_dataset
from hydra.utils import instantiate

from src.engine.checkpoint import OptimizerState
from src.engine.errors import UserError
from src.engine.parallel import Process, fsdp
from src.models import MLP

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank():
    """A process group of this one process (gloo), as FSDP needs one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def adam_step(model, optimizer):
    images = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(8) % 3
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()


def test_shard_modules_that_name_no_module_are_refused():
    with pytest.raises(UserError, match=r"shard_modules=\['linear'\] names no module of MLP, "):
        fsdp.shard(MLP(1, 4, 8, 3), ["linear"], True, None, torch.device("cpu"))


def test_the_optimizer_state_is_saved_plain_and_loads_back(one_rank):
    """FSDP's optimizer state, gathered, equals what a plain optimizer's state_dict() holds after
    the same step (numbered parameters, not names), and loads back into a sharded model."""
    torch.manual_seed(0)
    plain = MLP(1, 4, 8, 3)
    sharded = fsdp.shard(copy.deepcopy(plain), ["Linear"], True, None, torch.device("cpu"))
    optimizers = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (plain, sharded)]
    for model, optimizer in zip((plain, sharded), optimizers, strict=True):
        adam_step(model, optimizer)
    saved = OptimizerState(optimizers[1], sharded).state_dict()
    expected = optimizers[0].state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert list(saved["state"]) == [0, 1, 2, 3]
    for number, moments in expected["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(saved["state"][number][key], value)

    fresh = fsdp.shard(MLP(1, 4, 8, 3), ["Linear"], True, None, torch.device("cpu"))
    optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    OptimizerState(optimizer, fresh).load_state_dict(copy.deepcopy(saved))
    reloaded = OptimizerState(optimizer, fresh).state_dict()
    for number, moments in saved["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(reloaded["state"][number][key], value)


@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_even_evaluation_batches_give_every_rank_as_many_forwards(tmp_path, loader):
    """50 validation images over 3 ranks in batches of 4: 17/17/16 images, 5/5/4 batches; with
    `even`, rank 2 runs an empty fifth batch, and every image is still counted once."""
    root = make_dataset(tmp_path / "data")
    counts, images = [], 0
    for rank in range(3):
        cfg = compose_config(f"data.root={root}", "data.batch_size=6", "data.test_batch_size=4",
                             "data.val_size=50", f"data.loader={loader}")  # fmt: skip
        data = instantiate(cfg.data)
        data.setup(Process(rank=rank, world_size=3))
        batches = list(data.eval_batches("val", even=True))
        counts.append(len(batches))
        images += sum(len(labels) for _, labels in batches)
        assert all(x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32 for x, _ in batches)
    assert counts == [5, 5, 5] and images == 50
