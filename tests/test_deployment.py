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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flwr_jdp.privacy.ledger import PrivacyLedger, owner_scope
from flwr_jdp.strategies import load_results

from .helpers import flwr_env, free_port, run_inprocess

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NODES = 3


@pytest.fixture
def federation(tmp_path):
    """A SuperLink and three SuperNodes; yields (env, federation name)."""
    home = tmp_path / "flwr-home"
    env = flwr_env(home)
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
        # each process leads its own process group, so teardown also reaches the
        # ClientApp/ServerApp children it spawns (even after the leader was SIGKILLed)
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    start([str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
           "--port", str(port), "--database", str(tmp_path / "state.db")], "superlink")
    for i in range(NODES):
        # no owner policy: a real SuperNode then refuses unless it opts in to trusting the run
        node_cfg = (f"partition-id={i} num-partitions={NODES} state-dir='{tmp_path / f'node{i}'}' "
                    "policy='trust-run'")
        start([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
               "--port", str(free_port()), "--node-config", node_cfg], f"supernode{i}")
    try:
        yield env, "testfed", tmp_path, procs[0].pid, procs
    finally:
        # the SuperLink starts its SuperExec detached (a session of its own): note every
        # live descendant now, before the parents exit and the children are re-parented
        children = [pid for p in procs for pid in _descendants_named(p.pid, "")]
        _signal_groups(procs, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        _signal_groups(procs, signal.SIGKILL)  # whatever ignored SIGTERM, children included
        for pid in children:
            try:
                cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                if b"flwr" in cmd or b"flower" in cmd:  # not a recycled PID
                    os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already (ProcessLookupError is an OSError)
                pass
        for p in procs:
            p.wait(timeout=20)
        for log in logs:
            log.close()


def _signal_groups(procs, sig) -> None:
    """Send ``sig`` to the process group of every process started by the fixture."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group has exited


def _runs(env, fed):
    out = subprocess.run([str(BIN / "flwr"), "list", fed, "--format", "json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    try:
        return json.loads(out.stdout).get("runs", [])
    except ValueError:
        return []


def _descendants_named(root_pid: int, name: str) -> list[int]:
    """PIDs of processes under ``root_pid`` whose command line contains ``name``."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out = []
    for pid in parent:
        p, seen = pid, 0
        while p in parent and p != root_pid and seen < 64:
            p, seen = parent[p], seen + 1
        if p != root_pid:
            continue
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if name in cmd:
            out.append(pid)
    return out


def _start_run(env, fed, overrides, results):
    rc_text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}"
                       for k, v in overrides.items()) + f" results-dir='{results}'"
    for _ in range(20):  # the SuperNodes may still be connecting
        proc = subprocess.run([str(BIN / "flwr"), "run", ".", fed, "--run-config", rc_text],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        if "Successfully started run" in out:
            return out.split("Successfully started run")[1].split()[0]
        time.sleep(2)
    raise AssertionError(f"flwr run failed: {out[-3000:]}")


def _wait_finished(env, fed, run_id, tmp, timeout=600):
    deadline = time.time() + timeout
    status = ""
    while time.time() < deadline:
        runs = {r["run-id"]: r for r in _runs(env, fed)}
        status = runs.get(run_id, {}).get("status", "")
        if status.startswith("finished"):
            return status
        time.sleep(3)
    logs = "".join((tmp / f).read_text()[-1500:] for f in ("superlink.log", "supernode0.log"))
    raise AssertionError(f"run {run_id} status {status!r} after {timeout}s\n{logs}")


def _owner_ledgers(tmp):
    """Each owner's own record of its releases, from its SuperNode's state-dir."""
    out = {}
    for path in tmp.glob("node*/*/ledger-*.json"):
        try:
            out[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now: read it again later
            continue
    return out


@pytest.mark.slow  # SuperLink processes: `pytest -m slow`
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None,
                    reason="Flower's SuperLink is not installed beside this Python")
def test_serverapp_killed_mid_round_resumes_and_charges_every_release(federation, run_config):
    """The joint-DP app runs on a real SuperLink and three SuperNodes, and survives its
    ServerApp being killed in the middle of a round without under-charging.

    SIGKILL the ServerApp process once the owners have received round 2's train
    messages (an owner has charged round 2 in its own ledger, on its node's disk) and
    before the round ends; `flwr run` again with the same configuration. The ledger
    on disk already charged round 2 at the kill (charge, save, release). The resumed
    run keeps that charge and charges round 2's re-run again; round 3 would then take
    the run past its budget, so the run stops there (`budget-exhausted`) with the
    true epsilon: for every owner the server's ledger charges at least the releases
    the owner recorded itself, and epsilon equals an uninterrupted 3-round run's
    (three charges of the same calibrated round). The owners reuse their personal
    layers from their SuperNode's state-dir. (One test covers both the plain
    deployment and the restart: each deployment run costs minutes of Flower message
    latency on 2 cores.)"""
    env, fed, tmp, superlink_pid, _ = federation
    results = tmp / "results"
    overrides = {"num-owners": 6, "num-rounds": 3, "local-epochs": 1, "batch-size": 32,
                 "noise-multiplier": 0.0, "target-epsilon": 8.0, "resume": True}
    run_id = _start_run(env, fed, overrides, results)
    deadline = time.time() + 600
    while time.time() < deadline:
        if any(len(led["rounds"]) >= 2 for led in _owner_ledgers(tmp).values()):
            break  # round 2's instructions reached an owner, which charged it and trains now
        time.sleep(0.1)
    victims = _descendants_named(superlink_pid, "flwr-serverapp")
    assert victims, "no ServerApp process to kill"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    mid = load_results(results)
    assert mid["status"] == "running" and mid["rounds_completed"] == 1  # killed inside round 2
    charged = [r["round"] for r in json.loads((results / "ledger.json").read_text())["rounds"]]
    assert charged == [1, 2]  # round 2 was on disk before its messages left
    eps_mid = mid["epsilon"]
    # the first run ends (the SuperLink notices its ServerApp is gone) or is stopped
    subprocess.run([str(BIN / "flwr"), "stop", run_id, fed], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=120)
    run2 = _start_run(env, fed, overrides, results)
    assert _wait_finished(env, fed, run2, tmp) == "finished:completed"
    res = load_results(results)
    assert res["status"] == "budget-exhausted" and [r["round"] for r in res["history"]] == [1, 2]
    assert (results / "ledger.json").is_file() and (results / "model.npz").is_file()
    assert res["num_owners"] == 6
    assert res["epsilon"] > eps_mid and res["epsilon"] <= 8.0  # continued, within the budget
    assert res["session"] == mid["session"]
    ledger = PrivacyLedger.load(results / "ledger.json")
    assert [r["round"] for r in ledger.rounds] == [1, 2, 2]
    own = _owner_ledgers(tmp)
    assert sorted(own) == list(range(6))
    for o, state in own.items():
        server_charges = sum(c for _, c in ledger.scopes[owner_scope(o)])
        assert server_charges >= sum(c for _, c in state["scopes"]["self"]) >= 2
        assert state["epsilon"] <= ledger.scope_epsilon(owner_scope(o)) * (1 + 1e-9)
    # personal layers continued from the nodes' disks (a fresh state would restart at 1)
    assert res["history"][-1]["personal_rounds_min"] >= 2
    run_config.update(overrides)
    run_config["results-dir"] = str(tmp / "reference")
    strategy, _, _ = run_inprocess(run_config, num_nodes=NODES)
    assert res["epsilon"] == pytest.approx(strategy.ledger.epsilon(), rel=1e-9)
    assert res["noise_multiplier"] == pytest.approx(strategy.noise_multiplier, rel=1e-12)


@pytest.mark.extended  # also covered by the deployment guide's SuperNode-failure block
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None,
                    reason="Flower's SuperLink is not installed beside this Python")
def test_supernode_disconnecting_mid_run_is_dropped_and_charged(federation, run_config):
    """SIGKILL one SuperNode once training has started: every round completes with the
    other two nodes after `round-timeout`, the lost owners are dropped with a reason,
    and the ledger charges every owner of every round (conservative accounting).
    The timeout is 40 s: one message wave through SuperLink, SuperNode and a fresh
    ClientApp process takes 10-25 s on 2 cores, and a live node must never miss it."""
    env, fed, tmp, _, procs = federation
    results = tmp / "results"
    overrides = {"num-owners": 6, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
                 "noise-multiplier": 1.0, "target-epsilon": 50.0, "resume": False,
                 "round-timeout": 40.0}
    run_id = _start_run(env, fed, overrides, results)
    deadline = time.time() + 300
    while time.time() < deadline and not list(tmp.glob("node2/*/personal-*.npz")):
        time.sleep(0.2)  # node 2 has trained in round 1: it is alive and the run is on
    procs[3].kill()  # SuperNode with partition-id 2 (owners 2 and 5) disconnects
    assert _wait_finished(env, fed, run_id, tmp) == "finished:completed"
    res = load_results(results)
    assert res["status"] == "completed"
    last = res["history"][-1]
    assert last["dropped_owners"] == 2 and last["valid_owners"] == 4 and not last["skipped"]
    ledger = json.loads((results / "ledger.json").read_text())
    assert all(r["scopes"] == 6 for r in ledger["rounds"])  # dropped owners charged too
