"""The writer-scaling study resamples real writers' silo layouts and reports the
exact-accounting noise and the per-batch signal and noise it implies."""

from __future__ import annotations

import math

import numpy as np

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


def test_more_writers_need_less_noise_and_the_row_is_consistent():
    scale = _scale()
    cfg = SubjectDPConfig(method="higradavg-dp", accounting="exact", target_epsilon=4.0,
                          delta=1e-5, budget_rounds=2, batch_size=8, local_steps=1)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, size=(20, 3))
    small = scale.scale_row(cfg, counts, parameters=100)
    large = scale.scale_row(cfg, scale.resample_writers(counts, 200, seed=0), parameters=100)
    for row in (small, large):
        assert row["epsilon"] <= 4.0 + 1e-3
        assert math.isclose(row["noise_norm"], row["noise_multiplier"] * 10 / 8, rel_tol=1e-3)
        assert math.isclose(row["signal_bound"], row["subjects_per_batch"] / 8, rel_tol=1e-2)
        assert 0 < row["subjects_per_batch"] <= row["writers"]
    assert large["record_rate_max"] < small["record_rate_max"]
    assert large["noise_multiplier"] < small["noise_multiplier"]
    assert large["signal_to_noise"] > small["signal_to_noise"]
