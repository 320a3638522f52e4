"""User-level winsorized mean (Levy et al., Algorithms 1-3): rotation, sensitivities,
ledger composition, and the "sample mean plus noise" property on concentrated data."""

import math

import dp_accounting as dpa
import numpy as np
import pytest

from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.winsorized.estimator import (
    RADIUS_FACTOR,
    RandomRotation,
    WinsorizedMean,
    clipped_average,
    hadamard,
    histogram,
)


@pytest.mark.parametrize("dim", [1, 5, 8, 100])
def test_rotation_is_orthogonal_and_invertible(dim):
    rot = RandomRotation.create(dim, np.random.default_rng(1))
    eye = rot.apply(np.eye(dim))  # rows: R e_i (padded)
    np.testing.assert_allclose(eye @ eye.T, np.eye(dim), atol=1e-12)  # columns orthonormal
    x = np.random.default_rng(2).normal(size=(7, dim))
    np.testing.assert_allclose(rot.invert(rot.apply(x)), x, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(rot.apply(x), axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)


def test_hadamard_matches_the_matrix():
    h = np.array([[1.0]])
    for _ in range(3):
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(0).normal(size=8)
    np.testing.assert_allclose(hadamard(x), h @ x, atol=1e-12)


def test_histogram_sensitivity_under_replacing_one_user():
    rng = np.random.default_rng(3)
    for dims in (1, 4, 16):
        x = rng.uniform(-1, 1, size=(50, dims))
        y = x.copy()
        y[7] = rng.uniform(-1, 1, size=dims)  # replace one user
        _, cx = histogram(x, 1.0, 0.1)
        _, cy = histogram(y, 1.0, 0.1)
        diff = cx - cy
        assert np.abs(diff).sum() <= 2 * dims
        assert np.linalg.norm(diff) <= math.sqrt(2 * dims) + 1e-12


def test_winsorized_average_sensitivity_under_replacing_one_user():
    rng = np.random.default_rng(4)
    n, radius = 40, 0.3
    centre = np.array([0.1, -0.2, 0.5])
    for _ in range(200):
        x = rng.normal(size=(n, 3))
        y = x.copy()
        y[rng.integers(n)] = rng.normal(scale=100.0, size=3)  # an adversarial user
        diff = clipped_average(x, centre, radius) - clipped_average(y, centre, radius)
        assert np.all(np.abs(diff) <= 2 * radius / n + 1e-12)


def test_both_releases_compose_in_the_ledger():
    mech = WinsorizedMean(bound=1.0, tau=0.1, range_noise=2.0, mean_noise=1.5)
    ledger = PrivacyLedger(delta=1e-5, unit="user")
    ledger.record("server", mech.event())
    combined = 1.0 / math.sqrt(1 / 2.0**2 + 1 / 1.5**2)  # two Gaussians = one Gaussian
    assert ledger.epsilon() == pytest.approx(epsilon(dpa.GaussianDpEvent(combined), 1e-5), rel=1e-3)
    lap = WinsorizedMean(bound=1.0, tau=0.1, range_noise=2.0, mean_noise=4.0, kind="laplace")
    pure = PrivacyLedger(delta=1e-12, unit="user")
    pure.record("server", lap.event())
    assert pure.epsilon() <= 1 / 2.0 + 1 / 4.0 + 1e-3  # pure DP: epsilons add


def _concentrated_users(rng, n, d, tau, mu):
    directions = rng.normal(size=(n, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return mu + directions * rng.uniform(0, tau, size=(n, 1))


def test_scalar_estimate_is_sample_mean_plus_noise_on_concentrated_data():
    rng = np.random.default_rng(5)
    n, tau, z = 2000, 0.05, 1.0
    mech = WinsorizedMean(bound=1.0, tau=tau, range_noise=2.0, mean_noise=z)
    std = z * 2 * RADIUS_FACTOR * tau / n
    errors = []
    for _ in range(400):
        x = 0.3 + rng.uniform(-tau, tau, size=n)
        errors.append(mech.estimate(x, rng) - x.mean())
    errors = np.array(errors)
    assert abs(errors.mean()) < 4 * std / math.sqrt(len(errors))  # unbiased
    assert errors.std() == pytest.approx(std, rel=0.15)  # only the calibrated noise


def test_vector_estimate_with_rotation_is_sample_mean_plus_noise():
    rng = np.random.default_rng(6)
    n, d, tau, z = 4000, 16, 0.05, 1.0
    mu = rng.uniform(-0.3, 0.3, size=d)
    mech = WinsorizedMean(bound=1.0, tau=tau, range_noise=3.0, mean_noise=z)
    errors = []
    for _ in range(200):
        x = _concentrated_users(rng, n, d, tau, mu)
        errors.append(mech.estimate(x, rng) - x.mean(axis=0))
    errors = np.array(errors)
    from flwr_jdp.winsorized.estimator import rotated_radius
    tau_inf = rotated_radius(tau, n, 16, mech.beta)
    std = z * 2 * RADIUS_FACTOR * tau_inf * math.sqrt(d) / n  # per rotated coordinate
    assert np.abs(errors.mean(axis=0)).max() < 5 * std / math.sqrt(len(errors))
    assert errors.std() == pytest.approx(std, rel=0.15)  # rotation preserves the noise law


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="tau"):
        WinsorizedMean(bound=1.0, tau=0.0, range_noise=1.0, mean_noise=1.0)
    with pytest.raises(ValueError, match="kind"):
        WinsorizedMean(bound=1.0, tau=0.1, range_noise=1.0, mean_noise=1.0, kind="cauchy")
