"""The noise mechanisms (Gaussian, symmetric Gaussian, Laplace), clipping, and the
noise source.

Every DP release in flwr-jdp is "a sum of clipped contributions, one per protected
unit, plus noise, divided by a public denominator". This module is the one place
that turns (noise multiplier, sensitivity, denominator) into a noise scale
(:class:`NoisySumMechanism`); the trainers and the servers add exactly that noise,
and the ledger records the mechanism's own event for it:
``GaussianDpEvent(noise_multiplier)`` for :class:`GaussianSumMechanism` (JointDP's
local DP-SGD and central releases, subject-level DP, the DP-MTL noisy mean, the
winsorized mean's Gaussian mode) and :class:`SymmetricGaussianMechanism`
(Priv-AltMin's Wigner-noised matrices), ``LaplaceDpEvent(noise_multiplier)`` for
:class:`LaplaceSumMechanism` (the winsorized mean's pure-DP mode), wrapped in the
sampling of the step where there is one.

Noise source: when no seed is given, generators are seeded from the operating
system's CSPRNG (``secrets``), so noise cannot be predicted from the configuration.
A seed is used only when a test or a reproduction asks for one.

Secure noise (``secure-noise = true``; :attr:`GaussianSumMechanism.secure`): every
Gaussian is drawn from bytes of the OS CSPRNG (``os.urandom``) rather than from a
seeded pseudo-random generator, in float64, and is the sum of four draws divided by
two (Opacus's ``secure_mode``, after Holohan and Braghin, arXiv:2107.10138, section
5.1, n = 2), so the set of values a noised release can take leaves no usable gaps
(the floating-point attack of arXiv:2112.05307). The noisy sum is formed in float64
and cast to the release's dtype last. See :func:`secure_gaussian`. Laplace noise in
secure mode comes from :func:`secure_laplace` (OS CSPRNG, float64).
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # imported on use: a ClientApp process never needs dp-accounting
    import dp_accounting as dpa

#: Added to norms before dividing, as Opacus does, so clipped norms stay <= C.
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class NoisySumMechanism:
    """What every mechanism of flwr-jdp states in one place: a release of
    ``(sum_i x_i + noise) / denominator`` whose noise has scale ``z * S``.

    Subclasses fix the noise law and the norm ``S`` is measured in
    (:class:`GaussianSumMechanism`, :class:`SymmetricGaussianMechanism`: L2,
    standard deviation ``z S``; :class:`LaplaceSumMechanism`: L1, Laplace scale
    ``z S``) and the ``DpEvent`` the ledger records for one release, which depends
    on ``z`` alone. Strategies build the mechanism first and take both the noise
    and the event from it, so the recorded multiplier is the one whose noise is
    added.

    Parameters
    ----------
    noise_multiplier : float
        ``z``: noise scale in units of the sensitivity.
    sensitivity : float
        ``S``: the largest change of the sum (in the subclass's norm) when one unit
        is added, removed or replaced, as the unit's neighbouring relation says.
    denominator : float
        Public normaliser (e.g. the expected number of units in the sum).
    secure : bool
        Draw the noise from the OS CSPRNG (:func:`secure_gaussian`,
        :func:`secure_laplace`) and ignore the generator passed to the release
        methods.
    unit : str
        The protected unit (``record``, ``user``, ``owner``, ``task``, ...), for
        the record; empty when the caller does not say.
    """

    noise_multiplier: float
    sensitivity: float
    denominator: float = 1.0
    secure: bool = False
    unit: str = ""

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError("noise_multiplier must be >= 0")
        if self.sensitivity <= 0:
            raise ValueError("sensitivity must be > 0")
        if self.denominator <= 0:
            raise ValueError("denominator must be > 0")

    @property
    def sum_noise_scale(self) -> float:
        """Scale of the noise added to the sum: ``z * S`` (the only place it is formed)."""
        return self.noise_multiplier * self.sensitivity

    @property
    def noise_scale(self) -> float:
        """Scale of the noise in the released (normalised) value: ``z S / denominator``."""
        return self.sum_noise_scale / self.denominator

    def event(self) -> dpa.DpEvent:
        """The privacy event of one release (before any sampling)."""
        raise NotImplementedError

    def noise_numpy(self, shape: tuple[int, ...], rng: np.random.Generator | None) -> np.ndarray:
        """float64 noise of ``shape`` for the *sum* (scale :attr:`sum_noise_scale`)."""
        raise NotImplementedError

    def release_numpy(
        self, sums: list[np.ndarray], rng: np.random.Generator | None
    ) -> list[np.ndarray]:
        """Noise and normalise a list of summed arrays (the sum in float64, cast to
        each array's dtype last)."""
        return [((np.asarray(s, dtype=np.float64) + self.noise_numpy(np.shape(s), rng))
                 / self.denominator).astype(s.dtype) for s in sums]


@dataclass(frozen=True)
class GaussianSumMechanism(NoisySumMechanism):
    """Release ``(sum_i x_i + N(0, (z * S)^2 I)) / denominator``.

    Parameters
    ----------
    noise_multiplier : float
        ``z``: noise standard deviation in units of the sensitivity.
    sensitivity : float
        ``S``: the largest L2 change of the sum when one unit is added or removed
        (the clipping norm of one unit's contribution).
    denominator : float
        Public normaliser (the expected number of units in the sum).
    secure : bool
        Draw the noise with :func:`secure_gaussian` (OS CSPRNG, float64, sum of
        four draws) and ignore the generator passed to the release methods.
    unit : str
        The protected unit, for the record (see :class:`NoisySumMechanism`).
    """

    @property
    def sum_noise_std(self) -> float:
        """Standard deviation of the noise added to the sum: ``z * S``."""
        return self.sum_noise_scale

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise in the released (normalised) value."""
        return self.sum_noise_std / self.denominator

    def event(self) -> dpa.DpEvent:
        """The privacy event of one release (before any sampling)."""
        import dp_accounting as dpa

        return dpa.GaussianDpEvent(self.noise_multiplier)

    def noise_numpy(self, shape: tuple[int, ...], rng: np.random.Generator | None) -> np.ndarray:
        """N(0, (z S)^2) noise of ``shape`` in float64 (secure: :func:`secure_gaussian`)."""
        std = self.sum_noise_std
        if self.secure:
            return secure_gaussian(shape, std)
        return rng.normal(0.0, std, size=shape)

    def release_torch(
        self, sums: list[torch.Tensor], generator: torch.Generator | None
    ) -> list[torch.Tensor]:
        """Noise and normalise a list of summed tensors."""
        std = self.sum_noise_std
        out = []
        if self.secure:  # float64 noise and sum, cast to the tensor's dtype last
            for s in sums:
                noise = torch.from_numpy(secure_gaussian(tuple(s.shape), std)).to(s.device)
                out.append(((s.detach().to(torch.float64) + noise) / self.denominator).to(s.dtype))
            return out
        for s in sums:
            # drawn on the (CPU) generator, so the noise is the same on any device
            noise = torch.normal(0.0, std, size=s.shape, generator=generator, dtype=s.dtype)
            out.append((s + noise.to(s.device)) / self.denominator)
        return out


@dataclass(frozen=True)
class SymmetricGaussianMechanism(GaussianSumMechanism):
    """Release ``(M + W) / denominator`` for a summed *symmetric* matrix ``M``.

    ``W`` is Wigner noise: i.i.d. ``N(0, (z S)^2)`` on and above the diagonal,
    mirrored below (:func:`wigner`). The released matrix is a function of its upper
    triangle, whose L2 sensitivity is at most the Frobenius sensitivity ``S`` of the
    matrix, so this is the Gaussian mechanism with multiplier ``z``: the same
    ``GaussianDpEvent(z)`` as :class:`GaussianSumMechanism`.
    """

    def noise_numpy(self, shape: tuple[int, ...], rng: np.random.Generator | None) -> np.ndarray:
        """Symmetric ``shape = (n, n)`` Wigner noise of entry std ``z S`` (float64)."""
        if len(shape) != 2 or shape[0] != shape[1]:
            raise ValueError(f"a symmetric release needs a square matrix, got shape {tuple(shape)}")
        return wigner(shape[0], self.sum_noise_std, rng, secure=self.secure)

    def release_torch(self, sums: list[torch.Tensor], generator: torch.Generator | None) -> list[torch.Tensor]:
        raise NotImplementedError("SymmetricGaussianMechanism releases numpy matrices (release_numpy)")


@dataclass(frozen=True)
class LaplaceSumMechanism(NoisySumMechanism):
    """Release ``(sum_i x_i + Lap(z * S)^d) / denominator``: pure DP.

    ``S`` is the largest **L1** change of the sum when one unit changes; the noise
    is i.i.d. Laplace with scale ``b = z S`` per coordinate (standard deviation
    ``sqrt(2) b``), and one release is ``LaplaceDpEvent(z)`` (epsilon ``1 / z``).
    ``secure``: the noise comes from :func:`secure_laplace` (OS CSPRNG).
    """

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise in the released value: ``sqrt(2) z S / denominator``."""
        return math.sqrt(2.0) * self.noise_scale

    def event(self) -> dpa.DpEvent:
        """The privacy event of one release: ``LaplaceDpEvent(z)``."""
        import dp_accounting as dpa

        return dpa.LaplaceDpEvent(self.noise_multiplier)

    def noise_numpy(self, shape: tuple[int, ...], rng: np.random.Generator | None) -> np.ndarray:
        """Laplace noise of scale ``z S`` and ``shape`` in float64."""
        scale = self.sum_noise_scale
        if self.secure:
            return secure_laplace(shape, scale)
        return rng.laplace(0.0, scale, size=shape)


def wigner(size: int, std: float, rng: np.random.Generator | None, secure: bool = False) -> np.ndarray:
    """Symmetric ``size x size`` matrix with i.i.d. ``N(0, std^2)`` entries on and
    above the diagonal (mirrored below); ``secure``: from :func:`secure_gaussian`."""
    draws = secure_gaussian((size, size), std) if secure else rng.normal(0.0, std, size=(size, size))
    upper = np.triu(draws)
    return upper + np.triu(upper, 1).T


def clip_coefficients(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per-row factors ``min(1, C / (norm + 1e-6))`` (norm after scaling <= C)."""
    return (max_norm / (norms + CLIP_EPS)).clamp(max=1.0)


def global_norm_numpy(arrays: list[np.ndarray]) -> float:
    """L2 norm of the concatenation of ``arrays``."""
    return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)))


def clip_numpy(arrays: list[np.ndarray], max_norm: float) -> list[np.ndarray]:
    """Scale ``arrays`` jointly so that their global L2 norm is at most ``max_norm``."""
    norm = global_norm_numpy(arrays)
    factor = min(1.0, max_norm / (norm + CLIP_EPS))
    return [(a * factor).astype(a.dtype) for a in arrays]


def clip_float64(arrays: list[np.ndarray], max_norm: float) -> list[np.ndarray]:
    """:func:`clip_numpy` in float64: the arrays as float64, scaled jointly by
    ``min(1, max_norm / (norm + 1e-6))``, so their global norm is at most
    ``max_norm`` without a float32 rounding on top (the server's re-clip)."""
    wide = [np.asarray(a, dtype=np.float64) for a in arrays]
    norm = global_norm_numpy(wide)
    factor = min(1.0, max_norm / (norm + CLIP_EPS))
    return [a * factor for a in wide]


def reclipped_sum(contributions: dict[int, list[np.ndarray]],
                  bounds: dict[int, float]) -> tuple[list[np.ndarray], dict[int, float]]:
    """The float64 sum over owners ``o`` of ``contributions[o]`` re-clipped jointly
    to L2 norm ``bounds[o]`` (:func:`clip_float64`); also each owner whose norm was
    above its bound, with that norm (for the server's log).

    Clipping to a fixed radius is the projection onto a ball up to the 1e-6 guard,
    a radial map ``x -> phi(|x|) x / |x|`` with ``phi`` non-decreasing, 1-Lipschitz
    and ``phi(r) <= r``, hence non-expansive: it never increases the distance
    between two contributions, so whatever bound a unit's change of ``x`` has, it
    keeps after the re-clip."""
    total: list[np.ndarray] | None = None
    over: dict[int, float] = {}
    for o in sorted(contributions):
        arrays = contributions[o]
        norm = global_norm_numpy(arrays)
        if norm > bounds[o]:
            over[o] = norm
        clipped = clip_float64(arrays, bounds[o])
        total = clipped if total is None else [t + c for t, c in zip(total, clipped, strict=True)]
    return total or [], over


#: Values drawn per ``os.urandom`` call in :func:`secure_uniform` (bounds memory).
_URANDOM_CHUNK = 1 << 20


def secure_uniform(size: int) -> np.ndarray:
    """``size`` float64 uniforms on ``(0, 1]`` from the OS CSPRNG: 53 random bits
    ``k`` each (from ``os.urandom``), returned as ``(k + 1) / 2**53`` (exact)."""
    out = np.empty(int(size), dtype=np.float64)
    for start in range(0, out.size, _URANDOM_CHUNK):
        n = min(_URANDOM_CHUNK, out.size - start)
        bits = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
        out[start:start + n] = (bits.astype(np.float64) + 1.0) * 2.0**-53
    return out


def _secure_standard_normal(size: int) -> np.ndarray:
    """``size`` standard normals by Box-Muller on :func:`secure_uniform` pairs."""
    pairs = (int(size) + 1) // 2
    u = secure_uniform(2 * pairs)
    radius = np.sqrt(-2.0 * np.log(u[:pairs]))
    angle = 2.0 * np.pi * u[pairs:]
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[: int(size)]


def secure_gaussian(shape: tuple[int, ...] | int, std: float) -> np.ndarray:
    """N(0, std^2) noise of ``shape`` in float64, from the OS CSPRNG.

    Each value is ``(g_1 + g_2 + g_3 + g_4) * std / 2`` with four independent
    standard normals (Box-Muller on 53-bit uniforms from ``os.urandom``): exactly
    N(0, std^2) in real arithmetic, and in floating point the sum of four draws
    fills the gaps between representable outputs that a single Box-Muller draw
    leaves (Holohan and Braghin, arXiv:2107.10138, section 5.1; Opacus's
    ``secure_mode`` uses the same sum). No generator state exists, so nothing can
    be predicted from earlier draws or from a seed.
    """
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    if std == 0.0 or size == 0:
        return np.zeros(shape, dtype=np.float64)
    draws = _secure_standard_normal(4 * size).reshape(4, size)
    return (draws.sum(axis=0) * (float(std) / 2.0)).reshape(shape)


def secure_laplace(shape: tuple[int, ...] | int, scale: float) -> np.ndarray:
    """Laplace(0, scale) noise of ``shape`` in float64, from the OS CSPRNG.

    Each value is ``scale * (log u_1 - log u_2)`` with ``u_1, u_2`` independent
    53-bit uniforms on ``(0, 1]`` from ``os.urandom`` (:func:`secure_uniform`):
    ``-log u`` is Exp(1), and the difference of two independent Exp(1) is a
    standard Laplace. No generator state exists, so nothing can be predicted from
    a seed or from earlier draws. (This removes the predictability of a seeded
    generator; it is not the snapping mechanism, and does not claim to close every
    floating-point gap of Mironov 2012.)
    """
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    if scale == 0.0 or size == 0:
        return np.zeros(shape, dtype=np.float64)
    u = secure_uniform(2 * size)
    return ((np.log(u[:size]) - np.log(u[size:])) * float(scale)).reshape(shape)

def fresh_seed() -> int:
    """A 63-bit seed from the OS CSPRNG."""
    return secrets.randbits(63)


def torch_generator(seed: int | None) -> torch.Generator:
    """A torch generator; seeded from the CSPRNG unless ``seed`` is given."""
    gen = torch.Generator()
    gen.manual_seed(fresh_seed() if seed is None else int(seed))
    return gen


def numpy_rng(seed: int | None) -> np.random.Generator:
    """A numpy generator; seeded from the CSPRNG unless ``seed`` is given."""
    return np.random.default_rng(fresh_seed() if seed is None else int(seed))
