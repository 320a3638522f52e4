"""The app's LightningModule and data (plain PyTorch Lightning, no federated learning)."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)


class LitClassifier(pl.LightningModule):
    """A small MLP for scikit-learn's 8x8 digits (10 classes)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", nn.functional.cross_entropy(logits, y))
        self.log("test_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@functools.lru_cache(maxsize=4)
def _partitions(num_partitions: int) -> list[tuple[TensorDataset, TensorDataset]]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = np.random.default_rng(0).permutation(len(y))
    parts = []
    for idx in np.array_split(order, num_partitions):
        cut = int(0.8 * len(idx))
        parts.append((TensorDataset(x[idx[:cut]], y[idx[:cut]]), TensorDataset(x[idx[cut:]], y[idx[cut:]])))
    return parts


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    train, test = _partitions(num_partitions)[partition_id]
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(test, batch_size=64)


def trainer(max_epochs: int = 1) -> pl.Trainer:
    """A quiet CPU Trainer (no logger, checkpoints, progress bar or summary)."""
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
