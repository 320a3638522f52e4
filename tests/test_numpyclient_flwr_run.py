"""End to end: `flwr run examples/quickstart-numpyclient` (a legacy Flower app, its
``client_fn`` returning a NumPyClient, converted with ``numpy_client_app``) in Flower's
Ray simulation for two rounds, as a user runs it; the outcome is checked on disk and
with `flwr list` (`flwr run --stream` exits 0 even when a run fails)."""

import json
import os
import shutil
import sys

import pytest

from .helpers import run_flwr_app

pytestmark = [
    pytest.mark.slow,  # Ray simulation: `pytest -m slow`
    pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                       reason="the flwr CLI is not installed beside this Python"),
]


def test_flwr_run_numpyclient_app_under_joint_dp(tmp_path):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "examples/quickstart-numpyclient", (
        f"num-server-rounds=2 jdp.results-dir='{results}'"), supernodes=3)
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed", log[-3000:]
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(h["evaluated_owners"] == 3 for h in res["history"])
    assert res["history"][-1]["owner_metrics"]["accuracy"] > 0.2  # 10 classes: chance is 0.1
    assert 0 < res["final_epsilon"] <= 8.0
    assert "[round 2/2] mean personalized accuracy" in log
    assert "finished:completed" in listed, listed[-2000:]
