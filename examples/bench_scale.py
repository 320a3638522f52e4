"""Benchmark: joint DP with 1,000 owners in Flower's Ray simulation on one machine.

Runs the project's app (``research/simulation.py``) on Fashion-MNIST, each
configuration in a fresh Python process started in its own session, and samples
the memory of that whole process tree (driver, Ray's GCS/raylet and its workers)
every ``--sample`` seconds from /proc: the sum of RSS (shared pages counted once
per process) and of PSS (shared pages split between the processes that map them).

Configurations:

1. joint DP, record unit, ``--placement`` (local and/or central noise), ``--owners``
   owners on ``--nodes`` SuperNodes (owners hosted ``owners/nodes`` per node),
   ``--rounds`` rounds: seconds per round, peak memory, accuracy, epsilon;
2. the same (first placement) with ``--small-owners`` owners on the same nodes: the
   slope (peak at ``--owners`` - peak at ``--small-owners``) / (owners added) is the
   memory per added owner (records per owner kept equal, so the data grow too);
3. plain Flower FedAvg (``apps/fedavg``, no DP) with ``--owners`` owners,
   one per SuperNode (the only way that app hosts owners), ``--fedavg-rounds``
   rounds: the round-time ratio at the same scale (joint DP's steady round from 1.
   over FedAvg's); with ``--same-layout`` joint DP also runs on ``--owners``
   SuperNodes for those rounds, and the ratio is taken against that run.

Writes results/bench/scale.json and scale.png. Usage (about 20 minutes on 2 cores):

    python examples/bench_scale.py --owners 1000 --nodes 20 --rounds 10 \\
        --placement local central --small-owners 250 --small-rounds 10 --fedavg-rounds 2

(``--small-rounds`` equal to ``--rounds``, so that the slope compares runs of the
same length.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # research/ is not installed
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


# ------------------------------------------------------------------ memory sampling
def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, plus every process of its session (Ray's
    daemons and workers stay in the session even if re-parented)."""
    info = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                info[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    found |= {pid for pid, (_, sid) in info.items() if sid == root}
    return sorted(found)


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of ``pid`` in KB; (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            rss = pss = 0
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
            return rss, pss
    except OSError:
        try:
            with open(f"/proc/{pid}/statm") as fh:
                rss = int(fh.read().split()[1]) * PAGE_KB
            return rss, rss
        except OSError:
            return 0, 0


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    if "bench_scale.py" in cmd:
        return "driver"
    if "ray::" in cmd:
        return "ray worker (" + cmd.split()[0].split("::")[-1] + ")"
    for part in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if part in cmd:
            return "ray " + part
    return os.path.basename(cmd.split()[0]) if cmd else "?"


class TreeSampler(threading.Thread):
    """Sums RSS and PSS over the process tree of ``root`` every ``every`` seconds."""

    def __init__(self, root: int, every: float) -> None:
        super().__init__(daemon=True)
        self.root, self.every = root, every
        self.stop = threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.peak_rss_parts: dict[str, float] = {}
        self.peak_pss_parts: dict[str, float] = {}
        self.trace: list[tuple[float, float, float]] = []  # (s, RSS MB, PSS MB)
        self.t0 = time.time()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = process_tree(self.root)
            mem = {pid: _memory_kb(pid) for pid in pids}
            rss, pss = sum(m[0] for m in mem.values()), sum(m[1] for m in mem.values())
            self.trace.append((round(time.time() - self.t0, 1), round(rss / 1024, 1), round(pss / 1024, 1)))
            for total, attr, idx in ((rss, "rss", 0), (pss, "pss", 1)):
                if total > getattr(self, f"peak_{attr}"):
                    setattr(self, f"peak_{attr}", total)
                    parts: dict[str, float] = {}
                    for pid, m in mem.items():
                        key = _name(pid)
                        parts[key] = round(parts.get(key, 0.0) + m[idx] / 1024, 1)
                    setattr(self, f"peak_{attr}_parts", parts)
            self.stop.wait(self.every)


# ------------------------------------------------------------------ one simulation (child)
def fedavg_main_recording(out: dict):
    """``apps/fedavg``'s ServerApp ``main``, keeping the last round's federated accuracy."""
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from apps.fedavg.fedavg.task import initial_model
    from flwr_jdp.joint_dp.config import parse_config

    def main(grid, context):  # noqa: ANN001, ANN202
        cfg = parse_config(context.run_config)
        model = initial_model(cfg)
        strategy = FedAvg(min_train_nodes=cfg.num_owners, min_evaluate_nodes=cfg.num_owners,
                          min_available_nodes=cfg.num_owners)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                                num_rounds=cfg.num_rounds)
        last = result.evaluate_metrics_clientapp.get(cfg.num_rounds) or {}
        out["accuracy"] = float(last["accuracy"]) if "accuracy" in last else None
    return main


def run_child(spec: dict) -> dict:
    from apps.fedavg.fedavg import server_app as fedavg_server
    from research.simulation import simulate

    extra: dict = {}
    if spec["app"] == "fedavg":
        fedavg_server.main = fedavg_main_recording(extra)  # simulate() reads the attribute
    t = time.time()
    timing = simulate(spec["app"], spec["config"], num_supernodes=spec["nodes"])
    timing["total_wall_s"] = time.time() - t
    if spec["app"] == "joint-dp":
        res = json.loads((Path(spec["config"]["results-dir"]) / "results.json").read_text())
        last = res["history"][-1] if res.get("history") else {}
        extra.update(epsilon=res.get("epsilon"), noise_multiplier=res.get("noise_multiplier"),
                     status=res.get("status"), accuracy=last.get("accuracy"), last_round=last)
    timing.update(extra)
    return timing


# ------------------------------------------------------------------ parent
def launch(name: str, spec: dict, sample: float, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / (name.replace(" ", "-").replace("/", "-") + ".log")
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        sampler = TreeSampler(proc.pid, sample)
        sampler.start()
        out, _ = proc.communicate()
        sampler.stop.set()
        sampler.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("RUN ")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{tail}")
    run = json.loads(lines[-1][4:])
    rounds = spec["config"]["num-rounds"]
    per_round = [a + b for a, b in zip(run["calls"]["train"], run["calls"]["evaluate"])]
    query = run["phases"].get("query", 0.0)
    run.update(
        name=name, app=spec["app"], owners=spec["config"]["num-owners"], nodes=spec["nodes"], rounds=rounds,
        placement=spec["config"].get("noise-placement") if spec["app"] == "joint-dp" else None,
        records_per_owner=spec["config"]["max-records"] // spec["config"]["num-owners"],
        round_s=per_round,
        s_per_round=(run["seconds"] - query) / rounds,
        steady_s_per_round=(sum(per_round[1:]) / (len(per_round) - 1)) if len(per_round) > 1 else per_round[0],
        peak_rss_mb=round(sampler.peak_rss / 1024, 1), peak_pss_mb=round(sampler.peak_pss / 1024, 1),
        peak_rss_by_process=sampler.peak_rss_parts, peak_pss_by_process=sampler.peak_pss_parts,
        memory_trace=sampler.trace[:: max(1, len(sampler.trace) // 400)],
    )
    print(f"{name}: {run['s_per_round']:.1f} s/round (steady {run['steady_s_per_round']:.1f}), "
          f"query {query:.1f} s, peak RSS {run['peak_rss_mb']:.0f} MB, PSS {run['peak_pss_mb']:.0f} MB, "
          f"accuracy {run.get('accuracy')}, epsilon {run.get('epsilon')}", flush=True)
    return run


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in runs:
        ax1.plot([t for t, _, _ in r["memory_trace"]], [p for _, _, p in r["memory_trace"]], label=r["name"])
    ax1.set_xlabel("seconds"), ax1.set_ylabel("PSS of the process tree (MB)")
    ax1.set_title("memory of the whole simulation"), ax1.legend(fontsize=7)
    names = [r["name"] for r in runs]
    ax2.barh(names, [r["steady_s_per_round"] for r in runs], color="tab:blue")
    for i, r in enumerate(runs):
        ax2.text(r["steady_s_per_round"], i, f" {r['steady_s_per_round']:.1f}", va="center", fontsize=7)
    ax2.set_xlabel("seconds per round (rounds 2..R, train + evaluate)")
    ratio, slope = doc["ratio_vs_fedavg"], doc["per_owner_mb"]["pss"]
    ax2.set_title(("" if ratio is None else f"joint DP / FedAvg round = {ratio['value']:.2f}; ")
                  + ("" if slope is None else f"{slope:.2f} MB (PSS) per added owner"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--owners", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=20, help="SuperNodes of the joint-DP runs")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--placement", nargs="+", default=["local", "central"], choices=("local", "central"))
    parser.add_argument("--records-per-owner", type=int, default=50)
    parser.add_argument("--small-owners", type=int, default=250, help="second scale for the slope (0: skip)")
    parser.add_argument("--small-rounds", type=int, default=3)
    parser.add_argument("--fedavg-rounds", type=int, default=2, help="0: skip the FedAvg comparison")
    parser.add_argument("--same-layout", action="store_true",
                        help="also run joint DP with one owner per SuperNode, as FedAvg, for the ratio")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--sample", type=float, default=0.5, help="memory sampling period (s)")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "scale.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print("RUN " + json.dumps(run_child(json.loads(args.child)), default=float), flush=True)
        return 0

    out = Path(args.out)
    tmp = out.parent / "tmp-scale"
    base = {
        "num-rounds": args.rounds, "local-epochs": 1, "batch-size": 16, "dataset": "fashion-mnist",
        "data-dir": os.path.abspath(args.data_dir), "classes-per-owner": 8,
        "target-epsilon": args.target_epsilon, "noise-multiplier": 0.0, "resume": False,
        "privacy-unit": "record",
    }

    def spec(app: str, owners: int, nodes: int, rounds: int, placement: str, tag: str) -> dict:
        cfg = dict(base, **{"num-owners": owners, "num-rounds": rounds,
                            "max-records": owners * args.records_per_owner,
                            "results-dir": str(tmp / tag)})
        cfg.update({"method": "fedavg"} if app == "fedavg" else
                   {"method": "joint-dp", "noise-placement": placement})
        return {"app": app, "config": cfg, "nodes": nodes}

    runs: list[dict] = []
    slope = {"rss": None, "pss": None}
    ratio = None
    pl = args.placement[0]

    def save() -> None:  # after every run, so that a cut-short benchmark keeps what it measured
        write(args, base, runs, slope, ratio, out)

    big = launch(f"joint-dp {pl} {args.owners}o/{args.nodes}n",
                 spec("joint-dp", args.owners, args.nodes, args.rounds, pl, f"jdp-{pl}"), args.sample, tmp)
    runs.append(big)
    save()
    if args.fedavg_rounds:
        fed = launch(f"fedavg {args.owners}o/{args.owners}n",
                     spec("fedavg", args.owners, args.owners, args.fedavg_rounds, pl, "fedavg"), args.sample, tmp)
        runs.append(fed)
        ref = big
        if args.same_layout:
            ref = launch(f"joint-dp {pl} {args.owners}o/{args.owners}n",
                         spec("joint-dp", args.owners, args.owners, args.fedavg_rounds, pl, "jdp-same-layout"),
                         args.sample, tmp)
            runs.append(ref)
        ratio = {"value": ref["steady_s_per_round"] / fed["steady_s_per_round"],
                 "joint_dp_run": ref["name"], "fedavg_run": fed["name"]}
        save()
    if args.small_owners:
        small = launch(f"joint-dp {pl} {args.small_owners}o/{args.nodes}n",
                       spec("joint-dp", args.small_owners, args.nodes, args.small_rounds, pl, "jdp-small"),
                       args.sample, tmp)
        runs.append(small)
        added = args.owners - args.small_owners
        slope = {k: (big[f"peak_{k}_mb"] - small[f"peak_{k}_mb"]) / added for k in ("rss", "pss")}
        save()
    for other in args.placement[1:]:
        runs.append(launch(f"joint-dp {other} {args.owners}o/{args.nodes}n",
                           spec("joint-dp", args.owners, args.nodes, args.rounds, other, f"jdp-{other}"),
                           args.sample, tmp))
        save()
    print(json.dumps(json.loads(out.read_text())["table"], indent=1), json.dumps({"per_owner_mb": slope, "ratio": ratio}))
    return 0


def write(args, base: dict, runs: list[dict], slope: dict, ratio: dict | None, out: Path) -> None:
    import torch
    doc = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "note": "2 cores shared with other jobs; Ray actors: one "
                    "per whole CPU, one torch thread per ClientApp"},
        "table": [{k: r.get(k) for k in ("name", "app", "placement", "owners", "nodes", "rounds",
                                         "records_per_owner", "s_per_round", "steady_s_per_round",
                                         "peak_rss_mb", "peak_pss_mb", "accuracy", "epsilon",
                                         "noise_multiplier")} for r in runs],
        "per_owner_mb": slope,
        "ratio_vs_fedavg": ratio,
        "config": base,
        "notes": "s_per_round: (ServerApp wall seconds - set-up query) / rounds, server-side work "
                 "(aggregation, accounting, checkpoints) included; steady_s_per_round: train + evaluate "
                 "messages of rounds 2..R. Peak memory: the whole process tree of the simulation (driver + "
                 "Ray GCS/raylet + workers) sampled from /proc; RSS counts shared pages once per process, "
                 "PSS splits them. per_owner_mb: (peak at --owners - peak at --small-owners) / owners added, "
                 "same SuperNodes, same records per owner. ratio_vs_fedavg: steady round of joint DP "
                 "(run named there) / plain Flower FedAvg (one owner per SuperNode, the only layout "
                 "apps/fedavg supports).",
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=float))
    try:
        plot(doc, out.with_suffix(".png"))
    except Exception as err:  # noqa: BLE001 - the JSON is what counts
        print(f"plot failed: {err}")


if __name__ == "__main__":
    sys.exit(main())
