"""Empirical privacy audit of the Gaussian sum mechanism every trainer and the server
use: the certified lower bound never exceeds the ledger's epsilon, and a broken
mechanism (half the noise) is caught."""

import dp_accounting as dpa
import numpy as np
import pytest

from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.audit import audit_sum_mechanism, clopper_pearson
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, clip_numpy

Z, C, DELTA = 2.0, 1.0, 1e-3
THRESHOLDS = np.linspace(0.5, 12.0, 24)  # fixed in advance, in units of C


def _setup():
    rng = np.random.default_rng(11)
    records = np.stack([clip_numpy([r], C)[0] for r in rng.normal(size=(30, 8))])
    canary = np.zeros(8)
    canary[0] = C  # a unit at the clipping bound, the worst case
    return records, canary


def _release(mech: GaussianSumMechanism):
    return lambda s, rng: mech.release_numpy([s], rng)[0] * mech.denominator


def test_clopper_pearson_covers_the_truth():
    lo, hi = clopper_pearson(50, 1000, 0.05)
    assert lo < 0.05 < hi
    assert clopper_pearson(0, 100, 0.05)[0] == 0.0


def test_correct_mechanism_stays_below_its_claimed_epsilon():
    records, canary = _setup()
    mech = GaussianSumMechanism(Z, C, 1.0)
    claimed = epsilon(mech.event(), DELTA)
    res = audit_sum_mechanism(_release(mech), records, canary, DELTA, 100_000,
                              np.random.default_rng(1), THRESHOLDS)
    assert res.epsilon_lower_bound <= claimed
    assert res.epsilon_lower_bound > 0.3 * claimed  # the audit has power: it is not vacuous


def test_broken_mechanism_with_half_the_noise_is_flagged():
    records, canary = _setup()
    honest = GaussianSumMechanism(Z, C, 1.0)
    claimed = epsilon(honest.event(), DELTA)  # what the ledger would record
    broken = GaussianSumMechanism(Z / 2, C, 1.0)  # but only half the noise is added
    res = audit_sum_mechanism(_release(broken), records, canary, DELTA, 100_000,
                              np.random.default_rng(2), THRESHOLDS)
    assert res.epsilon_lower_bound > claimed


@pytest.mark.parametrize("z", [1.0, 2.0])
def test_claimed_epsilon_is_the_exact_gaussian_one(z):
    assert epsilon(dpa.GaussianDpEvent(z), DELTA) == pytest.approx(
        epsilon(GaussianSumMechanism(z, C, 5.0).event(), DELTA))
