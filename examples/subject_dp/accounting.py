"""Accounting only (no training): the noise multiplier each accounting mode needs on
the real FEMNIST subject-to-silo map, and the exact subject-level epsilon that
noise gives at the rounds each mode trains.

    python examples/subject_dp/accounting.py --data-dir ../shared/data/femnist --alpha 1
    python examples/subject_dp/accounting.py --alpha 2 4 8 16 --modes scaled-steps/subject

Writes ``results/subject_dp/accounting.csv`` (one row per alpha and mode; rows of the
same alpha and mode are replaced). Modes: ``exact``, ``scaled-steps`` and
``sqrt-rounds`` with subject inclusion rates (this project), and ``sqrt-rounds`` /
``scaled-steps`` with the paper's record rate (``inclusion = record``).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import SubjectDPConfig
from flwr_jdp.subject.plan import make_plan

MODES = {f"{a}/{i}": (a, i) for a, i in [("exact", "subject"), ("scaled-steps", "subject"),
                                         ("sqrt-rounds", "subject"), ("scaled-steps", "record"),
                                         ("sqrt-rounds", "record")]}
FIELDS = ["alpha", "accounting", "inclusion", "rounds", "noise_multiplier", "epsilon",
          "epsilon_sfold", "epsilon_claimed", "seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data/femnist")
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="accounting/inclusion pairs to compute")
    ap.add_argument("--results", default="results/subject_dp/accounting.csv")
    args = ap.parse_args()
    out = Path(args.results)
    rows = []
    if out.is_file():
        rows = [r for r in csv.DictReader(out.open())
                if (float(r["alpha"]), f"{r['accounting']}/{r['inclusion']}") not in
                {(a, m) for a in args.alpha for m in args.modes}]
    for alpha in args.alpha:
        for accounting, inclusion in (MODES[m] for m in args.modes):
            cfg = SubjectDPConfig(method="higradavg-dp", accounting=accounting, inclusion=inclusion,
                                  alpha=alpha, data_dir=args.data_dir)
            t = time.time()
            plan = make_plan(cfg, sd.all_counts(cfg))
            row = {"alpha": alpha, "accounting": accounting, "inclusion": inclusion, "rounds": plan.rounds,
                   "noise_multiplier": round(plan.noise_multiplier, 4), "epsilon": round(plan.epsilon, 4),
                   "epsilon_sfold": round(plan.epsilon_sfold, 4), "epsilon_claimed": plan.epsilon_claimed,
                   "seconds": round(time.time() - t, 1)}
            print(row, flush=True)
            rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
