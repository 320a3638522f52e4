"""Every Flower App of the repository builds into a FAB that Flower accepts: under
its size limit and holding the app's code, not the committed results (which grow
with every experiment and once pushed the root app past the 10 MB limit), nor a copy of
flwr_jdp that would shadow the installed one."""

import io
import tomllib
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.common.constant import FAB_MAX_SIZE

ROOT = Path(__file__).resolve().parents[1]
APPS = [ROOT] + sorted(p.parent for folder in ("apps", "examples") for p in (ROOT / folder).glob("*/pyproject.toml"))


@pytest.mark.parametrize("app", APPS, ids=lambda p: str(p.relative_to(ROOT)) or ".")
def test_app_builds_into_a_fab_below_the_limit_without_results(app):
    fab = build_fab_from_disk(app)
    assert len(fab) < FAB_MAX_SIZE // 2  # room to grow
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert "pyproject.toml" in names
    assert not [n for n in names if n.startswith(("results/", "examples/", "tests/", "research/", "flwr_jdp/",
                                                  "strategies/"))]
    if app == ROOT:  # `flwr run .` runs apps/joint_dp
        assert {f"apps/joint_dp/joint_dp/{m}.py" for m in ("server_app", "client_app", "task")} <= set(names)
        assert not [n for n in names if n.startswith("apps/") and not n.startswith("apps/joint_dp/joint_dp/")]


def test_flwr_run_at_the_root_runs_the_joint_dp_app_with_its_config():
    """The root pyproject.toml's Flower App is apps/joint_dp's: the same components (from
    the root) and the same run config, so `flwr run .` and `flwr run apps/joint_dp` run
    the same thing."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    app = tomllib.loads((ROOT / "apps" / "joint_dp" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert root["config"] == app["config"]
    assert root["components"] == {k: f"apps.joint_dp.{v}" for k, v in app["components"].items()}
