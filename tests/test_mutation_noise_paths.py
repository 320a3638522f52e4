"""Noise of production paths that no other fast test measured (found by cutting each
path's noise multiplier 10x by hand, docs/mutation.md): the winsorized module's
clipped-Gaussian baseline."""

import numpy as np
import pytest

from flwr_jdp.winsorized.estimator import clipped_gaussian_mean


def test_clipped_gaussian_mean_noise_is_z_times_2b_over_n_and_clips_each_user_to_b():
    """Its documented release: every user's vector clipped to L2 norm B, averaged,
    plus N(0, (z 2B / n)^2) per coordinate (one Gaussian(z) event, replace-one)."""
    n, dim, bound, z = 50, 4000, 0.7, 1.3
    rng = np.random.default_rng(0)
    noise = clipped_gaussian_mean(np.zeros((n, dim)), bound, z, rng)
    assert noise.shape == (dim,)
    assert noise.std() == pytest.approx(z * 2 * bound / n, rel=0.05)  # 4,000 values: ~1% error
    assert abs(noise.mean()) < 4 * z * 2 * bound / n / np.sqrt(dim)
    big = np.zeros((n, 3))
    big[:, 0] = 100.0  # every user far outside the ball: clipped to (B, 0, 0)
    np.testing.assert_allclose(clipped_gaussian_mean(big, bound, 0.0, rng), [bound, 0.0, 0.0], rtol=1e-12)
    assert clipped_gaussian_mean(np.full(n, 0.2), bound, 0.0, rng) == pytest.approx(0.2)  # scalars stay scalar
