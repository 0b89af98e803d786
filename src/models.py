"""The reference networks. Each takes N×1×28×28 images and returns logits."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Flatten → Linear → ReLU → Linear: the MLP of PyTorch's DDP tutorials (784-512-10)."""

    def __init__(self, in_features: int, hidden: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class CNN(nn.Module):
    """The pytorch/examples MNIST network, with its layer names, so its checkpoints load here.

    The original ends in log_softmax and trains with nll_loss; returning logits and training with
    cross_entropy computes the same thing. `batch_norm=True` adds BatchNorm after each convolution
    (bn1, bn2), the layer whose running statistics DDP does not keep equal across ranks.
    """

    def __init__(
        self, num_classes: int, dropout1: float, dropout2: float, batch_norm: bool = False
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.bn1 = nn.BatchNorm2d(32) if batch_norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(64) if batch_norm else nn.Identity()
        self.dropout1 = nn.Dropout(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        self.fc1 = nn.Linear(9216, 128)  # 64 channels × 12 × 12 after the pool
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))
