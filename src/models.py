"""The reference networks: classifiers of N×C×H×W images to logits, an autoencoder of any shape."""

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
    """The pytorch/examples MNIST network, with its layer names, so its checkpoints load here. Its
    log_softmax and nll_loss are these logits and cross_entropy. `batch_norm=True` adds BatchNorm
    after each convolution (bn1, bn2), the layer whose running statistics DDP does not sync."""

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
        self.dropout1, self.dropout2 = nn.Dropout(dropout1), nn.Dropout(dropout2)
        pooled = (image_size - 4) // 2  # two 3×3 convolutions, then a 2×2 pool: 12 for 28
        self.fc1, self.fc2 = nn.Linear(64 * pooled * pooled, 128), nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))


def resnet18(in_channels: int, num_classes: int, small_images: bool) -> nn.Module:
    """torchvision's ResNet-18, untrained, for any image size. `small_images` (CIFAR's 32×32): a
    3×3 stem of stride 1 and no max-pool, not ImageNet's, which would leave 8×8 to the blocks."""
    from torchvision.models import resnet18 as torchvision_resnet18

    model = torchvision_resnet18(num_classes=num_classes)
    if small_images:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    return model


class AutoEncoder(nn.Module):
    """Flatten → Linear → ReLU → Linear to a narrow `code`, and back to a sample of `input_shape`
    (C×H×W for images): learns to reconstruct its input (task=regression task.target=input)."""

    def __init__(self, input_shape: list[int], hidden: int, code: int):
        super().__init__()
        self.shape, size = tuple(input_shape), math.prod(input_shape)
        self.encoder = nn.Sequential(nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(
            nn.ReLU(), nn.Linear(code, hidden), nn.ReLU(), nn.Linear(hidden, size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(torch.flatten(x, 1))).view(-1, *self.shape)
