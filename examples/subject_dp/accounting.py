"""Accounting only (no training): the noise multiplier each accounting mode needs on
the real subject-to-silo map (FEMNIST writers, or with ``--dataset shakespeare``
Tiny Shakespeare characters), and the exact subject-level epsilon that noise gives
at the rounds each mode trains.

    python examples/subject_dp/accounting.py --data-dir ../shared/data/femnist --alpha 1
    python examples/subject_dp/accounting.py --alpha 2 4 8 16 --modes scaled-steps/subject
    python examples/subject_dp/accounting.py --dataset shakespeare \
        --data-dir ../shared/data/tinyshakespeare --modes

Writes ``results/subject_dp/subject_map.csv`` (how writers sit on the silos per
alpha) and ``results/subject_dp/accounting.csv`` (one row per alpha and mode; rows of the
same alpha and mode are replaced); Shakespeare files are prefixed ``shakespeare_``.
Every plan here is on the real, reported counts (``max-records-per-subject = 0``, the
paper's setting), as the committed results were computed. Modes: ``exact``, ``scaled-steps`` and
``sqrt-rounds`` with subject inclusion rates (this project), and ``sqrt-rounds`` /
``scaled-steps`` with the paper's record rate (``inclusion = record``).

``--group-noise`` also writes ``local_group_noise.csv``: LocalGroupDP's ``sigma_Z`` for
every group size ``Z`` up to the most records of one writer at one silo (its
``scaled-steps`` budget, at the smallest silo rate: each silo calibrates at its own rate
and ``sigma_Z`` grows with it), ``sigma_Z / Z`` (its noise per unit of the
sensitivity ``Z C`` of a subject with ``Z`` records in the batch), and the exact
subject-level epsilon of a Gaussian sum at the smallest of those ratios: what our
accountant certifies for LocalGroupDP's noise when its data-dependent ``Z`` is ignored.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import SubjectDPConfig
from flwr_jdp.subject.group_privacy import noise_per_subject_sensitivity
from flwr_jdp.subject.plan import make_plan, sample_rates

# research/ (the reproductions' code) is not installed: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.results_csv import write_csv  # noqa: E402

MODES = {f"{a}/{i}": (a, i) for a, i in [("exact", "subject"), ("scaled-steps", "subject"),
                                         ("sqrt-rounds", "subject"), ("scaled-steps", "record"),
                                         ("sqrt-rounds", "record")]}
FIELDS = ["alpha", "accounting", "inclusion", "rounds", "noise_multiplier", "epsilon",
          "epsilon_sfold", "epsilon_claimed", "seconds"]


def map_row(alpha: float, data_dir: str, dataset: str = "femnist") -> dict:
    """How the writers sit on the silos at ``alpha`` (batch 256): silos per writer,
    records per (writer, silo), the largest record sampling rate and the mean
    per-batch inclusion rate ``1 - (1 - q)^k`` of a writer at a silo."""
    cfg = SubjectDPConfig(alpha=alpha, data_dir=data_dir, dataset=dataset, max_records_per_subject=0)
    counts = sd.all_counts(cfg)
    ds, validation, _ = sd.dataset(cfg)
    y_test = np.asarray(ds.y_test).ravel()
    rates = np.asarray(sample_rates(counts.sum(axis=0), cfg.batch_size))
    held = counts > 0
    inclusion = 1.0 - (1.0 - rates[None, :]) ** counts
    return {"alpha": alpha, "writers": counts.shape[0], "silos_per_writer_mean": round(held.sum(1).mean(), 2),
            "records_per_writer_silo_mean": round(counts[held].mean(), 2),
            "records_at_one_silo_max": int(counts.max()), "record_rate_max": round(rates.max(), 4),
            "inclusion_rate_mean": round(inclusion[held].mean(), 4),
            "records_per_writer_median": float(np.median(counts.sum(1))),
            "test_majority_share": round(float(np.bincount(y_test).max() / len(y_test)), 4),
            "records_train": len(ds.y_train), "records_validation": len(validation[1]),
            "records_test": len(ds.y_test)}


def write_map(path: Path, alphas: list[float], data_dir: str, dataset: str = "femnist") -> None:
    rows = [r for r in csv.DictReader(path.open()) if float(r["alpha"]) not in alphas] if path.is_file() else []
    rows += [map_row(a, data_dir, dataset) for a in alphas]
    rows.sort(key=lambda r: float(r["alpha"]))
    write_csv(path, rows)


def group_noise_rows(alpha: float, data_dir: str, dataset: str = "femnist") -> list[dict]:
    """LocalGroupDP's noise per unit of subject sensitivity at ``alpha`` (one row per
    group size), each with the epsilon bound at the smallest ratio (same on every row)."""
    cfg = SubjectDPConfig(method="local-group-dp", accounting="scaled-steps", alpha=alpha,
                          data_dir=data_dir, dataset=dataset, max_records_per_subject=0)
    counts = sd.all_counts(cfg)
    plan = make_plan(cfg, counts)
    # each silo calibrates sigma_Z at its own rate, and sigma_Z grows with the rate, so the
    # smallest noise per unit of sensitivity over the silos is at the smallest rate
    q = min(plan.sample_rates)
    ratios = noise_per_subject_sensitivity(cfg.target_epsilon, cfg.delta, q, plan.calibration_steps,
                                           int(counts.max()))
    z_min = min(r for _, _, r in ratios)
    exact = SubjectDPConfig(method="higradavg-dp", accounting="exact", alpha=alpha, data_dir=data_dir,
                            dataset=dataset, noise_multiplier=z_min, max_records_per_subject=0)
    bound = make_plan(exact, counts)
    return [{"alpha": alpha, "group_size": g, "sigma_z": round(s, 4), "sigma_z_per_group_size": round(r, 4),
             "sample_rate": round(q, 6), "calibration_steps": plan.calibration_steps,
             "epsilon_claimed": cfg.target_epsilon, "epsilon_exact_at_min_ratio": round(bound.epsilon, 4),
             "rounds": bound.rounds} for g, s, r in ratios]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data/femnist")
    ap.add_argument("--alpha", type=float, nargs="+", default=[1.0])
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                    help="accounting/inclusion pairs to compute (none: only the subject map)")
    ap.add_argument("--dataset", choices=["femnist", "shakespeare"], default="femnist")
    ap.add_argument("--results", default="results/subject_dp")
    ap.add_argument("--group-noise", action="store_true",
                    help="also write local_group_noise.csv (LocalGroupDP's sigma_Z / Z and its epsilon bound)")
    args = ap.parse_args()
    prefix = "" if args.dataset == "femnist" else f"{args.dataset}_"
    out = Path(args.results) / f"{prefix}accounting.csv"
    rows = []
    if out.is_file():
        rows = [r for r in csv.DictReader(out.open())
                if (float(r["alpha"]), f"{r['accounting']}/{r['inclusion']}") not in
                {(a, m) for a in args.alpha for m in args.modes}]
    write_map(out.parent / f"{prefix}subject_map.csv", args.alpha, args.data_dir, args.dataset)
    for alpha in args.alpha:
        for accounting, inclusion in (MODES[m] for m in args.modes):
            cfg = SubjectDPConfig(method="higradavg-dp", accounting=accounting, inclusion=inclusion,
                                  alpha=alpha, data_dir=args.data_dir, dataset=args.dataset,
                                  max_records_per_subject=0)
            t = time.time()
            plan = make_plan(cfg, sd.all_counts(cfg))
            row = {"alpha": alpha, "accounting": accounting, "inclusion": inclusion, "rounds": plan.rounds,
                   "noise_multiplier": round(plan.noise_multiplier, 4), "epsilon": round(plan.epsilon, 4),
                   "epsilon_sfold": round(plan.epsilon_sfold, 4), "epsilon_claimed": plan.epsilon_claimed,
                   "seconds": round(time.time() - t, 1)}
            print(row, flush=True)
            rows.append(row)
    if rows:
        write_csv(out, [{k: r[k] for k in FIELDS} for r in rows])
    if args.group_noise:
        path = out.parent / f"{prefix}local_group_noise.csv"
        kept = [r for r in csv.DictReader(path.open()) if float(r["alpha"]) not in args.alpha] if path.is_file() else []
        new = [r for a in args.alpha for r in group_noise_rows(a, args.data_dir, args.dataset)]
        for r in new:
            print(r, flush=True)
        write_csv(path, sorted(kept + new, key=lambda r: (float(r["alpha"]), int(r["group_size"]))))


if __name__ == "__main__":
    main()
