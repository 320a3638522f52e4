"""Empirical privacy audit of the Gaussian sum mechanism (the one every trainer and
the server use): certified epsilon lower bounds for the honest mechanism and for a
broken one that adds half the noise, against the ledger's claim.

    python examples/audit/gaussian_sum.py [--trials 100000]

Writes results/audit/gaussian_sum.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.audit import audit_sum_mechanism
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, clip_numpy

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100_000)
    parser.add_argument("--noise-multiplier", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--out", default=str(ROOT / "results" / "audit" / "gaussian_sum.json"))
    args = parser.parse_args()
    rng = np.random.default_rng(11)
    records = np.stack([clip_numpy([r], 1.0)[0] for r in rng.normal(size=(30, 8))])
    canary = np.zeros(8)
    canary[0] = 1.0
    thresholds = np.linspace(0.5, 12.0, 24)
    claimed = epsilon(GaussianSumMechanism(args.noise_multiplier, 1.0).event(), args.delta)
    doc = {"claimed_epsilon": claimed, "delta": args.delta, "noise_multiplier": args.noise_multiplier,
           "trials": args.trials, "confidence": 0.95, "command": "python " + " ".join(sys.argv)}
    for name, z in (("honest", args.noise_multiplier), ("half_noise", args.noise_multiplier / 2)):
        mech = GaussianSumMechanism(z, 1.0, 1.0)
        res = audit_sum_mechanism(lambda s, r, m=mech: m.release_numpy([s], r)[0], records, canary,
                                  args.delta, args.trials, np.random.default_rng(1), thresholds)
        doc[name] = asdict(res) | {"violates_claim": res.epsilon_lower_bound > claimed}
        print(f"{name}: certified epsilon >= {res.epsilon_lower_bound:.3f} (claim {claimed:.3f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
