"""What the first run on GPUs would meet, reproduced on the CPU where PyTorch's behaviour shows
there (its own internals, a 'meta' device standing in for a GPU); each test fails without its fix.
"""

import torch
from torch import nn

from src import checkpoint
from src.distributed import Process


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
    state = checkpoint.load(path, Process(device=torch.device("meta")), weights_only=True)
    tensors = [*state["model"].values(), *state["optimizer"]["state"][0].values()]
    assert {t.device.type for t in tensors} == {"cpu"}
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(state["optimizer"])
    assert fresh.state[model.weight]["step"].device.type == "cpu"
