"""End to end: `flwr run examples/altmin` (the Priv-AltMin Flower App) in Flower's
Ray simulation, as a user runs it; the outcome is checked on disk and with
`flwr list` (`flwr run --stream` exits 0 even when a run fails)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import flwr_env as make_env
from .helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                    reason="the flwr CLI is not installed beside this Python")
def test_flwr_run_priv_altmin(tmp_path):
    home = tmp_path / "flwr-home"
    env = make_env(home)
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    results = tmp_path / "results"
    overrides = (f"num-users=4000 dim=10 epochs=2 target-epsilon=4.0 clip-a=80.0 "
                 f"noise-seed=2 results-dir='{results}'")
    try:
        proc = subprocess.run(
            ["flwr", "run", "examples/altmin", "--stream", "--run-config", overrides,
             "--federation-config", "num-supernodes=2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )
        log = proc.stdout + proc.stderr
        assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
        res = json.loads((results / "results.json").read_text())
        assert [h["epoch"] for h in res["history"]] == [0, 1, 2]
        assert all(h["users"] == 4000 for h in res["history"])
        eps = [h["epsilon"] for h in res["history"]]
        assert eps == sorted(eps) and 3.9 < eps[-1] <= 4.0
        # far better than a random embedding (excess MSE ~ 2 k = 4)
        assert res["final_mse"] < 0.05
        assert "[epoch 2/2] population excess MSE" in log
        listed = subprocess.run(["flwr", "list", "--format", "json"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert "finished:completed" in listed.stdout, listed.stdout[-2000:]
    finally:
        subprocess.run(["pkill", "-f", str(home)], check=False)
