"""The reference networks. The classifiers take N×C×H×W images and return logits; the data tells
them its input's channels (`in_channels`), height and width (`image_size`) and its
`num_classes`. The autoencoder takes any sample's shape (`input_shape`) and returns its own."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Flatten → Linear → ReLU → Linear: the MLP of PyTorch's DDP tutorials (784-512-10)."""

    def __init__(self, in_channels: int, image_size: int, hidden: int, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(in_channels * image_size * image_size, hidden)
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
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        dropout1: float,
        dropout2: float,
        batch_norm: bool = False,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.bn1 = nn.BatchNorm2d(32) if batch_norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(64) if batch_norm else nn.Identity()
        self.dropout1 = nn.Dropout(dropout1)
        self.dropout2 = nn.Dropout(dropout2)
        pooled = (image_size - 4) // 2  # two 3×3 convolutions, then a 2×2 pool: 12 for 28
        self.fc1 = nn.Linear(64 * pooled * pooled, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))


def resnet18(in_channels: int, num_classes: int, small_images: bool) -> nn.Module:
    """torchvision's ResNet-18, untrained. `small_images`: the stem used for CIFAR-sized inputs,
    a 3×3 convolution of stride 1 and no max-pool, instead of ImageNet's 7×7 of stride 2 and a
    pool, which would shrink a 32×32 image to 8×8 before the first block. Any image size works:
    the network ends in an adaptive pool."""
    from torchvision.models import resnet18 as torchvision_resnet18

    model = torchvision_resnet18(num_classes=num_classes)
    if small_images:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    return model


class AutoEncoder(nn.Module):
    """Flatten → Linear → ReLU → Linear to a `code` → ReLU → Linear → ReLU → Linear back, shaped
    as the input: learns to reconstruct its input through a narrow code (task=regression
    task.target=input). Any sample shape: `input_shape` is the data's (C×H×W for images)."""

    def __init__(self, input_shape: list[int], hidden: int, code: int):
        super().__init__()
        self.shape, size = tuple(input_shape), math.prod(input_shape)
        self.encoder = nn.Sequential(nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(
            nn.ReLU(), nn.Linear(code, hidden), nn.ReLU(), nn.Linear(hidden, size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(torch.flatten(x, 1))).view(-1, *self.shape)
