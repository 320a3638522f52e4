"""The writer-scaling study resamples real writers' silo layouts and reports the
exact-accounting noise and the per-batch signal and noise it implies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_jdp.subject.config import SubjectDPConfig

from .helpers import load_example


def _scale():
    return load_example("subject_dp/scale.py", "sdp_scale")


def test_resampled_writers_are_rows_of_the_real_map():
    scale = _scale()
    counts = np.array([[3, 0, 2], [1, 1, 1], [0, 4, 0]])
    assert scale.resample_writers(counts, 3) is counts
    big = scale.resample_writers(counts, 50, seed=1)
    assert big.shape == (50, 3)
    assert {tuple(r) for r in big} <= {tuple(r) for r in counts}


CFG = SubjectDPConfig(method="higradavg-dp", accounting="exact", target_epsilon=4.0,
                      delta=1e-5, budget_rounds=2, batch_size=8, local_steps=1, max_records_per_subject=0)


@pytest.fixture(scope="module")
def rows():
    """The study's rows for 20 writers and for 200 resampled from them (computed once:
    each calibrates two noise multipliers by exact accounting)."""
    scale = _scale()
    counts = np.random.default_rng(0).integers(0, 4, size=(20, 3))
    large_counts = scale.resample_writers(counts, 200, seed=0)
    return counts, scale.scale_row(CFG, counts, parameters=100), scale.scale_row(CFG, large_counts, parameters=100)


@pytest.mark.slow  # the rows calibrate by exact PLD accounting at small rates: ~50 s
def test_more_writers_need_less_noise_and_the_row_is_consistent(rows):
    scale = _scale()
    rng = np.random.default_rng(0)
    counts, small, large = rows
    rng.integers(0, 4, size=(20, 3))  # the draw that made the counts: the simulations below keep their stream
    for row, c in ((small, counts), (large, scale.resample_writers(counts, 200, seed=0))):
        assert row["epsilon"] <= 4.0 + 1e-3
        # distinct writers in a Poisson batch of rate 8 / (silo size), simulated
        sims = []
        for silo in range(c.shape[1]):
            q = min(1.0, 8 / c[:, silo].sum())
            drawn = rng.random((4000, c.shape[0], c[:, silo].max())) < q
            held = np.arange(c[:, silo].max())[None, None, :] < c[None, :, silo, None]
            sims.append((drawn & held).any(axis=2).sum(axis=1).mean())
        assert math.isclose(row["subjects_per_batch"], np.mean(sims), rel_tol=0.03)
        # the noise N(0, (z C)^2 I) / B has about the stated norm (d = 100, C = 1, B = 8)
        noise = rng.normal(0.0, row["noise_multiplier"] / 8, size=(4000, 100))
        assert math.isclose(row["noise_norm"], np.linalg.norm(noise, axis=1).mean(), rel_tol=0.03)
    assert large["record_rate_max"] < small["record_rate_max"]
    assert large["noise_multiplier"] < small["noise_multiplier"]
    assert large["signal_to_noise"] > small["signal_to_noise"]


@pytest.mark.slow
def test_row_gives_local_item_dp_its_own_record_level_noise(rows):
    """LocalItemDP's column is its record-level plan on the same counts, and falls as the
    silos grow (its record rate falls), like the subject-level noise."""
    from dataclasses import replace

    from flwr_jdp.subject.plan import make_plan

    counts, small, large = rows
    plan = make_plan(replace(CFG, method="local-item-dp"), counts)
    assert small["local_item_dp_noise_multiplier"] == round(plan.noise_multiplier, 4)
    assert small["local_item_dp_epsilon"] <= 4.0 + 1e-3
    assert large["local_item_dp_noise_multiplier"] < small["local_item_dp_noise_multiplier"]
