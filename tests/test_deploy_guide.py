"""docs/deploy.md, run as written: every ```bash block, in one bash with ``set -e``.

The guide's blocks are meant to be pasted, in order, into one shell; here they are
sourced, one at a time, into one long-lived ``bash --noprofile --norc`` (so the
variables and functions a block defines reach the later ones, as in the user's
shell), in a temporary working directory, with a PATH that does not hold the
virtual environment (the guide puts it there). The only changes are to the
settings the guide defines at its top: ``APP_DIR`` (this checkout), ``VENV`` (this
Python's environment), ``WORK`` (a temporary folder, which also holds FLWR_HOME) and
the ports (free ones). Each block carries an HTML comment ``<!-- deploy-test: NAME
-->``, which is how the test knows what it is for; an untagged or unknown block fails
the test, so the guide and the test cannot drift apart silently.

One federation (a SuperLink and three SuperNodes) serves two runs:

1. run A: SuperNode 2 is SIGKILLed once it has trained (the guide's "When a SuperNode
   fails"); the run still finishes ``finished:completed``, the later round has 4
   valid and 2 dropped owners, and the ledger charges all 6 owners in every round;
2. run B: the SuperLink is restarted after round 1 (same ``--database``), the
   SuperNodes that exited are started again and ``flwr run`` is re-issued with the
   same configuration: the run finishes, its history continues, and the ledger keeps
   every charge made before the restart (epsilon not reset), with the owners' state
   on the nodes' disks;

3. run D: distributed noise (the guide's SecAgg+ block) among the three SuperNodes
   finishes ``finished:completed`` with all 6 owners in every round;

then the guide's "Stop everything" block must leave none of the processes it started.
The Ray block is not run (Ray on a shared machine is neither cheap nor safe): its
options are checked instead.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # SuperLink/SuperNode processes (free ports): `pytest -m slow`

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "deploy.md"
VENV = Path(sys.prefix)
TAGGED = re.compile(r"<!-- deploy-test: ([\w-]+) -->\s*\n```bash\n(.*?)\n```", re.S)
# every block of the guide, and the order in which this test runs them
RUN_ORDER = ["settings", "env", "config", "superlink", "supernodes",
             "start-run", "kill-node", "wait", "restart-node",
             "start-run", "restart-superlink", "restart-nodes", "resume", "state", "distributed", "stop"]
NOT_RUN = {"ray"}


def guide_blocks() -> dict[str, str]:
    """The guide's bash blocks by tag; every ```bash block must carry a known tag."""
    text = GUIDE.read_text()
    tagged = TAGGED.findall(text)
    assert len(tagged) == len(re.findall(r"^```bash$", text, re.M)), "a ```bash block without a deploy-test tag"
    names = [name for name, _ in tagged]
    assert len(set(names)) == len(names), f"a deploy-test tag is used twice: {names}"
    assert set(names) == set(RUN_ORDER) | NOT_RUN, f"guide tags {names} != the test's"
    return dict(tagged)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int, taken: set[int]) -> int:
    """First of ``count`` consecutive free ports (not in ``taken``)."""
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, 60000)
        span = range(base, base + count)
        if not taken.intersection(span) and all(_port_free(p) for p in span):
            taken.update(span)
            return base
    raise RuntimeError("no free ports")


def with_settings(block: str, values: dict[str, str]) -> str:
    """The settings block with ``NAME=value`` replaced for each given name (comments kept)."""
    for name, value in values.items():
        block, count = re.subn(rf"^{name}=\S*", lambda _m, n=name, v=value: f"{n}={shlex.quote(v)}",
                               block, flags=re.M)
        assert count == 1, f"the guide's settings define {name} {count} times"
    return block


def _proc_info(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, process group, start time) of ``pid``, or None if it is gone."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None  # a zombie has exited
    return int(fields[1]), int(fields[2]), int(fields[19])


class Shell:
    """One bash that sources the guide's blocks in turn, and every process it started."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        (tmp / "blocks").mkdir()
        self.log_path = tmp / "shell.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp, env=env,
                                     text=True, start_new_session=True)
        self.seen: dict[int, tuple[int, int]] = {}  # pid -> (process group, start time)
        self.count = 0
        self._send("set -e")

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def track(self) -> None:
        """Note every live descendant of the shell (the SuperLink's SuperExec starts a
        session of its own, and outlives a killed SuperLink): kept for the clean-up."""
        parents = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (info := _proc_info(int(entry.name))) is not None:
                parents[int(entry.name)] = info
        groups = {g for g, _ in self.seen.values()}
        for pid, (ppid, pgid, start) in parents.items():
            p, hops = ppid, 0
            while p in parents and p != self.proc.pid and hops < 64:
                p, hops = parents[p][0], hops + 1
            if pid != self.proc.pid and (p == self.proc.pid or pgid in groups):
                self.seen.setdefault(pid, (pgid, start))

    def alive(self) -> list[int]:
        """The noted processes that still run (the same processes: start times match)."""
        return [pid for pid, (_, start) in self.seen.items()
                if (info := _proc_info(pid)) is not None and info[2] == start]

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-chars:]

    def run(self, name: str, code: str, timeout: float) -> str:
        """Source ``code`` in the shell; return what it printed. Fails if the shell exits
        (``set -e``: a command failed) or the block runs past ``timeout``."""
        self.count += 1
        script = self.tmp / "blocks" / f"{self.count:02d}-{name}.sh"
        script.write_text(code + "\n")
        marker = self.tmp / "blocks" / f"{self.count:02d}.done"
        start = self.log_path.stat().st_size
        self._send(f"source {shlex.quote(str(script))} < /dev/null; touch {shlex.quote(str(marker))}")
        deadline = time.time() + timeout
        while not marker.exists():
            self.track()
            if self.proc.poll() is not None:
                raise AssertionError(f"block {name!r} failed (bash exited {self.proc.returncode}):\n"
                                     f"{self.tail()}\n{self._logs()}")
            if time.time() > deadline:
                raise AssertionError(f"block {name!r} still running after {timeout:.0f}s:\n"
                                     f"{self.tail()}\n{self._logs()}")
            time.sleep(0.5)
        self.track()
        self.log.flush()
        return self.log_path.read_bytes()[start:].decode(errors="replace")

    def _logs(self) -> str:
        work = self.tmp / "work"
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                       for p in sorted(work.glob("*.log")))

    def close(self) -> None:
        """Stop the shell and everything it started, even after a failure."""
        self.track()
        groups = {self.proc.pid} | {pgid for pid, (pgid, _) in self.seen.items() if pid == pgid}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.alive():
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            for pgid in groups:
                try:
                    os.killpg(pgid, sig)
                except OSError:
                    pass
            deadline = time.time() + 20
            while self.alive() and time.time() < deadline:
                time.sleep(0.5)
        try:
            self.proc.wait(timeout=20)
        finally:
            self.log.close()


def _wait_for(what: str, check, shell: Shell, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not check():
        shell.track()
        if time.time() > deadline:
            raise AssertionError(f"no {what} after {timeout}s:\n{shell.tail()}\n{shell._logs()}")
        time.sleep(0.5)


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        out.append(f"{pid}: {cmd[:200]}")
    return out


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _run_line(out: str) -> tuple[str, Path]:
    """(run id, results folder) from start_run's ``run <id> writes to <folder>``."""
    match = re.search(r"^run (\d+) writes to (\S+)$", out, re.M)
    assert match, out
    return match.group(1), Path(match.group(2))


def _status(out: str, run_id: str) -> str:
    """The status wait_run printed for ``run_id``."""
    found = re.findall(rf"^run {run_id}: (\S+)$", out, re.M)
    assert found, out
    return found[-1]


@pytest.fixture
def shell(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "FLWR_HOME"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if Path(p).resolve() != (VENV / "bin").resolve())
    sh = Shell(tmp_path, env)
    try:
        yield sh
    finally:
        sh.close()


def test_the_deployment_guide_runs_as_written(shell, tmp_path):
    blocks = guide_blocks()
    work = tmp_path / "work"
    nodes = int(re.search(r"^NODES=(\d+)", blocks["settings"], re.M).group(1))
    assert nodes == 3  # the kill below takes SuperNode 2 (owners 2 and 5 of 6)
    taken: set[int] = set()
    settings = with_settings(blocks["settings"], {
        "APP_DIR": str(ROOT), "VENV": str(VENV), "WORK": str(work),
        "PORT": str(_free_ports(1, taken)), "NODE_PORT": str(_free_ports(nodes, taken)),
        "RAY_PORT": str(_free_ports(2, taken)),
    })
    timeouts = {"superlink": 300, "start-run": 300, "wait": 900, "kill-node": 900, "distributed": 900,
                "restart-superlink": 600, "resume": 900, "stop": 300}
    run = iter(RUN_ORDER)

    def step(expected: str) -> str:
        name = next(run)
        assert name == expected
        return shell.run(name, settings if name == "settings" else blocks[name], timeouts.get(name, 120))

    t0 = time.time()
    for name in ("settings", "env", "config", "superlink", "supernodes"):
        out = step(name)
    config = (work / "flwr-home" / "config.toml").read_text()
    assert "[superlink.local]" in config and "[superlink.myfed]" in config and "default" in config

    # ---- run A: SuperNode 2 killed once it has trained; the run completes without it
    run_a, results_a = _run_line(step("start-run"))
    _wait_for("personal state of SuperNode 2", lambda: any(work.glob("node-2/*/personal-*.npz")), shell)
    out = step("kill-node")
    assert _status(out, run_a) == "finished:completed"
    assert "dropped reply" in out  # the ServerApp log names the dropped owners
    out = step("wait")
    assert _status(out, run_a) == "finished:completed" and "status completed" in out
    res = _json(results_a / "results.json")
    assert res["status"] == "completed" and res["num_owners"] == 6
    assert [h["round"] for h in res["history"]] == [1, 2]
    last = res["history"][-1]
    assert last["dropped_owners"] == 2 and last["valid_owners"] == 4 and not last["skipped"]
    ledger = _json(results_a / "ledger.json")
    assert [r["round"] for r in ledger["rounds"]] == [1, 2]
    assert all(r["scopes"] == 6 for r in ledger["rounds"])  # the dropped owners are charged too
    assert (results_a / "model.npz").is_file()
    print(f"run A done after {time.time() - t0:.0f}s")

    step("restart-node")

    # ---- run B: the SuperLink restarts after round 1; the re-issued run resumes
    run_b, results_b = _run_line(step("start-run"))
    assert results_b != results_a
    _wait_for("round 1 of run B", lambda: _json(results_b / "results.json").get("rounds_completed", 0) >= 1,
              shell)
    out = step("restart-superlink")
    interrupted = _status(out, run_b)
    assert interrupted.startswith("finished") and interrupted != "finished:completed", interrupted
    before = _json(results_b / "results.json")
    ledger_before = _json(results_b / "ledger.json")
    assert before["status"] == "running" and before["rounds_completed"] == 1
    step("restart-nodes")
    out = step("resume")
    run_c, results_c = _run_line(out)
    assert results_c == results_b and run_c != run_b
    assert _status(out, run_c) == "finished:completed"
    res = _json(results_b / "results.json")
    assert res["status"] == "completed" and res["session"] == before["session"]
    assert [h["round"] for h in res["history"]] == [1, 2]
    assert res["history"][0] == before["history"][0]  # round 1 kept, not re-run
    ledger = _json(results_b / "ledger.json")
    charged = [r["round"] for r in ledger["rounds"]]
    assert charged[:len(ledger_before["rounds"])] == [r["round"] for r in ledger_before["rounds"]]
    assert len(charged) > len(ledger_before["rounds"]) and charged[-1] == 2
    assert ledger["epsilon"] > ledger_before["epsilon"] >= before["history"][0]["epsilon"]
    assert res["epsilon"] == pytest.approx(ledger["epsilon"])
    assert res["history"][-1]["personal_rounds_min"] >= 2  # personal layers continued from disk
    print(f"run B done after {time.time() - t0:.0f}s")

    # ---- personal state on the nodes' disks, then stop everything
    out = step("state")
    session = res["session"]
    for owner in range(6):
        node = work / f"node-{owner % nodes}"
        assert (node / session / f"personal-{owner}.npz").is_file()
        # the node's one ledger (its policy) is not kept per session: it holds its owners' releases of
        # run A (2 rounds x 2 owners) and of run B (a SuperNode may drop out of one of its rounds), within the cap
        own = _json(node / "owners" / "ledger-node.json")
        sessions = {r["note"].split()[1] for r in own["rounds"]}
        assert len(own["rounds"]) >= 5 and len(sessions) >= 2 and own["epsilon"] <= 20.0, own["rounds"]
    assert f"personal-{0}.npz" in out

    # ---- run D: distributed noise (SecAgg+ among the three SuperNodes)
    out = step("distributed")
    run_d, results_d = _run_line(out)
    assert _status(out, run_d) == "finished:completed", out[-2000:]
    assert "Distributed noise: each owner adds Skellam noise" in out
    res = _json(results_d / "results.json")
    assert res["status"] == "completed" and [h["valid_owners"] for h in res["history"]] == [6, 6]
    print(f"run D done after {time.time() - t0:.0f}s")
    started = set(shell.seen)
    assert len(started) >= 1 + nodes
    step("stop")
    deadline = time.time() + 60
    while shell.alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not shell.alive(), f"still running after the guide's stop block: {_cmdlines(shell.alive())}"

    assert next(run, None) is None
    print(f"guide done after {time.time() - t0:.0f}s")


def test_the_guides_blocks_parse_and_stay_on_this_machine():
    """Every block is valid bash; no block stops processes by name; the Ray block
    (not run here) keeps its cluster on 127.0.0.1 and stops it by its own process id."""
    blocks = guide_blocks()
    for name, code in blocks.items():
        check = subprocess.run(["bash", "-n"], input=code, text=True, capture_output=True)
        assert check.returncode == 0, f"{name}: {check.stderr}"
        assert not re.search(r"\b(pkill|killall)\b|\bray stop\b", code), name
        assert "0.0.0.0" not in code, name
    ray = blocks["ray"]
    assert re.search(r"^export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0$", ray, re.M)
    starts = re.findall(r"ray start((?:[^\n]*\\\n)*[^\n]*)", ray)
    assert starts
    for args in starts:
        words = shlex.split(args.replace("\\\n", " "))
        opts = dict(zip(words, words[1:]))
        assert opts.get("--node-ip-address") == "127.0.0.1"
        assert opts.get("--include-dashboard") == "false" and opts.get("--dashboard-host") == "127.0.0.1"
        assert "--block" in words and "--temp-dir" in words  # owned by one process; not the default cluster
    assert "--ray-address \"127.0.0.1:$RAY_PORT\"" in ray
    assert re.search(r'^kill "\$\(cat "\$WORK/ray-head.pid"\)"', ray, re.M)
    # the Flower processes listen on 127.0.0.1 only
    assert "--host 127.0.0.1" in blocks["superlink"]
    assert 'address = "127.0.0.1:$PORT"' in blocks["config"]
