"""The FedAvg baseline's model and data: the joint-DP app's seed model and owner
partitions (the same run config, parsed by :func:`flwr_jdp.joint_dp.config.parse_config`),
so both apps train the same model on the same owners."""

from __future__ import annotations

from flwr_jdp.joint_dp.seed_model import initial_model, owner_data

__all__ = ["initial_model", "owner_data"]
