"""flwr-jdp's own app's model, data and training (the ``task.py`` of a Flower app):
the seed CNN, each owner's partition of the configured data set, a plain SGD
``train`` and a ``test`` function. Nothing here knows about privacy; the ClientApp
(:mod:`.client_app`) hands these to the client half and the
ServerApp builds ``initial_arrays`` from :func:`initial_model`.
"""

from __future__ import annotations

import dataclasses

import torch
from flwr.app import Context
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.data.partition import OwnerData
from flwr_jdp.joint_dp.config import JobConfig, parse_config
from flwr_jdp.joint_dp.seed_model import initial_model, owner_data
from flwr_jdp.training import evaluate as test
from flwr_jdp.training.augment import random_shift
from flwr_jdp.training.plain import record_losses


def node_job_config(context: Context) -> JobConfig:
    """The run config, with this node's ``data-dir`` (node config) taking precedence:
    each SuperNode may keep its data set in its own place."""
    cfg = parse_config(context.run_config)
    data_dir = context.node_config.get("data-dir")
    return dataclasses.replace(cfg, data_dir=str(data_dir)) if data_dir else cfg


def loader(cfg: JobConfig, data: OwnerData, generator: torch.Generator) -> DataLoader:
    records = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    return DataLoader(records, batch_size=cfg.batch_size, shuffle=True, generator=generator)


def train(model: nn.Module, loader: DataLoader, *, epochs: int, lr: float, augment_shift: int = 0,
          generator: torch.Generator | None = None) -> None:
    """Plain SGD on every trainable parameter of ``model`` (cross-entropy), the
    app's own train function."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            if augment_shift:
                x = random_shift(x, augment_shift, generator)
            optimizer.zero_grad()
            record_losses(model(x), y).mean().backward()
            optimizer.step()


__all__ = ["initial_model", "loader", "node_job_config", "owner_data", "test", "train"]
