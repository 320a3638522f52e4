"""End to end: `flwr run apps/subject_dp` (subject-level DP across silos) in
Flower's Ray simulation, as a user runs it, on a small slice of FEMNIST; the
outcome is checked on disk and with `flwr list`."""

import json
import os
import shutil
import sys

import pytest

from .helpers import run_flwr_app

pytestmark = pytest.mark.extended  # long end-to-end check: `pytest -m extended` (not in CI)


@pytest.mark.skipif(shutil.which("flwr", path=os.path.dirname(sys.executable)) is None,
                    reason="the flwr CLI is not installed beside this Python")
def test_flwr_run_subject_dp(tmp_path, femnist_dir):
    results = tmp_path / "results"
    log, listed = run_flwr_app(tmp_path, "apps/subject_dp", (
        f"data-dir='{femnist_dir}' max-writers=20 num-silos=4 budget-rounds=2 batch-size=32 "
        f"local-steps=1 noise-seed=1 results-dir='{results}'"))
    assert (results / "results.json").is_file(), f"no results written; flwr run said:\n{log[-4000:]}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed"
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(h["silos"] == 4 for h in res["history"])
    assert 0 < res["history"][-1]["epsilon"] <= 4.0
    assert "[round 2/2] accuracy" in log
    assert "finished:completed" in listed, listed[-2000:]
