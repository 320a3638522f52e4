"""The app's model, data and training code (plain PyTorch, no federated learning)."""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """A small CNN for 28x28 grey-scale images (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class Images(Dataset):
    """Images and labels as dicts, the way a Flower Datasets partition yields them."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.from_numpy(images).unsqueeze(1)
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"img": self.images[i], "label": self.labels[i]}


def _data_dir(data_dir: str) -> Path:
    candidates = [data_dir, os.environ.get("FASHION_MNIST_DIR", ""),
                  Path.cwd().parent / "shared" / "data" / "fashion-mnist",
                  Path.cwd() / "shared" / "data" / "fashion-mnist"]
    for c in candidates:
        if c and (Path(c) / "train-images-idx3-ubyte.gz").is_file():
            return Path(c)
    raise FileNotFoundError("Fashion-MNIST not found: set run-config 'data-dir' or FASHION_MNIST_DIR "
                            "to the folder with train-images-idx3-ubyte.gz")


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


@functools.lru_cache(maxsize=4)
def _partitions(num_partitions: int, data_dir: str, records: int) -> list[tuple[Images, Images]]:
    folder = _data_dir(data_dir)
    x = (_read_idx(folder / "train-images-idx3-ubyte.gz").astype(np.float32) / 255.0 - 0.286) / 0.353
    y = _read_idx(folder / "train-labels-idx1-ubyte.gz").astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))[: records or len(y)]
    parts = []
    for idx in np.array_split(order, num_partitions):
        cut = int(0.8 * len(idx))
        parts.append((Images(x[idx[:cut]], y[idx[:cut]]), Images(x[idx[cut:]], y[idx[cut:]])))
    return parts


def load_data(partition_id: int, num_partitions: int, batch_size: int = 32, data_dir: str = "",
              records: int = 12000) -> tuple[DataLoader, DataLoader]:
    """Partition ``partition_id`` of ``num_partitions``: train and test loaders."""
    train, test = _partitions(num_partitions, data_dir, records)[partition_id]
    return (DataLoader(train, batch_size=batch_size, shuffle=True),
            DataLoader(test, batch_size=batch_size))


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float) -> float:
    """Train ``net`` on ``trainloader``; return the mean training loss."""
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"]), batch["label"])
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
    return total / max(1, batches)


def test(net: nn.Module, testloader: DataLoader) -> tuple[float, float]:
    """Mean loss and accuracy of ``net`` on ``testloader``."""
    criterion = nn.CrossEntropyLoss(reduction="sum")
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for batch in testloader:
            out = net(batch["img"])
            loss += criterion(out, batch["label"]).item()
            correct += (out.argmax(1) == batch["label"]).sum().item()
            n += len(batch["label"])
    return loss / max(1, n), correct / max(1, n)
