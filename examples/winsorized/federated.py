"""Federated training under user-level DP at equal epsilon: the winsorized-mean
wrapper against Flower's own central DP (fixed and adaptive clipping).

Task: Fashion-MNIST, all 60,000 training records split among n = 1,000 users
(m = 60 records each, all 10 classes: users draw from one distribution, the
paper's setting), each user with a share of the test set. Model: softmax regression on 2x2-pooled,
unit-norm images (1,970 parameters), E = 5 local full-batch gradient steps of
size 2 per round, T = 10 rounds, every user every round. Accuracy: Flower's
FedAvg evaluation (mean over users of the global model on their test splits).

Every method is a real Flower strategy (``FedAvg``, and the DP wrappers
``DifferentialPrivacyServerSideFixedClipping``,
``DifferentialPrivacyServerSideAdaptiveClipping`` from ``flwr.serverapp.strategy``,
and :class:`flwr_jdp.strategies.DifferentialPrivacyWinsorizedMean`) driving a real
ClientApp (numpy), over flwr-jdp's in-process Grid (1,000 SuperNodes, one user
each; no Ray, so that 1,000 users fit on 2 cores).

Privacy: user level (a user's whole data), replace-one with n public, delta =
1e-5, T releases composed by PLD. Flower's wrappers add std ``z C / n`` (add/remove
sensitivity ``C / n``); under replace-one that is a Gaussian with multiplier
``z / 2``, so ``z`` is calibrated with the replace-one relation. The adaptive
wrapper's (count, update) pair is equivalent to one Gaussian of multiplier ``z``
(Andrew et al. 2021), accounted the same way. The winsorized wrapper pays for both
of its releases (range 1/4 of the budget in 1/z^2, mean 3/4).

Hyperparameters (clipping norm C = 1.0 for fixed clipping, initial C and target
quantile 0.5 for adaptive, the winsorized bound B = 1.0 and concentration radius
tau) were read off a non-private pilot on a *different* partition (data seed 1,
``--stage pilot`` -> ``federated_pilot.json``), never on the evaluation users.

Columns of ``federated.csv``: ``acc_final`` (round-T accuracy), ``noise_norm``
(L2 distance of the final model from the non-private FedAvg model trained on the
same users: what the noise, and clipping or winsorization, moved it by) and
``ledger_epsilon`` (the epsilon of a replace-one ledger holding the run's releases).

    python examples/winsorized/federated.py --stage pilot
    python examples/winsorized/federated.py --stage run   # -> results/winsorized/federated.csv, .png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import dp_accounting as dpa
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.models.linear import LinearModel
from flwr_jdp.mtl.tasks import label_skew_tasks
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.strategies import DifferentialPrivacyWinsorizedMean
from flwr_jdp.winsorized.estimator import WinsorizedMean

USERS, ROUNDS, STEPS, LR, DELTA, RANGE_SHARE = 1000, 10, 5, 2.0, 1e-5, 0.25
EPSILONS = (2.0, 8.0)


def users(data_dir: str, seed: int):  # noqa: ANN201
    return label_skew_tasks("fashion-mnist", data_dir, USERS, 10, 60_000, seed, 0.0, 2)


def model_of(tasks) -> LinearModel:  # noqa: ANN001
    return LinearModel("softmax", tasks[0].x_train.shape[1], 10, bias=True)


def client_app(tasks) -> ClientApp:  # noqa: ANN001
    """User ``partition-id``: E gradient steps from the global model; uniform weight."""
    model = model_of(tasks)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context):  # noqa: ANN001, ANN202
        task = tasks[int(context.node_config["partition-id"])]
        w = msg.content["arrays"]["w"].numpy().astype(np.float64)
        for _ in range(STEPS):
            w = w - LR * model.loss_grad(w, task.x_train, task.y_train)[1]
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w)}),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context):  # noqa: ANN001, ANN202
        task = tasks[int(context.node_config["partition-id"])]
        w = msg.content["arrays"]["w"].numpy()
        return Message(RecordDict({"metrics": MetricRecord(
            {"num-examples": 1, "accuracy": model.accuracy(w, task.x_test, task.y_test)})}), reply_to=msg)

    return app


def fedavg() -> FedAvg:
    return FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=USERS,
                  min_evaluate_nodes=USERS, min_available_nodes=USERS)


def flower_z(eps: float) -> float:
    """Flower's multiplier: T Gaussians of ``z/2`` (replace-one) reach ``eps``."""
    return calibrate(eps, DELTA, lambda z: dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), ROUNDS),
                     relation="replace-one")


def winsorized(eps: float, bound: float, tau: float) -> WinsorizedMean:
    def event(s: float) -> dpa.DpEvent:
        return dpa.SelfComposedDpEvent(WinsorizedMean(bound, tau, s / math.sqrt(RANGE_SHARE),
                                                      s / math.sqrt(1 - RANGE_SHARE)).event(), ROUNDS)
    s = calibrate(eps, DELTA, event)
    return WinsorizedMean(bound, tau, s / math.sqrt(RANGE_SHARE), s / math.sqrt(1 - RANGE_SHARE))


def train(strategy, tasks, noise_seed: int = 0) -> dict:  # noqa: ANN001
    np.random.seed(noise_seed)  # Flower's wrappers draw from numpy's global generator
    grid = InProcessGrid(client_app(tasks), USERS, {})
    w0 = ArrayRecord({"w": Array(np.zeros(model_of(tasks).num_params))})
    t0 = time.time()
    result = strategy.start(grid=grid, initial_arrays=w0, num_rounds=ROUNDS)
    acc = result.evaluate_metrics_clientapp[ROUNDS]["accuracy"]
    return {"acc_final": float(acc), "seconds": time.time() - t0,
            "accuracy_by_round": [float(result.evaluate_metrics_clientapp[r]["accuracy"])
                                  for r in range(1, ROUNDS + 1)],
            "final": result.arrays["w"].numpy()}


def pilot(args: argparse.Namespace, out: Path) -> None:
    """Update norms and their spread around the mean, per round, on held-out users."""
    tasks = users(args.data_dir, seed=1)
    model = model_of(tasks)
    w = np.zeros(model.num_params)
    rows = []
    for rnd in range(1, ROUNDS + 1):
        ups = []
        for task in tasks:
            v = w.copy()
            for _ in range(STEPS):
                v = v - LR * model.loss_grad(v, task.x_train, task.y_train)[1]
            ups.append(v - w)
        ups = np.stack(ups)
        mean = ups.mean(axis=0)
        norms, spread = np.linalg.norm(ups, axis=1), np.linalg.norm(ups - mean, axis=1)
        rows.append({"round": rnd, "median_norm": float(np.median(norms)), "max_norm": float(norms.max()),
                     "mean_update_norm": float(np.linalg.norm(mean)),
                     "spread_q50": float(np.quantile(spread, 0.5)), "spread_q90": float(np.quantile(spread, 0.9))})
        print(rows[-1], flush=True)
        w = w + mean
    (out / "federated_pilot.json").write_text(json.dumps(rows, indent=1))


def run(args: argparse.Namespace, out: Path) -> None:
    tasks = users(args.data_dir, seed=0)
    pilot_rows = json.loads((out / "federated_pilot.json").read_text())
    clip = float(np.median([r["median_norm"] for r in pilot_rows]))
    tau = float(np.median([r["spread_q90"] for r in pilot_rows]))
    bound = float(max(r["max_norm"] for r in pilot_rows))
    rows = []
    base = train(fedavg(), tasks)
    rows.append({"method": "fedavg (no DP)", "epsilon": math.inf, "acc_final": base["acc_final"],
                 "noise_norm": 0.0, "noise": "-", "seconds": base["seconds"]})
    print(rows[-1], flush=True)
    for eps in EPSILONS:
        z = flower_z(eps)
        runs = {
            "flower fixed clipping": (DifferentialPrivacyServerSideFixedClipping(fedavg(), z, clip, USERS),
                                      f"z={z:.3f} C={clip:.3g}"),
            "flower adaptive clipping": (DifferentialPrivacyServerSideAdaptiveClipping(
                fedavg(), z, USERS, initial_clipping_norm=clip, target_clipped_quantile=0.5),
                f"z={z:.3f} C0={clip:.3g} q=0.5"),
        }
        est = winsorized(eps, bound, tau)
        ledger = PrivacyLedger(delta=DELTA, unit="user")
        runs["winsorized mean"] = (DifferentialPrivacyWinsorizedMean(fedavg(), est, USERS, ledger=ledger,
                                                                     noise_seed=0),
                                   f"z_range={est.range_noise:.3f} z_mean={est.mean_noise:.3f} B={bound:.3g} "
                                   f"tau={tau:.3g}")
        for name, (strategy, noise) in runs.items():
            res = train(strategy, tasks)
            rows.append({"method": name, "epsilon": eps, "acc_final": res["acc_final"],
                         "noise_norm": float(np.linalg.norm(res["final"] - base["final"])),
                         "noise": noise, "seconds": res["seconds"]})
            print(rows[-1], flush=True)
        assert ledger.epsilon() <= eps * (1 + 1e-9)
        rows[-1]["ledger_epsilon"] = ledger.epsilon()
        # Flower's wrappers ran all T rounds: the same releases, in a replace-one ledger
        flower_ledger = PrivacyLedger(delta=DELTA, unit="user", neighbouring="replace-one")
        for rnd in range(1, ROUNDS + 1):
            flower_ledger.record_round(rnd, {SERVER_SCOPE: dpa.GaussianDpEvent(z)})
        assert flower_ledger.epsilon() <= eps * (1 + 1e-9)
        rows[-3]["ledger_epsilon"] = rows[-2]["ledger_epsilon"] = flower_ledger.epsilon()
    with (out / "federated.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["method", "epsilon", "acc_final", "noise_norm", "ledger_epsilon",
                                           "noise", "seconds"])
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.5g}" if isinstance(v, float) else v) for k, v in r.items()})
    plot(out, rows)


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "fedavg (no DP)"]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        pts = [r for r in rows if r["method"] == m]
        ax.bar(np.arange(len(pts)) + i * width, [r["acc_final"] for r in pts], width, label=m)
    ax.axhline(rows[0]["acc_final"], color="k", ls=":", label="FedAvg, no DP")
    ax.set_xticks(np.arange(len(EPSILONS)) + width, [f"epsilon={e:g}" for e in EPSILONS])
    ax.set_ylabel("final accuracy (mean over users)")
    ax.set_title("Fashion-MNIST, 1,000 users x 60 records: user-level DP at equal epsilon (delta=1e-5)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "federated.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("pilot", "run"), required=True)
    ap.add_argument("--data-dir", default="../shared/data/fashion-mnist")
    ap.add_argument("--out", default="results/winsorized")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    {"pilot": pilot, "run": run}[args.stage](args, out)


if __name__ == "__main__":
    main()
