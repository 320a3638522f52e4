"""End to end: `flwr run examples/quickstart-mtl` (a user's own Flower app converted
to DP mean-regularized MTL with MTLClient and DPMeanRegularizedMTL.from_run_config)
in Flower's Ray simulation for two rounds, as a user runs it; the outcome is checked
on disk and with `flwr list` (`flwr run --stream` exits 0 even when a run fails)."""

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


def test_flwr_run_quickstart_mtl(tmp_path, fashion_mnist_dir):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "examples/quickstart-mtl", (
        f"num-server-rounds=2 jdp.rounds=2 num-records=3000 data-dir='{fashion_mnist_dir}' "
        f"jdp.results-dir='{results}'"), supernodes=3)
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed", res.get("dropped")
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(h["tasks"] == 3 and h["evaluated_tasks"] == 3 for h in res["history"])
    assert 0 <= res["final"]["eval_acc"] <= 1 and res["final"]["eval_loss"] > 0
    assert 0 < res["epsilon"] <= 8.0
    assert not res["dropped"]
    assert "[round 2/2] personalized models" in log
    assert "finished:completed" in listed, listed[-2000:]
