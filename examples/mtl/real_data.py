"""DP-MTL on real data: Fashion-MNIST owners with label skew, against local-only
training, full-DP FedAvg and joint-DP (the foundation) at the same (epsilon, delta).

Setting: N = 10,000 training records split evenly among 256 owners, 8 of 10
classes each (the partition of the joint-DP reproduction, seed 0); each owner's
test split has its classes. Accuracy = mean over owners of the owner's own model
on its own test split. delta = 1e-4, epsilon in {1, 8}.

Privacy unit and trust, the same for every private method here: one owner's whole
data set (owner-level), add/remove neighbouring, a trusted aggregator adding the
noise (central). DP-MTL's ``paper`` calibration row uses the paper's
replace-one unit and Theorem 2's sigma (stricter unit, more noise).

Methods
- ``dp-mtl`` (tight sigma, PLD) and ``dp-mtl-paper`` (Theorem 2's sigma), and
  ``mtl-nonprivate``: Algorithm 1 as a Flower simulation (``simulate("dp-mtl")``),
  softmax regression on 2x2-average-pooled, unit-norm images (1,970 parameters).
  lambda, B, T were chosen on a validation split of each owner's *training*
  records (``--stage tune``: ``real_tuning.csv``, ``real_tuned.json``).
- ``local-only``: the same linear model, each owner alone (no federation; one
  process, as there is nothing to federate).
- ``full-dp``, ``joint-dp``: the foundation's CNN (FC1 personal for joint-DP),
  owner-level DP-FedAvg with central noise, E = 5, T = 20 (the paper's Table 3
  schedule at n = 256), local lr 0.05, update clip 1.0; not tuned.

    python (apps/dp_mtl)/real_data.py --stage tune
    python (apps/dp_mtl)/real_data.py --stage run      # -> results/mtl/real_data.csv, real_data.png
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from pathlib import Path

from flwr_jdp.mtl.algorithm import MTLConfig, local_only, run_single_process
from flwr_jdp.mtl.config import TaskSource

# research/ (the reproductions' code) is not installed: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

OWNERS, DELTA, EPSILONS = 256, 1e-4, (1.0, 8.0)
FIXED = {"local_steps": 10, "lr": 3.0, "finetune_steps": 100, "finetune_lr": 3.0}
GRID = {"lam": (0.01, 0.1), "radius": (5.0, 20.0, 50.0), "rounds": (5, 10)}
COLUMNS = ["method", "model", "unit", "neighbouring", "trust", "epsilon", "delta", "accuracy", "sigma",
           "seconds", "hyperparameters"]


def source(data_dir: str, validation: float) -> TaskSource:
    return TaskSource(dataset="fashion-mnist", data_dir=data_dir, num_tasks=OWNERS, max_records=10_000,
                      classes_per_owner=8, pool=2, validation_fraction=validation)


def tune(args: argparse.Namespace, out: Path) -> None:
    src = source(args.data_dir, 0.2)
    tasks, model = src.tasks(), src.model()
    rows, best = [], {}
    for eps in (*EPSILONS, math.inf):
        for lam, radius, rounds in itertools.product(*GRID.values()):
            cfg = MTLConfig(lam=lam, radius=radius, rounds=rounds, target_epsilon=eps, delta=DELTA,
                            neighbouring="add-remove", **FIXED)
            acc = run_single_process(tasks, model, cfg, noise_seed=0)["final"]["accuracy"]
            rows.append({"epsilon": eps, "lambda": lam, "radius": radius, "rounds": rounds, "val_accuracy": acc})
            print(rows[-1], flush=True)
            if acc > best.get(str(eps), {}).get("val_accuracy", -1):
                best[str(eps)] = rows[-1]
    with (out / "real_tuning.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "real_tuned.json").write_text(json.dumps(best, indent=1))


def mtl_run_config(tuned: dict, eps: float, calibration: str, results_dir: Path, data_dir: str) -> dict:
    rc = {"dataset": "fashion-mnist", "data-dir": data_dir, "num-tasks": OWNERS, "max-records": 10_000,
          "classes-per-owner": 8, "pool": 2, "lambda": tuned["lambda"], "radius": tuned["radius"],
          "rounds": tuned["rounds"], "local-steps": FIXED["local_steps"], "lr": FIXED["lr"],
          "finetune-steps": FIXED["finetune_steps"], "finetune-lr": FIXED["finetune_lr"],
          "target-epsilon": eps, "delta": DELTA, "calibration": calibration,
          "neighbouring": "replace-one" if calibration == "paper" else "add-remove",
          "noise-seed": 0, "resume": False, "results-dir": str(results_dir)}
    return rc


def run(args: argparse.Namespace, out: Path) -> None:
    from research.reproduce_joint_dp import Cell, run_seed
    from research.simulation import simulate

    tuned = json.loads((out / "real_tuned.json").read_text())
    path = out / "real_data.csv"
    done = set()
    if path.is_file() and not args.fresh:
        with path.open() as fh:
            done = {(r["method"], r["epsilon"]) for r in csv.DictReader(fh)}
    else:
        with path.open("w", newline="") as fh:
            csv.DictWriter(fh, fieldnames=COLUMNS).writeheader()
    work = Path(args.work_dir)

    def emit(row: dict) -> None:
        print(row, flush=True)
        with path.open("a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=COLUMNS).writerow(row)

    def mtl(method: str, eps: float, calibration: str) -> None:
        if (method, str(eps)) in done:
            return
        hp = tuned[str(eps)]
        rdir = work / f"{method}-eps{eps}"
        t0 = time.time()
        simulate("dp-mtl", mtl_run_config(hp, eps, calibration, rdir, args.data_dir), num_supernodes=args.supernodes)
        res = json.loads((rdir / "results.json").read_text())
        assert res["status"] == "completed", res["status"]
        emit({"method": method, "model": "softmax-regression (pool 2)", "unit": "owner",
              "neighbouring": "replace-one" if calibration == "paper" else "add-remove", "trust": "central",
              "epsilon": eps, "delta": DELTA, "accuracy": round(res["final"]["accuracy"], 4),
              "sigma": round(res["sigma"], 5), "seconds": round(time.time() - t0, 1),
              "hyperparameters": f"lambda={hp['lambda']} B={hp['radius']} T={hp['rounds']}"})

    mtl("mtl-nonprivate", math.inf, "tight")
    if ("local-only", "inf") not in done:
        src = source(args.data_dir, 0.0)
        hp = tuned["inf"]
        t0 = time.time()
        acc = local_only(src.tasks(), src.model(), MTLConfig(rounds=hp["rounds"], **FIXED))["accuracy"]
        emit({"method": "local-only", "model": "softmax-regression (pool 2)", "unit": "-", "neighbouring": "-",
              "trust": "-", "epsilon": math.inf, "delta": DELTA, "accuracy": round(acc, 4), "sigma": 0,
              "seconds": round(time.time() - t0, 1), "hyperparameters": f"{hp['rounds'] * 10 + 100} steps lr 3"})
    for eps in EPSILONS:
        mtl("dp-mtl", eps, "tight")
        mtl("dp-mtl-paper", eps, "paper")
        for method in ("full-dp", "joint-dp"):
            if (method, str(eps)) in done or args.skip_foundation:
                continue
            cell = Cell(dataset="fashion-mnist", owners=OWNERS, method=method, trust="central", epsilon=eps)
            t0 = time.time()
            res = run_seed(cell, 0, args.data_dir, work / "foundation", supernodes=args.supernodes,
                           extra={"privacy-unit": "owner", "learning-rate": 0.05, "server-learning-rate": 1.0,
                                  "clipping-norm": 1.0, "fraction-train": 1.0})
            emit({"method": method, "model": "seed CNN (GroupNorm)", "unit": "owner", "neighbouring": "add-remove",
                  "trust": "central", "epsilon": eps, "delta": DELTA,
                  "accuracy": round(float(res["final_accuracy"]), 4),
                  "sigma": round(float(res["noise_multiplier"]), 4), "seconds": round(time.time() - t0, 1),
                  "hyperparameters": "E=5 T=20 lr=0.05 clip=1 (sigma column: noise multiplier)"})
    plot(out)


def plot(out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out / "real_data.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['method']}\neps={r['epsilon']}" for r in rows]
    ax.bar(range(len(rows)), [float(r["accuracy"]) for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7)
    ax.set_ylabel("mean owner test accuracy")
    ax.set_title("Fashion-MNIST, 256 owners, label skew: owner-level DP, delta=1e-4")
    fig.tight_layout()
    fig.savefig(out / "real_data.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("tune", "run", "plot"), required=True)
    ap.add_argument("--data-dir", default="../shared/data/fashion-mnist")
    ap.add_argument("--out", default="results/mtl")
    ap.add_argument("--work-dir", default="/tmp/flwr-jdp-mtl-real")
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--skip-foundation", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="start real_data.csv anew")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    {"tune": tune, "run": run, "plot": lambda a, o: plot(o)}[args.stage](args, out)


if __name__ == "__main__":
    main()
