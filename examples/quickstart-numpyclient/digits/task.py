"""The app's model, data and training code (plain PyTorch, as Flower's examples write it)."""

from __future__ import annotations

import functools
from collections import OrderedDict

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small MLP for scikit-learn's 8x8 digits (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@functools.lru_cache(maxsize=4)
def _partitions(num_partitions: int) -> list[tuple[TensorDataset, TensorDataset]]:
    x, y = load_digits(return_X_y=True)  # 1797 records, shipped with scikit-learn
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = np.random.default_rng(0).permutation(len(y))
    parts = []
    for idx in np.array_split(order, num_partitions):
        cut = int(0.8 * len(idx))
        parts.append((TensorDataset(x[idx[:cut]], y[idx[:cut]]), TensorDataset(x[idx[cut:]], y[idx[cut:]])))
    return parts


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    """Partition ``partition_id`` of ``num_partitions``: train and validation loaders."""
    train, val = _partitions(num_partitions)[partition_id]
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=64)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Train ``net`` on ``trainloader``; return the mean training loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss, batches = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            batches += 1
    return running_loss / max(1, batches)


def test(net: nn.Module, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Mean loss and accuracy of ``net`` on ``testloader``."""
    net.to(device)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
            n += len(labels)
    return loss / max(1, n), correct / max(1, n)


def get_weights(net: nn.Module) -> list[np.ndarray]:
    return [val.cpu().numpy() for _, val in net.state_dict().items()]


def set_weights(net: nn.Module, parameters: list[np.ndarray]) -> None:
    params_dict = zip(net.state_dict().keys(), parameters, strict=True)
    state_dict = OrderedDict({k: torch.tensor(v) for k, v in params_dict})
    net.load_state_dict(state_dict, strict=True)
