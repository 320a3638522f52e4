"""docs/deploy.md, *Run only the app you reviewed*: an owner's SuperNode runs only the
FAB its owner reviewed, and a modified app is refused.

The section's ```shell blocks (tagged ``<!-- deploy-trusted-test: NAME -->``) are
sourced as written into one ``bash`` with ``set -e``, after the guide's own
*Settings* (this checkout, this environment, a temporary ``WORK``, free ports),
*Environment*, ``config.toml`` and *Start the SuperLink* blocks, with the shell and
clean-up of ``tests/test_deploy_guide.py``; its *Stop everything* block ends it.
Checked on the real outcome: the reviewed app's run is ``finished:completed`` with
every owner valid in both rounds and every SuperNode logging the reviewed hash; the
modified app (one line appended to its ``client_app.py``) is ``finished:failed``,
the ServerApp log and the SuperNodes' logs name the refusal with exactly the
modified FAB's hash (the one ``flwr build`` gives its files), no SuperNode ran it, no
round ran and no owner's own ledger changed.

The launcher's check itself (``examples/deploy/trusted/reviewed_clientapp.py``) is
also tested in process (fast tier), with the Flower functions it wraps.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_deploy_guide import (
    GUIDE,
    ROOT,
    VENV,
    Shell,
    _cmdlines,
    _free_ports,
    _json,
    guide_blocks,
    with_settings,
)

TRUSTED = re.compile(r"<!-- deploy-trusted-test: ([\w-]+) -->\s*\n```shell\n(.*?)\n```", re.S)
ORDER = ["review", "reviewed-supernodes", "run-reviewed", "run-modified"]
LAUNCHER = ROOT / "examples" / "deploy" / "trusted" / "reviewed_clientapp.py"
SHA = re.compile(r"sha256=([0-9a-f]{64})")


def trusted_blocks() -> dict[str, str]:
    """The section's shell blocks by tag, in the order the guide gives them."""
    text = GUIDE.read_text()
    tagged = TRUSTED.findall(text)
    assert len(tagged) == len(re.findall(r"^```shell$", text, re.M)), "a ```shell block without its tag"
    assert [name for name, _ in tagged] == ORDER
    return dict(tagged)


def _launcher():
    spec = importlib.util.spec_from_file_location("reviewed_clientapp", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- fast tier

def test_the_launcher_refuses_every_fab_but_a_reviewed_one_named_by_its_own_hash(tmp_path):
    rc = _launcher()
    fab, other = b"reviewed fab bytes", b"reviewed fab bytes."
    good, bad = hashlib.sha256(fab).hexdigest(), hashlib.sha256(other).hexdigest()
    listed = tmp_path / "sha256.txt"
    listed.write_text(f"# reviewed 2026-01-01\n{good.upper()}  flwr-jdp.fab\nnot-a-hash\n")
    reviewed = rc.reviewed_hashes(str(listed))
    assert reviewed == {good}
    assert rc.check_fab(fab, good, good, reviewed) == good
    with pytest.raises(rc.UnreviewedFab, match=f"refused FAB sha256={bad}"):
        rc.check_fab(other, bad, bad, reviewed)  # one byte more
    for fab_hash, run_hash in ((bad, good), (good, bad), ("", "")):  # installed or run under another name
        with pytest.raises(rc.UnreviewedFab):
            rc.check_fab(fab, fab_hash, run_hash, reviewed)
    # no list, an unreadable one or an empty one: every FAB is refused
    for path in (None, "", str(tmp_path / "missing.txt")):
        assert rc.reviewed_hashes(path) == set()
        with pytest.raises(rc.UnreviewedFab):
            rc.check_fab(fab, good, good, rc.reviewed_hashes(path))


def test_the_launcher_wraps_this_flowers_own_clientapp():
    """The functions the launcher wraps exist in this Flower, the SuperNode starts its
    ClientApps by the name the launcher takes, and the wrapper calls the launcher."""
    from flwr.supercore.constant import TASK_TYPE_TO_COMMAND, TaskType
    from flwr.supernode.runtime import run_clientapp as rc

    assert callable(rc.pull_task_input) and callable(rc.install_from_fab)
    assert TASK_TYPE_TO_COMMAND[TaskType.CLIENT_APP] == "flwr-clientapp"
    wrapper = LAUNCHER.parent / "bin" / "flwr-clientapp"
    assert wrapper.stat().st_mode & 0o111, "the launcher must be executable"
    assert "reviewed_clientapp.py" in wrapper.read_text()


def test_the_sections_blocks_parse():
    for name, code in trusted_blocks().items():
        check = subprocess.run(["bash", "-n"], input=code, text=True, capture_output=True)
        assert check.returncode == 0, f"{name}: {check.stderr}"
        assert not re.search(r"\b(pkill|killall)\b", code), name
    assert "FLWR_JDP_REVIEWED_FABS=" in trusted_blocks()["reviewed-supernodes"]


# ---------------------------------------------------------------- the section, run

@pytest.fixture
def shell(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "FLWR_HOME", "FLWR_JDP_REVIEWED_FABS"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if Path(p).resolve() != (VENV / "bin").resolve())
    sh = Shell(tmp_path, env)
    try:
        yield sh
    finally:
        sh.close()


def _ledgers(work: Path) -> dict[str, str]:
    """Every node's ledger file (one per node under a policy), by path."""
    return {str(p): p.read_text() for p in sorted(work.glob("node-*/owners/ledger-*.json"))}


def _run(out: str, app: Path) -> tuple[str, str]:
    """(run id, status) from run_app's ``run <id> of <app>: <status>``."""
    found = re.findall(rf"^run (\d+) of {re.escape(str(app))}: (\S+)$", out, re.M)
    assert len(found) == 1, out
    return found[0]


def _fab_hash(app: Path, tmp: Path) -> str:
    """SHA-256 of the FAB ``flwr build`` makes from ``app``."""
    out = tmp / f"build-{app.name}"
    out.mkdir()
    subprocess.run([str(VENV / "bin" / "flwr"), "build", "--app", str(app)], cwd=out, check=True,
                   capture_output=True, timeout=300)
    (fab,) = out.glob("*.fab")
    return hashlib.sha256(fab.read_bytes()).hexdigest()


@pytest.mark.slow  # a SuperLink and three SuperNodes (free ports): `pytest -m slow`
def test_an_owners_supernode_runs_the_reviewed_app_and_refuses_a_modified_one(shell, tmp_path):
    guide, blocks = guide_blocks(), trusted_blocks()
    work = tmp_path / "work"
    nodes = int(re.search(r"^NODES=(\d+)", guide["settings"], re.M).group(1))
    taken: set[int] = set()
    settings = with_settings(guide["settings"], {
        "APP_DIR": str(ROOT), "VENV": str(VENV), "WORK": str(work),
        "PORT": str(_free_ports(1, taken)), "NODE_PORT": str(_free_ports(nodes, taken)),
        "RAY_PORT": str(_free_ports(2, taken)),
    })
    t0 = time.time()
    shell.run("settings", settings, 60)
    for name in ("env", "config", "superlink"):
        shell.run(name, guide[name], 300)

    # ---- review: the FAB built from this checkout, listed with its hash
    out = shell.run("review", blocks["review"], 300)
    (fab,) = (work / "reviewed").glob("*.fab")
    reviewed = hashlib.sha256(fab.read_bytes()).hexdigest()
    assert "apps/joint_dp/joint_dp/client_app.py" in out
    assert (work / "reviewed" / "sha256.txt").read_text().split() == [reviewed, fab.name]

    # ---- the SuperNodes, with the check
    shell.run("reviewed-supernodes", blocks["reviewed-supernodes"], 120)
    assert len(list(work.glob("supernode-*.pid"))) == nodes

    # ---- the reviewed app runs, with every owner
    out = shell.run("run-reviewed", blocks["run-reviewed"], 900)
    assert _run(out, ROOT)[1] == "finished:completed", out
    (results,) = work.glob("results-reviewed-*")
    res = _json(results / "results.json")
    assert res["status"] == "completed" and res["num_owners"] == 6, res
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert all(h["valid_owners"] == 6 and h["dropped_owners"] == 0 for h in res["history"])
    logs = {i: (work / f"supernode-{i}.log").read_text() for i in range(nodes)}
    for i, log in logs.items():
        assert f"running reviewed FAB sha256={reviewed}" in log, f"SuperNode {i}:\n{log[-3000:]}"
        assert "refused FAB" not in log
    assert set(SHA.findall(out)) == {reviewed}
    ledgers = _ledgers(work)
    assert len(ledgers) == nodes  # under the owners' policy each node charges one ledger for its owners
    print(f"reviewed run done after {time.time() - t0:.0f}s")

    # ---- a modified app: one line appended to its client_app.py; refused, nothing runs
    out = shell.run("run-modified", blocks["run-modified"], 600)
    modified_dir = work / "modified"
    original = (ROOT / "apps/joint_dp/joint_dp/client_app.py").read_text()
    changed = (modified_dir / "apps/joint_dp/joint_dp/client_app.py").read_text()
    assert changed.startswith(original) and changed[len(original):].count("\n") == 1
    modified = _fab_hash(modified_dir, tmp_path)
    assert modified != reviewed
    assert _run(out, modified_dir)[1] == "finished:failed", out
    # the ServerApp's log (flwr log) and a SuperNode's log name the refusal and the hash
    refusals = [line for line in out.splitlines() if "refused FAB" in line]
    assert len(refusals) == 2 and all(f"refused FAB sha256={modified}" in r for r in refusals), out
    assert any("failed at set-up" in r for r in refusals), refusals  # the ServerApp's line
    logs = {i: (work / f"supernode-{i}.log").read_text() for i in range(nodes)}
    assert any(f"refused FAB sha256={modified}" in log for log in logs.values())
    assert not any(f"running reviewed FAB sha256={modified}" in log for log in logs.values())
    for results in work.glob("results-modified-*"):  # the ServerApp may not have made it
        assert not _json(results / "results.json").get("history"), "a round ran"
    assert _ledgers(work) == ledgers, "an owner charged a release of the refused run"
    print(f"modified run refused after {time.time() - t0:.0f}s")

    # ---- the guide's Stop everything
    shell.run("stop", guide["stop"], 300)
    deadline = time.time() + 60
    while shell.alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not shell.alive(), f"still running after the guide's stop block: {_cmdlines(shell.alive())}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-m", "slow or not slow", "-q"]))
