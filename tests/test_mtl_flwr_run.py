"""End to end: `flwr run apps/dp_mtl` (the DP-MTL Flower App) in Flower's Ray
simulation, as a user runs it; the outcome is checked on disk and with
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
def test_flwr_run_dp_mtl(tmp_path):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "apps/dp_mtl", (
        f"num-tasks=60 rounds=3 target-epsilon=2.0 noise-seed=1 lr=0.1 finetune-lr=0.1 results-dir='{results}'"))
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed"
    assert [h["round"] for h in res["history"]] == [1, 2, 3]
    assert all(h["tasks"] == 60 for h in res["history"])
    assert 1.9 < res["epsilon"] <= 2.0
    assert res["calibration"]["ratio"] > 1.0
    assert "[round 3/3] personalized" in log
    assert "finished:completed" in listed, listed[-2000:]
