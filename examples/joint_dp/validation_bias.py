"""How a validation split carved from each owner's records differs from the test split.

For every owner, the share in its training split of the class of each record it is
evaluated on, averaged over its evaluation records and then over owners: the accuracy
of guessing from the owner's own label distribution, the part of a personal model's
accuracy that a tiny training split is most sure of. On the test split, dealt by class,
this is 1/8 with 8 classes per owner. A split carved from the owner's own records
(``validation-source = carve``) takes a record out of its class, so the class is rarer
in what the owner trains on; a split from the pool of training-set records no owner
holds (``pool``) leaves the training split as it is. No training, no privacy cost.

    python examples/joint_dp/validation_bias.py --data-dir ../shared/data/fashion-mnist

writes ``results/joint_dp/validation_bias.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from flwr_jdp.data.partition import load_partitions

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.results_csv import write_csv  # noqa: E402


def prior_of_evaluated_class(owners) -> float:
    """Mean over owners of the training-split share of each evaluated record's class."""
    shares = []
    for o in owners:
        share = np.bincount(o.y_train, minlength=int(max(o.y_train.max(), o.y_test.max())) + 1)
        shares.append(float(np.mean(share[o.y_test] / len(o.y_train))))
    return float(np.mean(shares))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "mnist"))
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--owners", type=int, nargs="+", default=[4, 16, 64, 128, 256, 512])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--out", default=str(ROOT / "results" / "joint_dp" / "validation_bias.csv"))
    args = parser.parse_args()
    rows = []
    for n in args.owners:
        for split, frac, source in (("test", 0.0, "carve"), ("carve", args.validation_fraction, "carve"),
                                    ("pool", args.validation_fraction, "pool")):
            vals, train, evald = [], [], []
            for seed in range(args.seeds):
                owners = load_partitions(args.dataset, args.data_dir, n, 8, 10_000, 1, seed,
                                         "balanced", frac, source)
                vals.append(prior_of_evaluated_class(owners))
                train.append(np.mean([len(o.y_train) for o in owners]))
                evald.append(np.mean([len(o.y_test) for o in owners]))
            rows.append({"dataset": args.dataset, "owners": n, "split": split, "seeds": args.seeds,
                         "train_records_per_owner": round(float(np.mean(train)), 1),
                         "eval_records_per_owner": round(float(np.mean(evald)), 1),
                         "share_of_evaluated_class": round(float(np.mean(vals)), 4)})
            print(rows[-1], flush=True)
    print(f"wrote {write_csv(args.out, rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
