"""Run the real JointDP strategy against the real ClientApp in process; load example scripts."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

from apps.joint_dp.joint_dp.client_app import app as client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.strategies import JointDP


def own_app_owner(run_config: dict, owner: int, num_partitions: int):
    """The project's own app as one owner's node sees it at set-up: ``(context, job
    config, the server's initial arrays, the shared/personal split)``."""
    from flwr.app import Context, RecordDict

    from apps.joint_dp.joint_dp.task import initial_model, node_job_config
    from flwr_jdp.params import split_parameters

    ctx = Context(run_id=1, node_id=1000 + owner,
                  node_config={"partition-id": owner, "num-partitions": num_partitions},
                  state=RecordDict(), run_config=dict(run_config))
    cfg = node_job_config(ctx)
    return ctx, cfg, initial_arrays(cfg), split_parameters(initial_model(cfg), cfg.effective_personal_rule)


def own_state_dirs(node_config: dict, nodes: int) -> dict[int, dict] | None:
    """Each in-process node its own ``state-dir`` (``<state-dir>/<partition-id>``), as each
    SuperNode has its own disk (InProcessGrid's ``node_configs``): under a policy a
    node's owners share one ledger there."""
    root = node_config.get("state-dir")
    return {i: {"state-dir": f"{root}/{i}"} for i in range(nodes)} if root else None


def run_inprocess(run_config: dict, num_nodes: int = 2, fault=None, node_config=None):
    """Return (strategy, grid, result) after a full run."""
    cfg = parse_config(run_config)
    grid = InProcessGrid(client_app, num_nodes, run_config, fault=fault, node_config=node_config)
    strategy = JointDP(cfg, node_settle_s=0.0)  # in-process nodes all exist at once
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(cfg))
    return strategy, grid, result


class Killed(Exception):
    """The server 'crashed' (raised by :func:`kill_after_trains`)."""


def kill_after_trains(count: int):
    """A fault for :func:`run_inprocess` that lets ``count`` train instructions
    through and raises :class:`Killed` at the next one (2 nodes: 2 per round)."""
    calls = {"train": 0}

    def fault(instruction, reply):
        if instruction.metadata.message_type == "train":
            calls["train"] += 1
            if calls["train"] > count:
                raise Killed()
        return reply

    return fault


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


def run_flwr_app(tmp_path: Path, app_dir: str, overrides: str, supernodes: int = 2) -> tuple[str, str]:
    """``flwr run <app_dir> --stream`` in a fresh FLWR_HOME (free ports), as a user
    runs it; returns (the run's output, ``flwr list --format json``) and stops the
    local SuperLink it started."""
    import subprocess

    home = tmp_path / "flwr-home"
    env = flwr_env(home)
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(
            ["flwr", "run", app_dir, "--stream", "--run-config", overrides,
             "--federation-config", f"num-supernodes={supernodes}"],
            cwd=root, env=env, capture_output=True, text=True, timeout=900,
        )
        listed = subprocess.run(["flwr", "list", "--format", "json"], cwd=root, env=env,
                                capture_output=True, text=True, timeout=120)
        return proc.stdout + proc.stderr, listed.stdout
    finally:
        subprocess.run(["pkill", "-f", str(home)], check=False)


def load_example(relative: str, name: str):
    """Import the script ``examples/<relative>`` as module ``name`` (examples are not a package)."""
    path = Path(__file__).resolve().parent.parent / "examples" / relative
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
