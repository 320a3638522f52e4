"""The LEAF FEMNIST CNN, scaled for 2 CPU cores.

LEAF: conv 5x5 (32) -> pool -> conv 5x5 (64) -> pool -> fc 2048 -> fc 62
(about 6.6 M parameters). Scaled here to 1/8 of the channels and 1/32 of the
hidden units: conv 4 -> conv 8 -> fc 64 -> fc 62, 30,094 parameters, so that
per-sample gradients (Opacus) cost about 0.4 ms per record on one core and a
round of 16 silos with batches of 256 takes under 2 s. No normalisation layers (BatchNorm would mix records of a batch).
"""

from __future__ import annotations

import torch
from torch import nn

from .pooling import MaxPool2x2


class LeafCNN(nn.Module):
    """Two 5x5 conv layers with max-pooling, then two fully connected layers."""

    def __init__(self, num_classes: int = 62, channels: tuple[int, int] = (4, 8), hidden: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels[0], 5, padding=2)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 5, padding=2)
        self.pool = MaxPool2x2()
        self.fc1 = nn.Linear(channels[1] * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))


def build_leaf_cnn(num_classes: int = 62, seed: int = 0, channels: tuple[int, int] = (4, 8),
                   hidden: int = 64) -> LeafCNN:
    """A seeded LEAF CNN (the same initialisation on the server and every silo)."""
    torch.manual_seed(seed)
    return LeafCNN(num_classes, channels, hidden)
