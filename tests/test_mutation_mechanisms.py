"""Unit checks of the noise mechanisms and clipping (flwr_jdp/privacy/mechanisms.py)
written to kill surviving mutants (docs/mutation.md): argument checks at their
edges, the mean, scale, dtype and shape of every noise path (seeded and secure),
the Wigner matrix's symmetry, clipping factors and the re-clipped sum. Seeded or
checked with wide statistical margins (each check fails with probability far below
1e-6 for the correct code)."""

import math

import numpy as np
import pytest
import torch

from flwr_jdp.privacy import mechanisms as m
from flwr_jdp.privacy.mechanisms import (
    CLIP_EPS,
    GaussianSumMechanism,
    LaplaceSumMechanism,
    NoisySumMechanism,
    SymmetricGaussianMechanism,
)

N = 200_000


@pytest.mark.parametrize("cls", [GaussianSumMechanism, LaplaceSumMechanism, SymmetricGaussianMechanism])
def test_argument_checks_at_their_edges(cls):
    cls(0.0, 1.0)  # z = 0 is allowed (no noise)
    with pytest.raises(ValueError, match="^noise_multiplier must be >= 0$"):
        cls(-1e-9, 1.0)
    with pytest.raises(ValueError, match="^sensitivity must be > 0$"):
        cls(1.0, 0.0)
    with pytest.raises(ValueError, match="^sensitivity must be > 0$"):
        cls(1.0, -1.0)
    with pytest.raises(ValueError, match="^denominator must be > 0$"):
        cls(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="^denominator must be > 0$"):
        cls(1.0, 1.0, -2.0)
    mech = cls(1.0, 1.0)
    assert mech.denominator == 1.0 and mech.secure is False and mech.unit == ""


def test_base_class_states_no_noise_law():
    base = NoisySumMechanism(1.0, 1.0)
    with pytest.raises(NotImplementedError):
        base.event()
    with pytest.raises(NotImplementedError):
        base.noise_numpy((2,), np.random.default_rng(0))


@pytest.mark.parametrize("secure", [False, True])
def test_gaussian_numpy_release_mean_std_dtype(secure):
    mech = GaussianSumMechanism(1.5, 2.0, 4.0, secure=secure)
    sums = [np.full(N, 8.0, dtype=np.float32), np.full((3, 2), 4.0, dtype=np.float64)]
    out = mech.release_numpy(sums, None if secure else np.random.default_rng(0))
    assert out[0].dtype == np.float32 and out[1].dtype == np.float64 and out[1].shape == (3, 2)
    assert abs(out[0].mean() - 2.0) < 6 * 0.75 / math.sqrt(N)  # (8 + noise) / 4
    assert out[0].std() == pytest.approx(1.5 * 2.0 / 4.0, rel=0.02)


def test_gaussian_numpy_noise_is_centred_and_scaled():
    mech = GaussianSumMechanism(2.0, 0.5)
    noise = mech.noise_numpy((N,), np.random.default_rng(1))
    assert noise.dtype == np.float64 and noise.shape == (N,)
    assert abs(noise.mean()) < 6 / math.sqrt(N)
    assert noise.std() == pytest.approx(1.0, rel=0.02)
    assert np.all(GaussianSumMechanism(0.0, 1.0).noise_numpy((5,), np.random.default_rng(0)) == 0)


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussian_torch_release_mean_std_dtype(secure, dtype):
    mech = GaussianSumMechanism(1.5, 2.0, 4.0, secure=secure)
    gen = torch.Generator().manual_seed(3)
    out = mech.release_torch([torch.full((N,), 8.0, dtype=dtype), torch.zeros((2, 3), dtype=dtype)], gen)
    assert out[0].dtype == dtype and out[1].dtype == dtype and out[1].shape == (2, 3)
    assert abs(float(out[0].mean()) - 2.0) < 6 * 0.75 / math.sqrt(N)
    assert float(out[0].std()) == pytest.approx(0.75, rel=0.02)
    assert len(mech.release_torch([], gen)) == 0


def test_seeded_torch_noise_is_drawn_in_the_sums_dtype():
    mech = GaussianSumMechanism(1.0, 2.0, 4.0)
    s = torch.full((1000,), 3.0, dtype=torch.float64)
    out = mech.release_torch([s], torch.Generator().manual_seed(8))[0]
    noise = torch.normal(0.0, 2.0, size=(1000,), generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    assert out.dtype == torch.float64 and torch.equal(out, (s + noise) / 4.0)


def test_secure_torch_release_ignores_requires_grad():
    mech = GaussianSumMechanism(1.0, 1.0, secure=True)
    out = mech.release_torch([torch.zeros(4, requires_grad=True)], None)[0]
    assert not out.requires_grad and out.dtype == torch.float32


def test_gaussian_event():
    assert GaussianSumMechanism(0.7, 3.0).event().noise_multiplier == 0.7


@pytest.mark.parametrize("secure", [False, True])
def test_laplace_noise_scale_mean_and_event(secure):
    mech = LaplaceSumMechanism(0.5, 4.0, 2.0, secure=secure)
    assert mech.noise_std == pytest.approx(math.sqrt(2) * 0.5 * 4.0 / 2.0)
    noise = mech.noise_numpy((N,), None if secure else np.random.default_rng(2))
    assert noise.dtype == np.float64 and noise.shape == (N,)
    assert abs(noise.mean()) < 6 * math.sqrt(2) * 2.0 / math.sqrt(N)
    assert np.mean(np.abs(noise)) == pytest.approx(2.0, rel=0.02)  # E|Lap(b)| = b = z S
    out = mech.release_numpy([np.full(N, 6.0, dtype=np.float32)], None if secure else np.random.default_rng(3))[0]
    assert out.dtype == np.float32 and abs(out.mean() - 3.0) < 0.05
    event = mech.event()
    assert type(event).__name__ == "LaplaceDpEvent" and event.noise_multiplier == 0.5


@pytest.mark.parametrize("secure", [False, True])
def test_symmetric_mechanism_noise(secure):
    mech = SymmetricGaussianMechanism(2.0, 0.5, 3.0, secure=secure)
    noise = mech.noise_numpy((400, 400), None if secure else np.random.default_rng(4))
    assert noise.shape == (400, 400) and noise.dtype == np.float64
    assert np.array_equal(noise, noise.T)
    upper = noise[np.triu_indices(400)]
    assert upper.std() == pytest.approx(1.0, rel=0.02) and abs(upper.mean()) < 0.02
    assert np.diag(noise).std() == pytest.approx(1.0, rel=0.2)
    assert mech.event().noise_multiplier == 2.0
    out = mech.release_numpy([np.full((400, 400), 3.0, dtype=np.float32)],
                             None if secure else np.random.default_rng(5))[0]
    assert out.dtype == np.float32 and np.array_equal(out, out.T) and abs(out.mean() - 1.0) < 0.01


@pytest.mark.parametrize("shape", [(3,), (2, 3), (3, 3, 3)])
def test_symmetric_mechanism_needs_a_square_matrix(shape):
    with pytest.raises(ValueError, match=r"^a symmetric release needs a square matrix, got shape \("):
        SymmetricGaussianMechanism(1.0, 1.0).noise_numpy(shape, np.random.default_rng(0))
    with pytest.raises(NotImplementedError,
                       match=r"^SymmetricGaussianMechanism releases numpy matrices \(release_numpy\)$"):
        SymmetricGaussianMechanism(1.0, 1.0).release_torch([torch.zeros(2, 2)], None)


def test_wigner_is_symmetric_with_independent_upper_triangle():
    w = m.wigner(300, 2.0, np.random.default_rng(6))
    assert np.array_equal(w, w.T)
    assert w[np.triu_indices(300)].std() == pytest.approx(2.0, rel=0.02)
    assert w[np.triu_indices(300, 1)].std() == pytest.approx(2.0, rel=0.02)
    assert np.diag(w).std() == pytest.approx(2.0, rel=0.2)
    s = m.wigner(300, 2.0, None, secure=True)
    assert np.array_equal(s, s.T) and s[np.triu_indices(300)].std() == pytest.approx(2.0, rel=0.02)
    assert m.wigner(4, 1.0, np.random.default_rng(0)).dtype == np.float64
    # seeded unless asked to be secure
    assert np.array_equal(m.wigner(5, 1.0, np.random.default_rng(9)), m.wigner(5, 1.0, np.random.default_rng(9)))
    mech = SymmetricGaussianMechanism(1.0, 1.0)
    assert np.array_equal(mech.noise_numpy((5, 5), np.random.default_rng(9)),
                          m.wigner(5, 1.0, np.random.default_rng(9)))


def test_clip_coefficients():
    norms = torch.tensor([0.0, 0.5, 1.0, 2.0, 10.0], dtype=torch.float64)
    got = m.clip_coefficients(norms, 1.0)
    want = torch.clamp(1.0 / (norms + CLIP_EPS), max=1.0)
    assert torch.equal(got, want)
    assert got[0] == 1.0 and got[1] == 1.0 and got[3] == pytest.approx(0.5, rel=1e-5)
    assert bool((got * norms <= 1.0).all())
    assert CLIP_EPS == 1e-6


def test_global_norm_is_accumulated_in_float64():
    big = [np.full(4, 1e20, dtype=np.float32), np.array([3e20], dtype=np.float32)]
    assert m.global_norm_numpy(big) == pytest.approx(math.sqrt(4 * 1e40 + 9e40), rel=1e-6)
    assert m.global_norm_numpy([np.array([3.0]), np.array([[4.0]])]) == 5.0
    assert m.global_norm_numpy([]) == 0.0


def test_clip_numpy_and_float64():
    arrays = [np.array([3.0, 0.0], dtype=np.float32), np.array([4.0], dtype=np.float32)]
    clipped = m.clip_numpy(arrays, 1.0)
    assert [a.dtype for a in clipped] == [np.float32, np.float32]
    assert np.allclose(clipped[0], [0.6, 0.0], rtol=1e-5) and np.allclose(clipped[1], [0.8], rtol=1e-5)
    unchanged = m.clip_numpy(arrays, 10.0)
    assert all(np.array_equal(a, b) for a, b in zip(unchanged, arrays, strict=True))
    exact = m.clip_numpy([np.array([3.0, 4.0])], 1.0)
    assert m.global_norm_numpy(exact) <= 1.0 and exact[0].dtype == np.float64
    wide = m.clip_float64(arrays, 1.0)
    assert [a.dtype for a in wide] == [np.float64, np.float64]
    assert m.global_norm_numpy(wide) <= 1.0
    assert wide[1][0] == pytest.approx(4.0 / (5.0 + CLIP_EPS), rel=1e-12)
    same = m.clip_float64(arrays, 10.0)
    assert np.array_equal(same[0], [3.0, 0.0]) and same[0].dtype == np.float64


def test_reclipped_sum():
    contributions = {2: [np.array([3.0, 4.0])], 0: [np.array([0.3, 0.4])], 1: [np.array([1.0, 0.0])]}
    total, over = m.reclipped_sum(contributions, {0: 1.0, 1: 1.0, 2: 1.0})
    assert over == {2: 5.0}  # owner 1 sits exactly on its bound: not over
    assert len(total) == 1 and total[0].dtype == np.float64
    assert np.allclose(total[0], [0.3 + 1.0 / (1 + CLIP_EPS) + 3.0 / (5 + CLIP_EPS), 0.4 + 4.0 / (5 + CLIP_EPS)],
                       rtol=1e-12)
    bounds = {0: 0.1, 1: 2.0, 2: 5.0}
    total, over = m.reclipped_sum(contributions, bounds)
    assert over == {0: pytest.approx(0.5)}
    assert np.allclose(total[0], [0.06 + 1.0 + 3.0, 0.08 + 4.0], rtol=1e-5)
    assert m.reclipped_sum({}, {}) == ([], {})
    with pytest.raises(ValueError):  # owners with different numbers of arrays
        m.reclipped_sum({0: [np.ones(2), np.ones(1)], 1: [np.ones(2)]}, {0: 10.0, 1: 10.0})
    two = m.reclipped_sum({0: [np.ones(2), np.ones(1)]}, {0: 10.0})[0]
    assert len(two) == 2 and np.array_equal(two[1], [1.0])


def test_secure_uniform_range_moments_and_chunking(monkeypatch):
    u = m.secure_uniform(N)
    assert u.dtype == np.float64 and u.shape == (N,)
    assert u.min() > 0.0 and u.max() <= 1.0 and u.max() > 0.999
    assert abs(u.mean() - 0.5) < 0.005 and u.std() == pytest.approx(math.sqrt(1 / 12), rel=0.02)
    assert np.all(u * 2.0**53 == np.round(u * 2.0**53))  # (k + 1) / 2**53 exactly
    assert m.secure_uniform(0).shape == (0,)
    monkeypatch.setattr(m, "_URANDOM_CHUNK", 7)
    v = m.secure_uniform(50)
    assert v.shape == (50,) and v.min() > 0.0 and len(np.unique(v)) == 50
    assert m._URANDOM_CHUNK == 7


def test_secure_uniform_size_is_an_int():
    assert m.secure_uniform(np.int64(3)).shape == (3,)
    assert m.secure_uniform(3.0).shape == (3,)


@pytest.mark.parametrize("size", [1, 2, 7, N])
def test_secure_standard_normal(size):
    z = m._secure_standard_normal(size)
    assert z.shape == (size,) and z.dtype == np.float64 and np.all(np.isfinite(z))
    if size == N:
        assert abs(z.mean()) < 0.015 and z.std() == pytest.approx(1.0, rel=0.02)
        assert np.mean(np.abs(z)) == pytest.approx(math.sqrt(2 / math.pi), rel=0.02)
        half = z[: N // 2]  # the cos half and the sin half are both standard normal
        assert half.std() == pytest.approx(1.0, rel=0.03) and z[N // 2:].std() == pytest.approx(1.0, rel=0.03)
        assert abs(half.mean()) < 0.02 and abs(z[N // 2:].mean()) < 0.02


@pytest.mark.parametrize("shape", [N, (N,), (400, 500), np.int64(N)])
def test_secure_gaussian_shapes_and_std(shape):
    g = m.secure_gaussian(shape, 3.0)
    want = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    assert g.shape == want and g.dtype == np.float64
    assert g.std() == pytest.approx(3.0, rel=0.02) and abs(g.mean()) < 0.05


def test_secure_gaussian_zero_cases():
    z = m.secure_gaussian((2, 3), 0.0)
    assert z.shape == (2, 3) and z.dtype == np.float64 and not z.any()
    assert m.secure_gaussian(0, 1.0).shape == (0,)
    assert m.secure_gaussian((0, 4), 1.0).shape == (0, 4)
    assert m.secure_gaussian(1, 1.0).shape == (1,) and m.secure_gaussian(1, 1.0)[0] != 0.0


@pytest.mark.parametrize("shape", [N, (400, 500)])
def test_secure_laplace_shapes_and_scale(shape):
    lap = m.secure_laplace(shape, 2.0)
    want = (shape,) if isinstance(shape, int) else shape
    assert lap.shape == want and lap.dtype == np.float64
    assert np.mean(np.abs(lap)) == pytest.approx(2.0, rel=0.02) and abs(lap.mean()) < 0.05
    assert lap.std() == pytest.approx(2.0 * math.sqrt(2), rel=0.03)


def test_secure_laplace_zero_cases():
    z = m.secure_laplace((2, 3), 0.0)
    assert z.shape == (2, 3) and z.dtype == np.float64 and not z.any()
    assert m.secure_laplace(0, 1.0).shape == (0,)
    assert m.secure_laplace(np.int64(2), 1.0).shape == (2,)
    assert np.all(m.secure_laplace(2, 1.0) != 0.0) and m.secure_laplace(1, 0.5)[0] != 0.0


def test_seeds_and_generators():
    seeds = {m.fresh_seed() for _ in range(20)}
    assert len(seeds) == 20 and all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) > 2**58  # 63 random bits (fails with probability 20 * 2**-5... per draw: 2**-100)
    a, b = m.torch_generator(5), m.torch_generator(5)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert m.torch_generator(5).initial_seed() == 5
    assert m.torch_generator(None).initial_seed() != m.torch_generator(None).initial_seed()
    assert np.array_equal(m.numpy_rng(5).random(3), np.random.default_rng(5).random(3))
    assert not np.array_equal(m.numpy_rng(None).random(3), m.numpy_rng(None).random(3))


def test_secure_uniform_maps_53_bits_to_k_plus_one_over_2_to_53(monkeypatch):
    monkeypatch.setattr(m.os, "urandom", lambda n: b"\x00" * n)
    assert np.all(m.secure_uniform(3) == 2.0**-53)
    monkeypatch.setattr(m.os, "urandom", lambda n: b"\xff" * n)
    assert np.all(m.secure_uniform(3) == 1.0)
