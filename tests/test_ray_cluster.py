"""The simulation runs on an existing Ray cluster (a head and a worker started with
`ray start`), not only on a Ray that Flower starts itself."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("ray", path=str(BIN)) is None, reason="the ray CLI is not installed")
def test_simulation_on_an_existing_ray_cluster(tmp_path):
    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    common = ["--num-cpus", "1", "--block", "--disable-usage-stats"]
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--port", str(port),
                             "--include-dashboard", "false", "--temp-dir", str(tmp_path / "ray"), *common],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    worker = None
    try:
        time.sleep(8)
        worker = subprocess.Popen([str(BIN / "ray"), "start", "--address", f"127.0.0.1:{port}", *common],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(8)
        results = tmp_path / "results"
        script = (
            "from flwr_jdp.simulation import simulate\n"
            f"simulate('joint-dp', {{'num-owners': 4, 'num-rounds': 2, 'local-epochs': 1, "
            f"'batch-size': 32, 'noise-multiplier': 1.0, 'target-epsilon': 50.0, "
            f"'results-dir': {str(results)!r}, 'resume': False}}, num_supernodes=2, "
            f"ray_address='127.0.0.1:{port}')\n"
            "import ray\n"
            "print('RAY_NODES', len([n for n in ray.nodes() if n['Alive']]))\n"
        )
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads((results / "results.json").read_text())
        assert res["status"] == "completed" and res["rounds_completed"] == 2
    finally:
        for p in (worker, head):
            if p is not None:
                p.terminate()
        for p in (worker, head):
            if p is not None:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
