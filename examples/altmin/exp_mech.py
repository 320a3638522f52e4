"""Algorithm 4 (exponential mechanism over a net) vs Priv-AltMin on small problems.

k = 1, n = 2,000 users, m = 10, sigma_F = 0.01. For d in {2, 3, 4} and epsilon in
{0.5, 1, 2}: the exponential mechanism (pure epsilon-DP) and Priv-AltMin
((epsilon, 1e-6)-DP, default Newton step; clip_a = median per-user |A_j|_F on
held-out users), plus non-private AltMin. Also the net size and seconds of the
mechanism per d, and the net size where it stops being feasible.

    python examples/altmin/exp_mech.py   # -> results/altmin/exp_mech.csv, exp_mech_net.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import numpy as np

from flwr_jdp.altmin.algorithm import AltMinConfig, evaluate_users, run_single_process
from flwr_jdp.altmin.exponential import net_size, private_embedding
from flwr_jdp.altmin.problem import ProblemSpec, all_users, true_embedding
from flwr_jdp.altmin.statistics import SampleSplit, user_statistic_norms

NET_PHI = {2: 0.01, 3: 0.05, 4: 0.1}
EPSILONS = (0.5, 1.0, 2.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default="results/altmin")
    args = ap.parse_args()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, net_rows = [], []
    for d, phi in NET_PHI.items():
        spec = ProblemSpec(num_users=2000, dim=d, rank=1, seed=0)
        held = ProblemSpec(num_users=2000, dim=d, rank=1, seed=1)
        held_users = all_users(held)
        clip_a = float(np.median(user_statistic_norms(held_users, true_embedding(held), SampleSplit("full"))[0]))
        users = all_users(spec)
        nonpriv = run_single_process(spec, users, AltMinConfig(epochs=10, target_epsilon=math.inf),
                                     np.random.default_rng(0))
        for eps in EPSILONS:
            rng = np.random.default_rng(0)
            t = time.time()
            u_em = private_embedding(users, eps, phi, zeta=3.0, clip_feature=3.0, bound_v=3.0, rng=rng)
            em_seconds = time.time() - t
            em_mse = float(np.mean(evaluate_users(users, u_em, spec, SampleSplit("paper"))))
            alt = run_single_process(spec, users, AltMinConfig(epochs=3, target_epsilon=eps, clip_a=clip_a),
                                     np.random.default_rng(0))
            for method, mse, eps_delta in (("exp-mech", em_mse, f"({eps}, 0)"),
                                           ("priv-altmin", alt.mse, f"({eps}, 1e-6)"),
                                           ("nonprivate-altmin", nonpriv.mse, "none")):
                rows.append({"dim": d, "rank": 1, "num_users": spec.num_users, "epsilon": eps,
                             "method": method, "privacy": eps_delta, "mse": mse})
                print(rows[-1], flush=True)
        net_rows.append({"dim": d, "phi": phi, "net_points": net_size(d, phi),
                         "seconds": round(em_seconds, 2), "feasible": True})
    for d, phi in ((5, 0.1), (6, 0.1), (6, 0.2), (10, 0.2)):
        net_rows.append({"dim": d, "phi": phi, "net_points": net_size(d, phi), "seconds": "",
                         "feasible": net_size(d, phi) <= 2_000_000})
    for name, data in (("exp_mech.csv", rows), ("exp_mech_net.csv", net_rows)):
        with open(out / name, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)


if __name__ == "__main__":
    main()
