"""Models a user might write, each with one flaw that makes DDP train something else than one
process does. Runs import them by `model._target_=user_models.<Name>` with tests/ on PYTHONPATH;
each takes the MLP's keys (conf/model/mlp.yaml)."""

import os
import time
from pathlib import Path

import torch
from hydra.experimental.callback import Callback
from torch import nn

from src.models import MLP
from src.tasks import Classification


class UnusedBranch(MLP):
    """A head that forward never calls: its parameters get no gradient."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int):
        super().__init__(in_channels, image_size, hidden, num_classes)
        self.aux_head = nn.Linear(hidden, num_classes)


class Noisy(MLP):
    """Gaussian noise on the input while training: randomness that is not a dropout layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + 0.5 * torch.randn_like(x)
        return super().forward(x)


class Drifting(MLP):
    """On DDP rank 1 only, its third training forward nudges a weight outside autograd."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3 and os.environ.get("RANK") == "1":
                with torch.no_grad():
                    self.fc2.bias[0] += 0.01
        return super().forward(x)


class RankSeeded(MLP):
    """Built from a seed that depends on the DDP rank: each rank starts from its own weights."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int):
        torch.manual_seed(int(os.environ.get("RANK", 0)))
        super().__init__(in_channels, image_size, hidden, num_classes)


class Broken(MLP):
    """A bug: every forward raises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bug in the model's forward")


class SmallViT(nn.Module):
    """A small vision transformer as a user brings one: 7×7 patches, a learned position, one
    `nn.TransformerEncoderLayer` whose attention projections have biases (PyTorch's default).
    The key projection's bias gets a gradient that is 0 up to rounding (softmax ignores a shift
    shared by every key), which Adam turns into steps in float32."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int):
        super().__init__()
        self.patch, width = 7, 32
        patches = (image_size // self.patch) ** 2
        self.embed = nn.Linear(in_channels * self.patch**2, width)
        self.position = nn.Parameter(torch.zeros(patches, width))
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=hidden,
                                           dropout=0.0, batch_first=True)  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3)
        tokens = self.embed(patches.flatten(1, 2)) + self.position
        return self.head(self.blocks(tokens).mean(dim=1))


class Float32Inside(MLP):
    """Makes a float32 tensor in its forward (a fixed projection): it cannot run in float64."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1) @ torch.eye(x[0].numel(), dtype=torch.float32, device=x.device)
        return super().forward(x)


class WandbModeByJob(Callback):
    """A Hydra callback (`hydra.callbacks`) that sets each job's WANDB_MODE, as a user's own
    callback might set any variable: offline for job 0, disabled for job 1."""

    def on_job_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        os.environ["WANDB_MODE"] = ["offline", "disabled"][HydraConfig.get().job.num]


class SaysNoModes(Classification):
    """A fork's task that does not say which way its metrics are better (no `modes`): the
    checkpoint.mode it is given picks best.pt, whichever way."""

    modes = None


class SlowToTest(MLP):
    """The MLP, slow where the test runs it (an evaluation batch of the tiny data's 100 test
    images): it writes the file `testing` in the working folder, then sleeps, so that a signal
    can be sent during the test."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and len(x) == 100:
            open("testing", "w").close()
            time.sleep(60)
        return super().forward(x)


class SlowToBuild(MLP):
    """The MLP, slow to build: it writes the file `building` in the working folder, then sleeps,
    so that a signal can be sent before training."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int):
        super().__init__(in_channels, image_size, hidden, num_classes)
        open("building", "w").close()
        time.sleep(60)


class CountsItsSteps(Classification):
    """A fork's task with state of its own (the training batches it was asked to count), which the
    checkpoint holds as a part and a resumed run continues."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__(label_smoothing)
        self.counted = 0

    def count(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        self.counted += 1
        return super().count(inputs, targets)

    def state_dict(self) -> dict:
        return {"counted": self.counted}

    def load_state_dict(self, state: dict) -> None:
        self.counted = state["counted"]


class KeepsAPath(CountsItsSteps):
    """A task whose state a checkpoint cannot hold: a Path, an object torch.load(weights_only)
    refuses to unpickle."""

    def state_dict(self) -> dict:
        return {"log": Path("counted.txt")}


class ForgetsAKey(CountsItsSteps):
    """A task whose state does not load back into it: load_state_dict asks for a key that
    state_dict does not give."""

    def load_state_dict(self, state: dict) -> None:
        self.counted = state["count"]
