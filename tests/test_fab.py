"""Every Flower App of the repository builds into a FAB that Flower accepts: under
its size limit and holding the app's code, not the committed results (which grow
with every experiment and once pushed the root app past the 10 MB limit)."""

import io
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.common.constant import FAB_MAX_SIZE

ROOT = Path(__file__).resolve().parents[1]
APPS = [ROOT] + sorted(p.parent for p in (ROOT / "examples").glob("*/pyproject.toml"))


@pytest.mark.parametrize("app", APPS, ids=lambda p: str(p.relative_to(ROOT)) or ".")
def test_app_builds_into_a_fab_below_the_limit_without_results(app):
    fab = build_fab_from_disk(app)
    assert len(fab) < FAB_MAX_SIZE // 2  # room to grow
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert "pyproject.toml" in names
    assert not [n for n in names if n.startswith(("results/", "examples/", "tests/", "research/"))]
    if app == ROOT:
        assert {"flwr_jdp/joint_dp/server_app.py", "flwr_jdp/joint_dp/client_app.py", "flwr_jdp/joint_dp/strategy.py"} <= set(names)
