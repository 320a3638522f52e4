"""The seed CNN of the joint-DP paper: two conv layers, then two parallel heads.

``conv1 (5x5, 16) -> pool -> conv2 (5x5, 32) -> pool -> {fc1, fc2}``; the output is
the mean of the two heads' logits. On 28x28 inputs conv1 and conv2 have the paper's
416 and 12,832 parameters. ``norm="group"`` inserts GroupNorm after each conv
(BatchNorm is not used: it mixes records of a batch, which breaks per-record DP).
Default personal rule: the ``fc1`` head.
"""

from __future__ import annotations

import torch
from torch import nn

from .pooling import MaxPool2x2

DEFAULT_PERSONAL_RULE = r"^fc1\."


class SeedCNN(nn.Module):
    """Two conv layers followed by two parallel linear heads whose logits are averaged."""

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        norm: str = "group",
    ) -> None:
        super().__init__()
        if norm not in ("group", "none"):
            raise ValueError(f"norm must be 'group' or 'none', got {norm!r}")
        self.conv1 = nn.Conv2d(in_channels, 16, 5, padding=2)
        self.norm1 = nn.GroupNorm(4, 16) if norm == "group" else nn.Identity()
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.norm2 = nn.GroupNorm(4, 32) if norm == "group" else nn.Identity()
        self.pool = MaxPool2x2()
        side = image_size // 2 // 2
        features = 32 * side * side
        self.fc1 = nn.Linear(features, num_classes)
        self.fc2 = nn.Linear(features, num_classes)

    #: Parameter-name prefixes read by :meth:`head`; every other parameter is read
    #: by :meth:`trunk`. The trunk treats each record on its own (GroupNorm, no
    #: dropout), so its output for a record does not depend on the batch.
    HEAD_PREFIXES = ("fc1.", "fc2.")

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """Convolutional features of each record, flattened."""
        x = self.pool(torch.relu(self.norm1(self.conv1(x))))
        x = self.pool(torch.relu(self.norm2(self.conv2(x))))
        return torch.flatten(x, 1)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits: the mean of the two heads."""
        return 0.5 * (self.fc1(features) + self.fc2(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def build_model(name: str, image_shape: tuple[int, int, int], num_classes: int, norm: str, seed: int) -> nn.Module:
    """Build a model by name with a seeded initialisation (same on server and owners)."""
    if name != "seed-cnn":
        raise ValueError(f"model must be 'seed-cnn', got {name!r}")
    torch.manual_seed(seed)
    return SeedCNN(image_shape[0], image_shape[1], num_classes, norm)
