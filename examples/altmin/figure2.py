"""Figure 2 of the model-personalization paper: population MSE vs epsilon.

n = 50,000 users, m = 10 samples each, d = 50, k = 2, sigma_F = 0.01,
delta = 1e-6, epsilon in {1, 2, 5, 10}. Methods: ``priv-altmin-newton``
(flwr-jdp's Newton step), ``priv-altmin-ssp`` (the paper's Algorithm 2
sufficient-statistics step), ``priv-altmin`` (whichever of the two configurations
did best on the held-out users at that epsilon), ``nonprivate-altmin``,
``own-data``, ``single-model``.

Two stages:
- ``--stage tune``: on a *held-out population* (``data-seed = 1``: other users and
  another true embedding) pick, per epsilon, the epochs and clipping schedule
  with the lowest MSE from a small grid (per step, and over both for
  ``priv-altmin``); writes ``tuned.json`` and ``tuning.csv``.
  The evaluation population (``data-seed = 0``) is never looked at.
- ``--stage figure``: run every method on the evaluation population with the
  tuned settings; writes ``figure2.csv`` (``method,epsilon,zcdp,mse`` plus
  extras) and ``figure2.png``; with ``--flower`` it also runs ``priv-altmin`` at
  epsilon = 5 as a Flower simulation (``--supernodes`` SuperNodes hosting the
  users) with the same noise seed and records both MSEs in ``flower_run.json``.

    python examples/altmin/figure2.py --stage tune
    python examples/altmin/figure2.py --stage figure --flower
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from flwr_jdp.altmin.algorithm import AltMinConfig, run_single_process
from flwr_jdp.altmin.baselines import own_data_mse, single_model_mse
from flwr_jdp.altmin.problem import ProblemSpec, all_users, true_embedding
from flwr_jdp.altmin.statistics import SampleSplit, user_statistic_norms

# research/ (the reproductions' code) is not installed: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EPSILONS = (1.0, 2.0, 5.0, 10.0)
DELTA = 1e-6
NEWTON_GRID = [dict(epochs=e, clip_g=g, clip_decay=r) for e, (g, r) in
               itertools.product((3, 5), ((5.0, 0.5), (10.0, 0.4), (5.0, 0.3)))]
SSP_GRID = [dict(epochs=e, u_step="statistics", a_share=0.9) for e in (1, 2)]


def clip_a_from(users, spec) -> float:  # noqa: ANN001
    """Median per-user |A_j|_F at the true embedding of the *tuning* population."""
    norm_a, _ = user_statistic_norms(users, true_embedding(spec), SampleSplit("full"))
    return float(np.median(norm_a))


def tune(out: Path) -> None:
    spec = ProblemSpec(seed=1)
    users = all_users(spec)
    clip_a = round(clip_a_from(users, spec), 1)
    rows = []
    for eps in EPSILONS:
        for grid, name in ((NEWTON_GRID, "priv-altmin-newton"), (SSP_GRID, "priv-altmin-ssp")):
            for params in grid:
                cfg = AltMinConfig(target_epsilon=eps, delta=DELTA, clip_a=clip_a, **params)
                t = time.time()
                res = run_single_process(spec, users, cfg, np.random.default_rng(1))
                rows.append({"method": name, "epsilon": eps, **params, "clip_a": clip_a,
                             "mse": res.mse, "seconds": round(time.time() - t, 1)})
                print(rows[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "tuning.csv", "w", newline="") as fh:
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "method", k))
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    choose(out)


PARAM_KEYS = ("epochs", "u_step", "clip_g", "clip_decay", "a_share", "clip_a")


def choose(out: Path) -> None:
    """Per epsilon, the lowest held-out MSE per step and over both (``tuned.json``)."""
    best: dict[str, dict] = {}
    with open(out / "tuning.csv") as fh:
        for row in csv.DictReader(fh):
            mse, eps = float(row["mse"]), float(row["epsilon"])
            params = {}
            for k in PARAM_KEYS:
                if row.get(k, "") != "":
                    params[k] = row[k] if k == "u_step" else (int(row[k]) if k == "epochs" else float(row[k]))
            for key in (f"{row['method']}@{eps:g}", f"priv-altmin@{eps:g}"):
                if key not in best or mse < best[key]["mse"]:
                    best[key] = {"mse": mse, "params": params}
    (out / "tuned.json").write_text(json.dumps(
        {"population": asdict(ProblemSpec(seed=1)), "note": "chosen on held-out users (data-seed 1)",
         "choices": {k: v["params"] for k, v in sorted(best.items())},
         "heldout_mse": {k: v["mse"] for k, v in sorted(best.items())}}, indent=1))


def figure(out: Path, flower: bool, supernodes: int, noise_seed: int) -> None:
    tuned = json.loads((out / "tuned.json").read_text())["choices"]
    spec = ProblemSpec(seed=0)
    users = all_users(spec)
    rows = []
    t_all = time.time()

    def add(method, eps, zcdp, mse, **extra):  # noqa: ANN001, ANN202
        rows.append({"method": method, "epsilon": eps, "zcdp": zcdp, "mse": mse, **extra})
        print(rows[-1], flush=True)

    t = time.time()
    res = run_single_process(spec, users, AltMinConfig(epochs=10, target_epsilon=math.inf),
                             np.random.default_rng(noise_seed))
    for eps in EPSILONS:
        add("nonprivate-altmin", eps, math.inf, res.mse, seconds=round(time.time() - t, 1))
    own = own_data_mse(users, spec)
    for eps in EPSILONS:
        add("own-data", eps, 0.0, own)
    for eps in EPSILONS:
        for name in ("priv-altmin", "priv-altmin-newton", "priv-altmin-ssp"):
            params = tuned[f"{name}@{eps:g}"]
            cfg = AltMinConfig(target_epsilon=eps, delta=DELTA, **params)
            t = time.time()
            r = run_single_process(spec, users, cfg, np.random.default_rng(noise_seed))
            add(name, eps, r.zcdp, r.mse, noise_multiplier=r.noise_multiplier, epsilon_spent=r.epsilon,
                subspace_distance=r.subspace_distance, seconds=round(time.time() - t, 1),
                params=json.dumps(params))
        mse, z = single_model_mse(users, spec, eps, DELTA, clip_a=170.0, clip_b=30.0,
                                  rng=np.random.default_rng(noise_seed))
        add("single-model", eps, 1.0 / (2 * (z / math.sqrt(2)) ** 2), mse, noise_multiplier=z)
    seconds = time.time() - t_all
    with open(out / "figure2.csv", "w", newline="") as fh:
        keys = ["method", "epsilon", "zcdp", "mse", "noise_multiplier", "epsilon_spent",
                "subspace_distance", "seconds", "params"]
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    summary = {"seconds_in_process": round(seconds, 1), "problem": asdict(spec), "delta": DELTA}
    if flower:
        summary["flower"] = flower_run(out, spec, tuned, supernodes, noise_seed, users)
    (out / "figure2_summary.json").write_text(json.dumps(summary, indent=1))
    plot(out, rows)


def flower_run(out: Path, spec: ProblemSpec, tuned: dict, supernodes: int, noise_seed: int, users) -> dict:  # noqa: ANN001
    from research.simulation import simulate

    params = tuned["priv-altmin@5"]
    cfg = AltMinConfig(target_epsilon=5.0, delta=DELTA, **params)
    rc = {"target-epsilon": 5.0, "delta": DELTA, "noise-seed": noise_seed,
          "results-dir": str(out / "flower_run"), **{k.replace("_", "-"): v for k, v in params.items()}}
    t = time.time()
    timing = simulate("priv-altmin", rc, num_supernodes=supernodes)
    wall = time.time() - t
    got = json.loads((out / "flower_run" / "results.json").read_text())
    ref = run_single_process(spec, users, replace(cfg), np.random.default_rng(noise_seed))
    return {"supernodes": supernodes, "users_per_supernode": spec.num_users // supernodes,
            "flower_mse": got["final_mse"], "single_process_mse": ref.mse,
            "flower_epsilon": got["epsilon"], "wall_seconds": round(wall, 1),
            "serverapp_seconds": round(timing["seconds"], 1)}


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    styles = {"priv-altmin": "o-", "priv-altmin-newton": "x:", "priv-altmin-ssp": "s:", "nonprivate-altmin": "--",
              "own-data": ":", "single-model": "^-"}
    for method, style in styles.items():
        pts = sorted((r["epsilon"], r["mse"]) for r in rows if r["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user epsilon (delta = 1e-6)")
    ax.set_ylabel("population excess MSE")
    ax.set_title("n=50,000, m=10, d=50, k=2")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "figure2.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=("tune", "choose", "figure", "all"), default="all")
    ap.add_argument("--results-dir", default="results/altmin")
    ap.add_argument("--flower", action="store_true", help="also run epsilon=5 as a Flower simulation")
    ap.add_argument("--supernodes", type=int, default=50)
    ap.add_argument("--noise-seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.results_dir)
    if args.stage in ("tune", "all"):
        tune(out)
    if args.stage == "choose":
        choose(out)
    if args.stage in ("figure", "all"):
        figure(out, args.flower, args.supernodes, args.noise_seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
