"""How much signal a DP release of the shared parameters can carry, local against central noise.

No training: the noise multipliers come from the project's own schedule and calibration
(:func:`~flwr_jdp.joint_dp.schedule.build_schedule`, :func:`~flwr_jdp.joint_dp.schedule.calibrate_schedule`,
PLD), for the run config of each cell (:func:`~research.reproduce_joint_dp.run_config`:
N = 10,000 records split evenly, delta = 1e-4, the paper's E and T, HPARAMS' batch).

The bound. Over a run, the shared parameters move by the sum of the released noisy
gradient means. Each mean is a sum of per-record gradients clipped to C, divided by the
expected batch B, plus Gaussian noise of standard deviation z C / B per coordinate.
After S releases the clipped part has norm at most S C (every clipped gradient pointing
the same way), and the noise has norm about sqrt(S d) z C / B over d shared parameters, so

    snr = S C / (sqrt(S d) z C / B) = sqrt(S) B / (z sqrt(d)),

an upper bound on the ratio of signal to noise in the owner's total release (C cancels).
Under local noise each owner makes its own S = steps x T releases at its own z; the
server's mean over n owners keeps the signal and divides the noise by sqrt(n)
(independent noise), so the mean carries at most ``snr_owner * sqrt(n)``. Under central
noise the server adds z C once per round to the sum over all owners' sampled records
(B = q N, S = T). At a fixed epsilon, with z large (as here), z grows as sqrt(S) at
q = 1 and as q sqrt(S) under Poisson sampling, so ``snr_owner`` hardly moves with the
batch or the number of steps: the ``sweep`` rows at n = 256 vary both. What sets it is
the owner's record count m (linearly: about 0.31 m / sqrt(d) at epsilon = 1)
and epsilon (sublinearly: 1.8, 4.0 and 7.0 times at epsilon = 2, 5 and 10 for n = 256).

    python examples/joint_dp/local_snr.py

writes ``results/joint_dp/local_snr.csv``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule, calibrate_schedule

# research/ (the reproductions' code) is not installed: import it from the repository root
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from research.reproduce_joint_dp import PAPER_SCHEDULE, Cell, run_config, shared_parameter_count  # noqa: E402
from research.results_csv import write_csv  # noqa: E402

N = 10_000
FIELDS = ("kind", "owners", "trust", "personal_layers", "shared_params", "records_per_owner", "batch",
          "local_epochs", "rounds", "sample_rate", "releases", "noise_multiplier", "epsilon",
          "snr_owner", "snr_mean")


def balanced_sizes(owners: int) -> dict[int, OwnerSize]:
    """Records per owner of the balanced partitioner: N/n or N/n + 1."""
    base, extra = divmod(N, owners)
    return {o: OwnerSize(base + (o < extra), base + (o < extra)) for o in range(owners)}


def bound(cell: Cell, kind: str, extra: dict | None = None) -> dict:
    """One row: the cell's schedule, the z calibrated to its target epsilon (the row's
    ``epsilon``, from the same run config) and the snr bound of its releases."""
    cfg = parse_config(run_config(cell, 0, "", "unused", extra=extra))  # no run, nothing written
    sizes = balanced_sizes(cell.owners)
    schedule = build_schedule(cfg, sizes)
    z = calibrate_schedule(cfg, schedule)
    d = shared_parameter_count(cell.personal if cell.method == "joint-dp" else "none")
    smallest = min(sizes, key=lambda o: sizes[o].num_records)  # the worst owner: fewest records
    m = sizes[smallest].num_records
    if cell.trust == "central":
        q, steps = schedule.server_rate, 1
        batch = q * N
    else:
        q, steps = schedule.owner_rates[smallest], schedule.owner_steps[smallest]
        batch = q * m
    releases = steps * cfg.num_rounds
    snr_owner = math.sqrt(releases) * batch / (z * math.sqrt(d))
    snr_mean = snr_owner if cell.trust == "central" else snr_owner * math.sqrt(cell.owners)
    return {"kind": kind, "owners": cell.owners, "trust": cell.trust,
            "personal_layers": cell.personal if cell.method == "joint-dp" else "none", "shared_params": d,
            "records_per_owner": m, "batch": round(batch, 2), "local_epochs": cfg.local_epochs,
            "rounds": cfg.num_rounds, "sample_rate": round(q, 4), "releases": releases,
            "noise_multiplier": round(z, 4), "epsilon": cfg.target_epsilon,
            "snr_owner": round(snr_owner, 4) if cell.trust == "local" else "",
            "snr_mean": round(snr_mean, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results" / "joint_dp" / "local_snr.csv"))
    parser.add_argument("--owners", type=int, nargs="+", default=sorted(PAPER_SCHEDULE))
    args = parser.parse_args()
    rows = []
    for n in args.owners:
        for trust in ("local", "central"):
            for personal in ("fc1", "conv1+conv2+fc1"):
                rows.append(bound(Cell("fashion-mnist", n, "joint-dp", trust, 1.0, personal=personal), "table1"))
                print(rows[-1], flush=True)
    # n = 256, local noise, FC1 personal: the batch and the local epochs varied at the same epsilon.
    cell = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0)
    for batch, epochs in ((39, 5), (16, 5), (8, 5), (32, 1), (32, 20)):
        rows.append(bound(cell, "sweep", {"batch-size": batch, "local-epochs": epochs}))
        print(rows[-1], flush=True)
    for eps in (2.0, 5.0, 10.0):  # and epsilon
        rows.append(bound(Cell("fashion-mnist", 256, "joint-dp", "local", eps), "sweep"))
        print(rows[-1], flush=True)
    print(f"wrote {write_csv(args.out, rows, FIELDS)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
