"""Run the real JointDP strategy against the real ClientApp in process."""

from __future__ import annotations

from flwr_jdp.apps.client_app import app as client_app
from flwr_jdp.strategies import JointDP

from flwr_jdp.config import parse_config
from flwr_jdp.inprocess import InProcessGrid


def run_inprocess(run_config: dict, num_nodes: int = 2, fault=None, node_config=None):
    """Return (strategy, grid, result) after a full run."""
    cfg = parse_config(run_config)
    grid = InProcessGrid(client_app, num_nodes, run_config, fault=fault, node_config=node_config)
    strategy = JointDP(cfg)
    result = strategy.start(grid=grid)
    return strategy, grid, result
