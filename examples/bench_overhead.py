"""Benchmark: what joint DP costs over plain Flower FedAvg, and DP-SGD over SGD.

1. Flower's Ray simulation, N owners (one per SuperNode), R rounds, the seed CNN
   on Fashion-MNIST (10,000 training records split evenly, <= 8 classes per
   owner): wall seconds per client-round of plain Flower FedAvg (no DP) and of
   joint DP (local DP-SGD on the shared parameters, record unit), in the same run.
2. The cost of one DP-SGD step on the shared parameters (Opacus per-sample
   gradients, clipping, noise; personal head trained plainly) over one ordinary
   SGD step on the same batch.

Every simulation runs in a fresh Python process and the two arms alternate
(``--repeats`` pairs), so that neither pays Ray's first-run costs alone.
Writes results/bench/overhead.json. Usage:

    python examples/bench_overhead.py --data-dir ../shared/data/fashion-mnist \
        --owners 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # research/ is not installed


def simulate(app: str, run_config: dict, owners: int) -> dict:
    """One Flower simulation, one owner per SuperNode; wall seconds by phase."""
    from research.simulation import simulate as run

    return run(app, run_config, num_supernodes=owners)


def dp_step_ratio(data_dir: str, batch: int = 64, steps: int = 60) -> dict:
    """Seconds per DP-SGD step (shared params) / seconds per plain SGD step."""
    from flwr_jdp.data import load_dataset
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import split_parameters
    from flwr_jdp.training.dp_sgd import train_dp_sgd
    from flwr_jdp.training.plain import train_plain

    torch.set_num_threads(1)
    ds = load_dataset("fashion-mnist", data_dir, 0)
    x, y = ds.x_train[: batch * 4], ds.y_train[: batch * 4]
    gen = torch.Generator().manual_seed(0)
    model = SeedCNN(1, 28, 10)
    split = split_parameters(model, r"^fc1\.")
    # plain: `steps` full-batch SGD steps over all parameters on a batch of `batch`
    xb, yb = x[:batch], y[:batch]
    train_plain(model, list(model.parameters()), xb, yb, epochs=3, batch_size=batch, lr=0.01, generator=gen)
    t = time.perf_counter()
    train_plain(model, list(model.parameters()), xb, yb, epochs=steps, batch_size=batch, lr=0.01, generator=gen)
    plain = (time.perf_counter() - t) / steps
    # DP: Poisson sampling with rate 1 on the same `batch` records -> same batch.
    # personal_lr > 0: the personal head takes a plain step on the same batch (coupled);
    # personal_lr = 0: the decoupled release (the default), personal layers frozen.
    dp = {}
    for personal_lr in (0.01, 0.0):
        train_dp_sgd(model, split, xb, yb, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                     sample_rate=1.0, steps=3, lr=0.01, personal_lr=personal_lr, generator=gen)
        t = time.perf_counter()
        train_dp_sgd(model, split, xb, yb, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                     sample_rate=1.0, steps=steps, lr=0.01, personal_lr=personal_lr, generator=gen)
        dp[personal_lr] = (time.perf_counter() - t) / steps
    return {"plain_step_s": plain, "dp_step_s": dp[0.01], "dp_step_ratio": dp[0.01] / plain,
            "dp_step_decoupled_s": dp[0.0], "dp_step_ratio_decoupled": dp[0.0] / plain,
            "batch_size": batch}


def steady_round_seconds(run: dict) -> float:
    """Seconds per round after the first: training plus evaluation messages of
    rounds 2..R (no set-up query, no first contact, no server-side work)."""
    train, evaluate = run["calls"]["train"][1:], run["calls"]["evaluate"][1:]
    return (sum(train) + sum(evaluate)) / max(len(train), 1)


def run_arm(app: str, base: dict, out_dir: Path, owners: int) -> dict:
    """One simulation in a fresh Python process (both arms pay the same cold start)."""
    cmd = [sys.executable, __file__, "--arm", app, "--arm-config", json.dumps(base),
           "--owners", str(owners), "--out", str(out_dir / "overhead.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ARM ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{app} arm failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][4:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion-mnist"))
    parser.add_argument("--owners", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="alternating FedAvg/joint-DP pairs")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench" / "overhead.json"))
    parser.add_argument("--arm", choices=("fedavg", "joint-dp"), help=argparse.SUPPRESS)
    parser.add_argument("--arm-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out).parent

    if args.arm:  # child process: one simulation, one JSON line
        base = json.loads(args.arm_config)
        extra = ({"method": "fedavg"} if args.arm == "fedavg" else
                 {"method": "joint-dp", "privacy-unit": "record", "noise-placement": "local"})
        extra["results-dir"] = str(out_dir / f"tmp-{args.arm}")
        timing = simulate(args.arm, dict(base, **extra), args.owners)
        print("ARM " + json.dumps(timing), flush=True)
        return 0

    step = dp_step_ratio(args.data_dir)
    print(f"DP-SGD step / SGD step: {step['dp_step_ratio']:.2f} (personal head stepped), "
          f"{step['dp_step_ratio_decoupled']:.2f} (decoupled)", flush=True)
    base = {
        "num-owners": args.owners, "num-rounds": args.rounds, "local-epochs": 1, "batch-size": 16,
        "dataset": "fashion-mnist", "data-dir": os.path.abspath(args.data_dir), "max-records": 10000,
        "classes-per-owner": 8, "noise-multiplier": 1.0, "target-epsilon": 1e6, "resume": False,
    }
    runs: dict[str, list[dict]] = {"fedavg": [], "joint-dp": []}
    for rep in range(args.repeats):
        order = ("fedavg", "joint-dp") if rep % 2 == 0 else ("joint-dp", "fedavg")
        for app in order:
            runs[app].append(run_arm(app, base, out_dir, args.owners))
            print(f"repeat {rep + 1} {app}: {runs[app][-1]['seconds']:.1f}s "
                  f"{runs[app][-1]['phases']}", flush=True)
    fedavg_s = statistics.mean(r["seconds"] for r in runs["fedavg"])
    jdp_s = statistics.mean(r["seconds"] for r in runs["joint-dp"])
    client_rounds = args.owners * args.rounds
    steady = {app: statistics.mean(steady_round_seconds(r) for r in runs[app]) for app in runs}
    doc = {
        "fedavg_s_per_client_round": fedavg_s / client_rounds,
        "jointdp_s_per_client_round": jdp_s / client_rounds,
        "ratio": jdp_s / fedavg_s,
        "dp_step_ratio": step["dp_step_ratio"],
        "dp_step_ratio_decoupled": step["dp_step_ratio_decoupled"],
        "steady_ratio": steady["joint-dp"] / steady["fedavg"],
        "steady_round_s": steady,
        "fedavg_wall_s": fedavg_s,
        "jointdp_wall_s": jdp_s,
        "ratio_per_repeat": [j["seconds"] / f["seconds"]
                             for f, j in zip(runs["fedavg"], runs["joint-dp"], strict=False)],
        "runs": runs,
        "dp_step": step,
        "owners": args.owners,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "config": base,
        "notes": "wall seconds of the whole ServerApp (set-up, all rounds, federated evaluation "
                 "every round, checkpoints), mean over repeats; every simulation runs in a fresh "
                 "Python process, FedAvg and joint-DP alternating. Joint-DP includes its set-up "
                 "query and PLD accounting. 'steady_round_s': seconds per round after the "
                 "first (training + evaluation messages of rounds 2..R, mean over rounds and "
                 "repeats), without the set-up query and first-contact costs; 'steady_ratio' "
                 "their ratio. 'runs' splits each run: seconds inside "
                 "Grid.send_and_receive per message type (and per call), 'server_side' the rest",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
        "command": "python " + " ".join(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("fedavg_s_per_client_round", "jointdp_s_per_client_round",
                                          "ratio", "steady_ratio", "dp_step_ratio",
                                          "dp_step_ratio_decoupled")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
