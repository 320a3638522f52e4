"""The seed model and owner partitions of flwr-jdp's own apps (the joint-DP app and
its FedAvg baseline train the same model on the same owners), from a :class:`JobConfig`."""

from __future__ import annotations

import copy
import functools

from torch import nn

from flwr_jdp.data.datasets import dataset_shape
from flwr_jdp.data.partition import OwnerData, load_partitions
from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.models import build_model


def owner_data(cfg: JobConfig) -> tuple[OwnerData, ...]:
    """Every owner's partition for this configuration (loaded once per process)."""
    return load_partitions(
        cfg.dataset, cfg.data_dir, cfg.num_owners, cfg.classes_per_owner,
        cfg.max_records, cfg.records_per_user, cfg.seed, cfg.partitioner,
        cfg.validation_fraction, cfg.validation_source,
    )


@functools.lru_cache(maxsize=8)
def _seeded_model(cfg: JobConfig) -> nn.Module:
    shape, classes = dataset_shape(cfg.dataset)
    return build_model(cfg.model, shape, classes, cfg.norm, cfg.seed)


def initial_model(cfg: JobConfig) -> nn.Module:
    """The seed CNN of the configured data set, seeded by ``seed``: a fresh copy of a
    model built once per process (the ServerApp's ``initial_arrays`` are its parameters)."""
    return copy.deepcopy(_seeded_model(cfg))


__all__ = ["initial_model", "owner_data"]
