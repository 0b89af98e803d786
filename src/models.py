"""The two reference networks. Each returns logits; the loss applies the softmax."""

from torch import nn


class MLP(nn.Sequential):
    """Flatten → Linear → ReLU → Linear: the MLP of PyTorch's DDP tutorials (784-512-10)."""

    def __init__(self, in_features: int, hidden: int, num_classes: int):
        super().__init__(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )


class CNN(nn.Sequential):
    """The pytorch/examples MNIST network: two 3×3 convolutions, max-pool, two linear layers.

    The original ends in log_softmax and trains with nll_loss; returning logits and training with
    cross_entropy computes the same thing.
    """

    def __init__(self, num_classes: int, dropout1: float, dropout2: float):
        super().__init__(
            nn.Conv2d(1, 32, 3, 1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(dropout1),
            nn.Flatten(),
            nn.Linear(9216, 128),  # 64 channels × 12 × 12 after the pool
            nn.ReLU(),
            nn.Dropout(dropout2),
            nn.Linear(128, num_classes),
        )
