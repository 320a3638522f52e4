"""Clipping bounds the sensitivity; the noise added is the noise accounted."""

import numpy as np
import pytest
import torch
from opacus import GradSampleModule

from flwr_jdp.models import SeedCNN
from flwr_jdp.params import split_parameters
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, clip_numpy, global_norm_numpy
from flwr_jdp.training.dp_sgd import UnitBatch, clipped_unit_sum


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unit", ["record", "user"])
def test_each_unit_contributes_at_most_c(seed, unit):
    """Removing one unit changes the clipped sum by at most C (any batch)."""
    torch.manual_seed(seed)
    model = SeedCNN(1, 8, 10)
    split = split_parameters(model, r"^fc1\.")
    n = 12
    x = torch.randn(n, 1, 8, 8) * (1 + 10 * seed)
    y = torch.randint(0, 10, (n,))
    users = torch.arange(n) if unit == "record" else torch.randint(0, 4, (n,))
    _, units = torch.unique(users, return_inverse=True)
    k = int(units.max()) + 1
    C = 0.5

    def unit_sum(keep):
        gsm = GradSampleModule(SeedCNN(1, 8, 10), loss_reduction="sum")
        gsm._module.load_state_dict(model.state_dict())
        params = dict(gsm._module.named_parameters())
        shared = [params[nm] for nm in split.shared]
        idx = torch.nonzero(keep).flatten()
        loss = torch.nn.functional.cross_entropy(gsm(x[idx]), y[idx], reduction="sum")
        loss.backward()
        _, inv = torch.unique(units[idx], return_inverse=True)
        return [s.detach().numpy() for s in clipped_unit_sum(shared, UnitBatch(idx, inv, int(inv.max()) + 1), C)]

    full = unit_sum(torch.ones(n, dtype=torch.bool))
    for u in range(k):
        without = unit_sum(units != u)
        diff = [a - b for a, b in zip(full, without, strict=False)]
        assert global_norm_numpy(diff) <= C * (1 + 1e-4)


def test_clip_numpy_bounds_norm():
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(5, 5)) * 100, rng.normal(size=3)]
    assert global_norm_numpy(clip_numpy(arrays, 1.5)) <= 1.5 + 1e-6
    small = [np.full(3, 0.01)]
    assert np.allclose(clip_numpy(small, 1.0)[0], small[0], rtol=1e-5)


def test_noise_std_is_z_times_sensitivity_over_denominator():
    mech = GaussianSumMechanism(noise_multiplier=1.3, sensitivity=0.7, denominator=4.0)
    assert mech.noise_std == pytest.approx(1.3 * 0.7 / 4.0)
    rng = np.random.default_rng(1)
    out = mech.release_numpy([np.zeros(200_000)], rng)[0]
    assert out.std() == pytest.approx(mech.noise_std, rel=0.01)
    gen = torch.Generator().manual_seed(2)
    t = mech.release_torch([torch.zeros(200_000, dtype=torch.float64)], gen)[0]
    assert float(t.std()) == pytest.approx(mech.noise_std, rel=0.01)
    assert mech.event().noise_multiplier == 1.3


def test_unseeded_noise_differs_between_runs():
    from flwr_jdp.privacy.mechanisms import numpy_rng

    a = numpy_rng(None).normal(size=4)
    b = numpy_rng(None).normal(size=4)
    assert not np.allclose(a, b)
    assert np.allclose(numpy_rng(3).normal(size=4), numpy_rng(3).normal(size=4))
