"""DP-MTL on synthetic convex tasks: excess loss vs epsilon, vs T and vs m, and
the noise of the paper's calibration (Theorem 2) against the tight one (PLD).

Setting (where Theorem 3 applies): ``m`` linear-regression tasks in ``d = 20``
dimensions, ``w_k* = w_bar + 0.3 g_k / sqrt(d)``, 50 records per task, label
noise 0.5; ``lambda = 1`` (the MAP weight of this generative model:
``noise^2 d / (n spread^2) = 1.1``, fixed a priori, not tuned), ``B = 2``,
``E = 1`` local step of size 0.1, 50 fine-tuning steps of size 0.2, delta = 1e-5,
task level replace-one, every task every round. The error is the mean excess
population loss of the personalized models, ``||w_k - w_k*||^2 / 2`` (exact for
``x ~ N(0, I)``), averaged over ``--seeds`` noise seeds (one row per run).

    python (apps/dp_mtl)/trends.py            # all sweeps -> results/mtl/
    python (apps/dp_mtl)/trends.py --quick    # one seed, fewer points

Writes ``excess_vs_epsilon.csv``, ``excess_vs_rounds.csv``,
``excess_vs_tasks.csv`` (columns ``sweep,calibration,num_tasks,rounds,epsilon,
seed,sigma,error,error_nonprivate,error_local_only``), ``sigma.json``,
``sigma.csv``, ``trends_summary.json`` and ``trends.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import numpy as np

from flwr_jdp.mtl.algorithm import MTLConfig, local_only, run_single_process
from flwr_jdp.mtl.noise import paper_sigma, tight_sigma
from flwr_jdp.mtl.tasks import SyntheticSpec, synthetic_tasks

BASE = {"num_tasks": 500, "rounds": 10, "epsilon": 1.0}
COLUMNS = ["sweep", "calibration", "num_tasks", "rounds", "epsilon", "seed", "sigma", "error",
           "error_nonprivate", "error_local_only"]


def config(rounds: int, eps: float, calibration: str) -> MTLConfig:
    return MTLConfig(lam=1.0, radius=2.0, rounds=rounds, local_steps=1, lr=0.1, finetune_steps=50,
                     finetune_lr=0.2, target_epsilon=eps, delta=1e-5, calibration=calibration)


def tasks_for(m: int):  # noqa: ANN201
    spec = SyntheticSpec(num_tasks=m, samples_per_task=50, dim=20, spread=0.3, noise=0.5, seed=0)
    return synthetic_tasks(spec), spec.model()


def run_point(sweep: str, m: int, rounds: int, eps: float, seeds: int, cache: dict) -> list[dict]:
    tasks, model = tasks_for(m)
    key = (m, rounds)
    if key not in cache:  # non-private and local-only references for this (m, T)
        cache[key] = (run_single_process(tasks, model, config(rounds, math.inf, "tight"), 0)["final"]["excess"],
                      local_only(tasks, model, config(rounds, math.inf, "tight"))["excess"])
    nonprivate, local = cache[key]
    rows = []
    for calibration in ("tight", "paper"):
        for seed in range(seeds):
            out = run_single_process(tasks, model, config(rounds, eps, calibration), noise_seed=seed)
            rows.append({"sweep": sweep, "calibration": calibration, "num_tasks": m, "rounds": rounds,
                         "epsilon": eps, "seed": seed, "sigma": out["sigma"],
                         "error": out["final"]["excess"], "error_nonprivate": nonprivate,
                         "error_local_only": local})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def means(rows: list[dict], key: str, calibration: str) -> tuple[list[float], list[float]]:
    xs = sorted({r[key] for r in rows if r["calibration"] == calibration})
    return xs, [float(np.mean([r["error"] for r in rows if r["calibration"] == calibration and r[key] == x]))
                for x in xs]


def slope(xs: list[float], ys: list[float]) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/mtl")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = 1 if args.quick else args.seeds
    epsilons = [1.0, 4.0] if args.quick else [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    rounds = [2, 8, 32] if args.quick else [1, 2, 4, 8, 12, 16, 24, 32, 64]
    tasks = [100, 500] if args.quick else [100, 200, 500, 1000, 2000, 5000]
    cache: dict = {}
    t0 = time.time()

    # sigma: paper vs tight at the benchmark setting, and across epsilon and T
    m, T, eps, delta, B = BASE["num_tasks"], BASE["rounds"], BASE["epsilon"], 1e-5, 2.0
    ps, ts = paper_sigma(eps, delta, B, T, m), tight_sigma(eps, delta, B, T, m)
    (out / "sigma.json").write_text(json.dumps({
        "paper_sigma": ps, "tight_sigma": ts, "ratio": ps / ts,
        "setting": {"num_tasks": m, "rounds": T, "epsilon": eps, "delta": delta, "radius": B,
                    "dim": 20, "fraction_train": 1.0, "neighbouring": "replace-one",
                    "sensitivity_of_mean": 2 * B / m, "accountant": "pld"}}, indent=1))
    with (out / "sigma.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["num_tasks", "rounds", "epsilon", "paper_sigma", "tight_sigma", "ratio"])
        for e in [0.5, 1.0, 2.0, 4.0, 8.0]:
            for r in [1, 10, 100]:
                p, t = paper_sigma(e, delta, B, r, m), tight_sigma(e, delta, B, r, m)
                w.writerow([m, r, e, f"{p:.6g}", f"{t:.6g}", f"{p / t:.4f}"])
    print(f"sigma at m={m}, T={T}, eps={eps}: paper {ps:.4g}, tight {ts:.4g}, ratio {ps / ts:.3f}")

    by_eps = [r for e in epsilons for r in run_point("epsilon", m, T, e, seeds, cache)]
    write(out / "excess_vs_epsilon.csv", by_eps)
    by_t = [r for t in rounds for r in run_point("rounds", m, t, eps, seeds, cache)]
    write(out / "excess_vs_rounds.csv", by_t)
    by_m = [r for mm in tasks for r in run_point("tasks", mm, T, eps, seeds, cache)]
    write(out / "excess_vs_tasks.csv", by_m)

    summary = {"setting": BASE, "seeds": seeds, "seconds": time.time() - t0}
    for cal in ("tight", "paper"):
        xs, ys = means(by_t, "rounds", cal)
        summary[f"best_rounds_{cal}"] = xs[int(np.argmin(ys))]
        summary[f"excess_by_rounds_{cal}"] = dict(zip(map(int, xs), ys))
        xs, ys = means(by_m, "num_tasks", cal)
        nonpriv = [next(r["error_nonprivate"] for r in by_m if r["num_tasks"] == x) for x in xs]
        cost = [max(y - n, 1e-12) for y, n in zip(ys, nonpriv)]
        summary[f"privacy_cost_by_tasks_{cal}"] = dict(zip(map(int, xs), cost))
        summary[f"privacy_cost_slope_vs_tasks_{cal}"] = slope(xs, cost)
        xs, ys = means(by_eps, "epsilon", cal)
        nonpriv = by_eps[0]["error_nonprivate"]
        cost = [max(y - nonpriv, 1e-12) for y in ys]
        summary[f"excess_by_epsilon_{cal}"] = dict(zip(map(str, xs), ys))
        summary[f"privacy_cost_slope_vs_epsilon_{cal}"] = slope(xs, cost)
    summary["error_nonprivate_benchmark"] = by_eps[0]["error_nonprivate"]
    summary["error_local_only_benchmark"] = by_eps[0]["error_local_only"]
    (out / "trends_summary.json").write_text(json.dumps(summary, indent=1))
    plot(out, by_eps, by_t, by_m)
    print(json.dumps(summary, indent=1))


def plot(out: Path, by_eps: list[dict], by_t: list[dict], by_m: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, rows, key, label in ((axes[0], by_eps, "epsilon", "epsilon (T=10, m=500)"),
                                 (axes[1], by_t, "rounds", "rounds T (epsilon=1, m=500)"),
                                 (axes[2], by_m, "num_tasks", "tasks m (epsilon=1, T=10)")):
        for cal, style in (("tight", "o-"), ("paper", "s--")):
            xs, ys = means(rows, key, cal)
            ax.plot(xs, ys, style, label=f"DP-MTL, {cal} sigma")
        xs = sorted({r[key] for r in rows})
        ax.plot(xs, [next(r["error_nonprivate"] for r in rows if r[key] == x) for x in xs], "k:",
                label="non-private MTL")
        ax.plot(xs, [next(r["error_local_only"] for r in rows if r[key] == x) for x in xs], "g-.",
                label="local only")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("excess population loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("DP mean-regularized MTL, synthetic linear regression (task-level JDP, delta=1e-5)")
    fig.tight_layout()
    fig.savefig(out / "trends.png", dpi=120)


if __name__ == "__main__":
    main()
