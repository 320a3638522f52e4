"""End to end: `flwr run .` in Flower's Ray simulation, as a user runs it.

`flwr run --stream` exits 0 even when the run fails, so the test checks the
outcome on disk (results.json) and `flwr list`. FLWR_HOME points at a temporary
folder, the local SuperLink gets its own ports, and it is stopped afterwards.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import flwr_env as make_env
from .helpers import free_port

pytestmark = pytest.mark.slow  # Ray simulation or SuperLink processes: `pytest -m slow`

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def flwr_env(tmp_path):
    home = tmp_path / "flwr-home"
    env = make_env(home)
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    yield env
    subprocess.run(["pkill", "-f", str(home)], check=False)


@pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                    reason="the flwr CLI is not installed beside this Python")
def test_flwr_run_trains_personalized_models(flwr_env, tmp_path):
    results = tmp_path / "results"
    overrides = (f"num-owners=4 num-rounds=3 local-epochs=2 results-dir='{results}' "
                 "noise-seed=3 target-epsilon=8.0")
    proc = subprocess.run(
        ["flwr", "run", ".", "--stream", "--run-config", overrides,
         "--federation-config", "num-supernodes=2"],
        cwd=ROOT, env=flwr_env, capture_output=True, text=True, timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed", log[-4000:]
    hist = res["history"]
    assert [r["round"] for r in hist] == [1, 2, 3]
    # epsilon reported every round, increasing, within the budget
    eps = [r["epsilon"] for r in hist]
    assert all(e > 0 for e in eps) and eps == sorted(eps) and eps[-1] <= 8.0
    assert "epsilon" in log and "mean personalized accuracy" in log
    # personal state persisted across rounds on the SuperNodes
    assert [r["personal_rounds_min"] for r in hist] == [1, 2, 3]
    # accuracy above chance (each owner holds 8 classes: chance <= 1/8)
    assert hist[-1]["accuracy"] > 0.3
    assert (results / "ledger.json").is_file() and (results / "model.npz").is_file()
    listed = subprocess.run(["flwr", "list", "--format", "json"], cwd=ROOT, env=flwr_env,
                            capture_output=True, text=True, timeout=120)
    assert "finished:completed" in listed.stdout, listed.stdout[-2000:]


@pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                    reason="the flwr CLI is not installed beside this Python")
def test_a_run_that_cannot_make_progress_ends_failed_in_flwr_list(flwr_env, tmp_path):
    """Every train reply misses a 10 ms round timeout: the round is skipped, and with
    max-skipped-rounds = 1 the run ends as failed (never completed), with its epsilon
    saved, and `flwr list` shows it finished:failed."""
    results = tmp_path / "results"
    overrides = (f"num-owners=4 num-rounds=3 results-dir='{results}' noise-seed=3 "
                 "round-timeout=0.01 max-skipped-rounds=1")
    proc = subprocess.run(
        ["flwr", "run", ".", "--stream", "--run-config", overrides,
         "--federation-config", "num-supernodes=2"],
        cwd=ROOT, env=flwr_env, capture_output=True, text=True, timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "failed" and res["rounds_completed"] == 1, log[-4000:]
    assert res["epsilon"] > 0 and (results / "ledger.json").is_file()
    listed = subprocess.run(["flwr", "list", "--format", "json"], cwd=ROOT, env=flwr_env,
                            capture_output=True, text=True, timeout=120)
    assert "finished:failed" in listed.stdout, listed.stdout[-2000:]
