"""End to end: `flwr run examples/quickstart-pytorch` (a user's own Flower app
converted to joint DP with JointDPClient) in Flower's Ray simulation for two rounds,
as a user runs it; the outcome is checked on disk and with `flwr list`
(`flwr run --stream` exits 0 even when a run fails)."""

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


def test_flwr_run_quickstart_pytorch_under_joint_dp(tmp_path, fashion_mnist_dir):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "examples/quickstart-pytorch", (
        f"num-server-rounds=2 jdp.num-rounds=2 num-records=3000 data-dir='{fashion_mnist_dir}' "
        f"jdp.results-dir='{results}'"), supernodes=3)
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed"
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(h["evaluated_owners"] == 3 for h in res["history"])
    assert res["history"][-1]["owner_metrics"]["eval_acc"] > 0.2
    assert 0 < res["final_epsilon"] <= 8.0
    assert "[round 2/2] mean personalized accuracy" in log
    assert "finished:completed" in listed, listed[-2000:]



def test_flwr_run_quickstart_pytorch_with_distributed_noise(tmp_path, fashion_mnist_dir):
    """The same app, unchanged, with one setting: noise-placement = "distributed". Each
    node adds a Skellam share to its rounded clipped sum and Flower's SecAgg+ (its client
    mod, the strategy's protocol stages) gives the server only the sum."""
    from pathlib import Path

    app = tmp_path / "app"
    shutil.copytree(Path(__file__).resolve().parent.parent / "examples" / "quickstart-pytorch", app,
                    ignore=shutil.ignore_patterns("results", "__pycache__", "*.pt"))
    toml = (app / "pyproject.toml").read_text()
    table = "[tool.flwr.app.config.jdp]"
    assert table in toml
    (app / "pyproject.toml").write_text(toml.replace(table, table + (
        '\nnoise-placement = "distributed"  # the only change: noise shares, summed by SecAgg+'
        "\nnum-owners = 3\nlearning-rate = 1.0"), 1))
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, str(app), (
        f"num-server-rounds=2 jdp.num-rounds=2 num-records=3000 data-dir='{fashion_mnist_dir}' "
        f"jdp.results-dir='{results}'"), supernodes=3)
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed", log[-3000:]
    assert [h["valid_owners"] for h in res["history"]] == [3, 3]
    assert 0 < res["final_epsilon"] <= 8.0
    assert "Distributed noise: each owner adds Skellam noise" in log
    assert "finished:completed" in listed, listed[-2000:]
