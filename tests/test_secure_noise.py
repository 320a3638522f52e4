"""secure-noise: every noise draw of the joint-DP system from the OS CSPRNG in float64
(issue item 7)."""

import numpy as np
import pytest
import torch

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.privacy import mechanisms
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, secure_gaussian, secure_uniform
from flwr_jdp.training.dp_sgd import secure_poisson_sample

from .helpers import run_inprocess


def test_secure_gaussian_has_the_stated_std_and_is_gaussian():
    std, n = 2.5, 1_000_000
    x = secure_gaussian((1000, 1000), std)
    assert x.dtype == np.float64 and x.shape == (1000, 1000)
    # sd of the sample std is std / sqrt(2n) (0.07 %): 1 % is > 10 of them
    assert x.std() == pytest.approx(std, rel=0.01)
    assert abs(x.mean()) < 6 * std / np.sqrt(n)
    kurtosis = np.mean((x / x.std()) ** 4)
    assert kurtosis == pytest.approx(3.0, abs=0.05)  # sd ~ sqrt(24 / n) = 0.005
    assert np.mean(np.abs(x) < std) == pytest.approx(0.6827, abs=0.005)
    assert np.all(secure_gaussian(7, 0.0) == 0.0)


def test_secure_uniform_is_on_the_unit_interval_and_uniform():
    u = secure_uniform(400_000)
    assert u.dtype == np.float64 and u.min() > 0.0 and u.max() <= 1.0
    assert u.mean() == pytest.approx(0.5, abs=0.005)
    assert np.histogram(u, bins=10, range=(0, 1))[0] / len(u) == pytest.approx(np.full(10, 0.1), abs=0.005)
    units = torch.arange(200_000)
    assert secure_poisson_sample(units, 200_000, 0.3).num_units / 200_000 == pytest.approx(0.3, abs=0.005)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_secure_mechanism_noise_std_equals_the_stated_std(kind):
    mech = GaussianSumMechanism(1.3, 0.7, denominator=4.0, secure=True)
    s = np.linspace(-1, 1, 300_000).astype(np.float32)
    if kind == "numpy":
        out = mech.release_numpy([s], np.random.default_rng(0))[0]
    else:
        out = mech.release_torch([torch.from_numpy(s)], torch.Generator().manual_seed(0))[0].numpy()
    assert out.dtype == np.float32
    noise = out.astype(np.float64) - s.astype(np.float64) / 4.0
    assert noise.std() == pytest.approx(mech.noise_std, rel=0.01)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_secure_draws_are_float64_and_cast_last(kind, monkeypatch):
    seen = []
    real = mechanisms.secure_gaussian

    def spy(shape, std):
        out = real(shape, std)
        seen.append(out)
        return out

    monkeypatch.setattr(mechanisms, "secure_gaussian", spy)
    mech = GaussianSumMechanism(1.0, 0.5, denominator=3.0, secure=True)
    s = np.random.default_rng(1).normal(size=(50, 7)).astype(np.float32)
    if kind == "numpy":
        out = mech.release_numpy([s], np.random.default_rng(0))[0]
    else:
        out = mech.release_torch([torch.from_numpy(s)], torch.Generator())[0].numpy()
    assert len(seen) == 1 and seen[0].dtype == np.float64 and seen[0].shape == s.shape
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ((s.astype(np.float64) + seen[0]) / 3.0).astype(np.float32))


def test_secure_noise_ignores_the_generator():
    mech = GaussianSumMechanism(1.0, 1.0, secure=True)
    zeros = [torch.zeros(64)]
    a = mech.release_torch(zeros, torch.Generator().manual_seed(3))[0]
    b = mech.release_torch(zeros, torch.Generator().manual_seed(3))[0]
    assert not torch.equal(a, b)
    plain = GaussianSumMechanism(1.0, 1.0)
    assert torch.equal(plain.release_torch(zeros, torch.Generator().manual_seed(3))[0],
                       plain.release_torch(zeros, torch.Generator().manual_seed(3))[0])


def test_secure_noise_with_a_noise_seed_fails_at_startup_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        parse_config({"secure-noise": True, "noise-seed": 0})
    assert "'secure-noise'" in str(err.value) and "'noise-seed'" in str(err.value)
    assert parse_config({"secure-noise": "true", "noise-seed": -1}).secure_noise is True
    assert parse_config({}).secure_noise is False
    with pytest.raises(ConfigError, match="'secure-noise'"):
        parse_config({"secure-noise": "maybe"})


@pytest.mark.parametrize("unit,placement", [("record", "local"), ("owner", "local"),
                                            ("record", "central"), ("owner", "central")])
def test_every_noise_draw_of_a_run_is_secure(run_config, unit, placement, monkeypatch):
    """With secure-noise, each noised release of a run (owners' DP-SGD steps, owner-unit
    local updates, the server's central noise) draws from secure_gaussian, at z * C."""
    stds = []
    real = mechanisms.secure_gaussian

    def spy(shape, std):
        stds.append(std)
        return real(shape, std)

    flags = []
    post_init = GaussianSumMechanism.__post_init__

    def record_flag(self):
        flags.append(self.secure)
        post_init(self)

    monkeypatch.setattr(mechanisms, "secure_gaussian", spy)
    monkeypatch.setattr(GaussianSumMechanism, "__post_init__", record_flag)
    run_config.update({"privacy-unit": unit, "noise-placement": placement, "num-rounds": 1,
                       "secure-noise": True, "noise-seed": -1, "clipping-norm": 0.5,
                       "noise-multiplier": 1.5})
    run_inprocess(run_config)
    assert flags and all(flags)  # every mechanism of the run noises securely
    assert stds and all(s == pytest.approx(1.5 * 0.5) for s in stds)
