"""End to end: `flwr run apps/priv_altmin` (the Priv-AltMin Flower App) in Flower's
Ray simulation, as a user runs it; the outcome is checked on disk and with
`flwr list` (`flwr run --stream` exits 0 even when a run fails)."""

import json
import os
import shutil
import sys

import pytest

from .helpers import run_flwr_app

pytestmark = pytest.mark.extended  # long end-to-end check: `pytest -m extended` (not in CI)


@pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                    reason="the flwr CLI is not installed beside this Python")
def test_flwr_run_priv_altmin(tmp_path):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "apps/priv_altmin", (
        f"num-users=4000 dim=10 epochs=2 target-epsilon=4.0 clip-a=80.0 noise-seed=2 results-dir='{results}'"))
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert [h["epoch"] for h in res["history"]] == [0, 1, 2]
    assert all(h["users"] == 4000 for h in res["history"])
    eps = [h["epsilon"] for h in res["history"]]
    assert eps == sorted(eps) and 3.9 < eps[-1] <= 4.0
    # far better than a random embedding (excess MSE ~ 2 k = 4)
    assert res["final_mse"] < 0.05
    assert "[epoch 2/2] population excess MSE" in log
    assert "finished:completed" in listed, listed[-2000:]
