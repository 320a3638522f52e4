"""Run the real JointDP strategy against the real ClientApp in process."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_env(home: Path) -> dict[str, str]:
    """Environment for Flower CLI processes: FLWR_HOME at ``home`` (created) and
    this venv's ``bin`` first on PATH."""
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env
