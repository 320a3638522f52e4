"""How HiGradAvgDP's subject-level noise scales with the number of writers
(accounting only, no training).

The FEMNIST slice here has 300 writers; the paper's has 3,500. This script asks
what the same budget (epsilon 4, delta 1e-5, 100 rounds of 2 batches of 256 per
silo, 16 silos) costs at other writer counts, with the same per-writer layout:
the real writer-by-silo record counts (alpha = 1) are resampled with replacement
to ``N`` writers, so each silo holds about ``N / 300`` times as many records and a
batch of 256 samples each writer at a lower rate.

For each ``N`` it calibrates ``z`` under the exact subject-level accounting of the
reported counts (``max-records-per-subject = 0``; the same
:func:`~flwr_jdp.subject.plan.make_plan` a training run uses) and reports,
for one batch of one silo (C = 1, expected batch size B = 256):

- ``subjects_per_batch``: expected number of distinct writers in the batch (the sum
  of their inclusion rates ``1 - (1 - q)^k``);
- ``noise_norm``: norm of the noise on the averaged gradient, about
  ``z C sqrt(d) / B`` (``d`` = parameters of the LEAF CNN; the noise is
  ``N(0, (z C)^2 I) / B`` as in :mod:`flwr_jdp.training.subject_level`);
- ``signal_bound``: the largest possible norm of the averaged clipped gradient,
  ``subjects_per_batch * C / B`` (each writer contributes at most ``C``);
- ``signal_to_noise``: their ratio, an upper bound on the per-step signal-to-noise
  ratio. Training accuracy is not computed here;
- ``local_item_dp_noise_multiplier`` / ``local_item_dp_epsilon``: LocalItemDP's record-level
  ``z`` for the same budget on the same counts (its record rate falls as the silos grow).

``noise_matched.py`` trains on the real 300 writers at these noise multipliers.

    python examples/subject_dp/scale.py --data-dir ../shared/data/femnist \
        --writers 300 1000 3500

Writes ``results/subject_dp/scale.csv``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from flwr_jdp.privacy.horizontal import subject_inclusion_rate
from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import SubjectDPConfig
from flwr_jdp.subject.plan import make_plan
from flwr_jdp.subject.task import build_subject_model

# research/ (the reproductions' code) is not installed: import it from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.results_csv import write_csv  # noqa: E402

FIELDS = ["writers", "records_per_silo_mean", "record_rate_max", "inclusion_rate_mean",
          "noise_multiplier", "epsilon", "epsilon_sfold", "subjects_per_batch", "noise_norm",
          "signal_bound", "signal_to_noise", "parameters", "local_item_dp_noise_multiplier",
          "local_item_dp_epsilon", "seconds"]


def resample_writers(counts: np.ndarray, writers: int, seed: int = 0) -> np.ndarray:
    """``writers`` rows drawn with replacement from the real writer-by-silo counts
    (the real matrix itself when ``writers`` equals its row count)."""
    if writers == counts.shape[0]:
        return counts
    rng = np.random.default_rng(seed)
    return counts[rng.integers(0, counts.shape[0], size=writers)]


def scale_row(cfg: SubjectDPConfig, counts: np.ndarray, parameters: int) -> dict:
    t = time.time()
    plan = make_plan(cfg, counts)
    rates = np.asarray(plan.sample_rates)
    # the rate the accounting samples each writer at (zero where it has no record)
    inclusion = np.vectorize(subject_inclusion_rate, otypes=[float])(rates[None, :], counts)
    per_batch = float(inclusion.sum(axis=0).mean())
    noise = plan.noise_multiplier * cfg.clipping_norm * math.sqrt(parameters) / cfg.batch_size
    signal = per_batch * cfg.clipping_norm / cfg.batch_size
    item = make_plan(replace(cfg, method="local-item-dp"), counts)
    return {"writers": counts.shape[0], "records_per_silo_mean": round(float(counts.sum(0).mean()), 1),
            "record_rate_max": round(float(rates.max()), 5),
            "inclusion_rate_mean": round(float(inclusion[counts > 0].mean()), 4),
            "noise_multiplier": round(plan.noise_multiplier, 4), "epsilon": round(plan.epsilon, 4),
            "epsilon_sfold": round(plan.epsilon_sfold, 4), "subjects_per_batch": round(per_batch, 1),
            "noise_norm": round(noise, 4), "signal_bound": round(signal, 4),
            "signal_to_noise": round(signal / noise, 5), "parameters": parameters,
            "local_item_dp_noise_multiplier": round(item.noise_multiplier, 4),
            "local_item_dp_epsilon": round(item.epsilon, 4),
            "seconds": round(time.time() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="../shared/data/femnist")
    ap.add_argument("--writers", type=int, nargs="+", default=[300, 1000, 3500])
    ap.add_argument("--results", default="results/subject_dp")
    args = ap.parse_args()
    cfg = SubjectDPConfig(method="higradavg-dp", accounting="exact", inclusion="subject",
                          alpha=1.0, data_dir=args.data_dir, max_records_per_subject=0)  # reported counts
    real = sd.all_counts(cfg)
    parameters = sum(p.numel() for p in build_subject_model(cfg).parameters())
    rows = []
    for n in args.writers:
        row = scale_row(cfg, resample_writers(real, n), parameters)
        print(row, flush=True)
        rows.append(row)
    print(f"wrote {write_csv(Path(args.results) / 'scale.csv', rows, FIELDS)}")


if __name__ == "__main__":
    main()
