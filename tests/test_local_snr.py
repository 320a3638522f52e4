"""The signal-to-noise bound of a DP release of the shared parameters
(``examples/joint_dp/local_snr.py``): its z is the run's calibration, its formula is
sqrt(S) B / (z sqrt(d)), and at a fixed epsilon it hardly moves with the batch."""

from __future__ import annotations

import math

import pytest

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.schedule import build_schedule, calibrate_schedule
from research.reproduce_joint_dp import Cell, run_config

from .helpers import load_example


@pytest.fixture(scope="module")
def snr():
    return load_example("joint_dp/local_snr.py", "jdp_local_snr")


def test_bound_uses_the_runs_own_schedule_and_the_formula(snr):
    cell = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0)
    row = snr.bound(cell, "table1")
    cfg = parse_config(run_config(cell, 0, "", "unused"))
    sizes = snr.balanced_sizes(256)
    assert sum(s.num_records for s in sizes.values()) == snr.N
    schedule = build_schedule(cfg, sizes)
    z = calibrate_schedule(cfg, schedule)
    assert row["noise_multiplier"] == pytest.approx(z, abs=1e-4)
    # 39 records, q = 32/39, round(5 / q) = 6 steps a round, 20 rounds; FC1 personal: 29,034 shared
    assert (row["records_per_owner"], row["releases"], row["shared_params"]) == (39, 120, 29_034)
    expected = math.sqrt(120) * 32 / (z * math.sqrt(29_034))
    assert row["snr_owner"] == pytest.approx(expected, abs=1e-4)
    assert row["snr_mean"] == pytest.approx(expected * 16, abs=1e-3)  # sqrt(256) owners


def test_central_noise_counts_one_release_a_round_over_all_records(snr):
    row = snr.bound(Cell("fashion-mnist", 512, "joint-dp", "central", 1.0), "table1")
    assert (row["releases"], row["batch"], row["snr_owner"]) == (20, 10_000.0, "")
    assert row["snr_mean"] == pytest.approx(math.sqrt(20) * 10_000 / (row["noise_multiplier"] * math.sqrt(29_034)),
                                            rel=1e-4)


def test_at_a_fixed_epsilon_the_bound_hardly_moves_with_batch_or_steps_but_grows_with_epsilon(snr):
    cell = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0)
    rows = [snr.bound(cell, "sweep", {"batch-size": b, "local-epochs": e}) for b, e in ((8, 5), (32, 5), (32, 1))]
    values = [r["snr_owner"] for r in rows]
    assert len({r["noise_multiplier"] for r in rows}) == 3  # three different z ...
    assert max(values) / min(values) < 1.02  # ... the same bound
    looser = snr.bound(Cell("fashion-mnist", 256, "joint-dp", "local", 5.0), "sweep")
    assert (rows[1]["epsilon"], looser["epsilon"]) == (1.0, 5.0)  # the target z was calibrated to
    assert looser["snr_owner"] > 3 * values[1]
