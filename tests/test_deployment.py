"""Deployment: the app runs unchanged on a real Flower federation started here.

One `flower-superlink` and three `flower-supernode` processes on 127.0.0.1
(insecure, no runtime dependency installation, FLWR_HOME in a temporary folder,
the venv's `bin` on PATH), each SuperNode with its own `--node-config`. The run is
started with `flwr run . <federation>` and awaited by polling `flwr list` (not by
trusting `--stream`). Checks: results and ledger written, personal state kept per
SuperNode across rounds, and epsilon equal to the in-process run of the same
configuration.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import run_inprocess

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NODES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def federation(tmp_path):
    """A SuperLink and three SuperNodes; yields (env, federation name)."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    port = free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n\n'
        f'[superlink.testfed]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    procs = []
    logs = []

    def start(cmd, name):
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))

    start([str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
           "--port", str(port), "--database", str(tmp_path / "state.db")], "superlink")
    for i in range(NODES):
        start([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
               "--port", str(free_port()), "--node-config", f"partition-id={i} num-partitions={NODES}"],
              f"supernode{i}")
    try:
        yield env, "testfed", tmp_path
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()


def _runs(env, fed):
    out = subprocess.run([str(BIN / "flwr"), "list", fed, "--format", "json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    try:
        return json.loads(out.stdout).get("runs", [])
    except ValueError:
        return []


@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None,
                    reason="Flower's SuperLink is not installed beside this Python")
def test_joint_dp_runs_on_a_real_superlink_and_three_supernodes(federation, run_config):
    env, fed, tmp = federation
    results = tmp / "results"
    overrides = {"num-owners": 6, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
                 "noise-multiplier": 0.0, "target-epsilon": 8.0, "resume": False}
    rc_text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}"
                       for k, v in overrides.items()) + f" results-dir='{results}'"
    started = None
    for _ in range(20):  # the SuperNodes may still be connecting
        proc = subprocess.run([str(BIN / "flwr"), "run", ".", fed, "--run-config", rc_text],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if "Successfully started run" in proc.stdout + proc.stderr:
            started = proc
            break
        time.sleep(2)
    assert started is not None, f"flwr run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    deadline = time.time() + 600
    status = ""
    while time.time() < deadline:
        runs = _runs(env, fed)
        status = runs[0]["status"] if runs else ""
        if status.startswith("finished"):
            break
        time.sleep(3)
    logs = "".join((tmp / f).read_text()[-1500:] for f in ("superlink.log", "supernode0.log"))
    assert status == "finished:completed", f"run status {status!r}\n{logs}"
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed"
    assert (results / "ledger.json").is_file() and (results / "model.npz").is_file()
    assert res["num_owners"] == 6
    # personal state kept on every SuperNode across rounds
    assert [r["personal_rounds_min"] for r in res["history"]] == [1, 2]
    # epsilon as in an in-process run of the same configuration (3 nodes, same sizes)
    run_config.update(overrides)
    run_config["results-dir"] = str(tmp / "inprocess")
    strategy, _, _ = run_inprocess(run_config, num_nodes=NODES)
    assert res["final_epsilon"] == pytest.approx(strategy.ledger.epsilon(), rel=1e-9)
    assert res["noise_multiplier"] == pytest.approx(strategy.noise_multiplier, rel=1e-12)
