"""User-level private mean by winsorization (Levy et al., "Learning with User-Level
Privacy", section 3: Algorithms 1-3).

Unit of privacy: the **user**. Each of ``n`` users is summarised by the average of
its own ``m`` samples (one vector per user); neighbouring data sets replace one
user's vector (``n`` is public). Two releases, both recorded as DpEvents:

1. *Range* (Algorithm 1, private approximate median). Every coordinate's range
   ``[-B, B]`` is cut into bins of width ``tau``; the users' values are counted per
   bin and noise is added to every count: Laplace with scale ``b`` (pure DP;
   replacing one user moves ``2d`` counts by one, L1 sensitivity ``2d``: event
   ``Laplace(b / 2d)``) or Gaussian with std ``s`` (L2 sensitivity ``sqrt(2d)``:
   event ``Gaussian(s / sqrt(2d))``). The centre ``c`` of the noisy-argmax bin is
   post-processing. If the users' values lie within ``tau`` of their mean, the
   fullest bin overlaps that interval, so every value lies within
   ``tau + tau + tau / 2 = 2.5 tau`` of ``c``; we winsorize to ``c +- 2.5 tau``
   (radius ``RADIUS_FACTOR * tau``).
2. *Mean* (Algorithm 2). The users' values are clipped to ``[c - r, c + r]``,
   ``r = 2.5 tau``, per coordinate and averaged; replacing one user moves the
   average by at most ``2r / n`` per coordinate (L1 ``2rd / n``, L2
   ``2r sqrt(d) / n``).
   Laplace noise (pure) or Gaussian noise (approximate) is scaled to that.

In dimension ``d > 1`` (Algorithm 3) the vectors are first rotated by a randomized
Hadamard transform ``R = H D / sqrt(d')`` (random signs ``D``, public randomness,
zero-padding to ``d' = 2^k``): an L2 radius ``tau`` becomes a per-coordinate radius
``tau_inf = min(tau, tau * sqrt(2 log(2 n d' / beta) / d'))`` with probability
``1 - beta`` (a coordinate never deviates more than the whole vector), so the
per-coordinate noise scales with ``tau_inf`` instead of ``tau``. The
estimate is rotated back (``R`` is orthogonal).

The baseline :func:`clipped_gaussian_mean` clips every user's vector to the full
range (L2 norm ``B``) and adds Gaussian noise for sensitivity ``2 B / n`` — noise
that does not shrink as the users' own averages concentrate (``m`` grows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, LaplaceSumMechanism

#: Winsorization radius in units of the concentration radius tau (see above).
RADIUS_FACTOR = 2.5


# ---------------------------------------------------------------- rotation
def hadamard(x: np.ndarray) -> np.ndarray:
    """Unnormalised fast Walsh-Hadamard transform along the last axis (length 2^k)."""
    y = np.array(x, dtype=np.float64, copy=True)
    d = y.shape[-1]
    if d & (d - 1):
        raise ValueError(f"length must be a power of two, got {d}")
    h = 1
    while h < d:
        y = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        y = y.reshape(*y.shape[:-3], d)
        h *= 2
    return y


@dataclass(frozen=True)
class RandomRotation:
    """``R x = H D pad(x) / sqrt(d')``: orthogonal, data-independent."""

    signs: np.ndarray  # +-1, length d' (a power of two)
    dim: int  # original dimension d

    @classmethod
    def create(cls, dim: int, rng: np.random.Generator) -> RandomRotation:
        padded = 1 << max(0, math.ceil(math.log2(max(1, dim))))
        return cls(rng.choice(np.array([-1.0, 1.0]), size=padded), dim)

    @property
    def padded(self) -> int:
        return len(self.signs)

    def apply(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(x)
        pad = np.zeros((x.shape[0], self.padded))
        pad[:, : self.dim] = x
        return hadamard(pad * self.signs) / math.sqrt(self.padded)

    def invert(self, y: np.ndarray) -> np.ndarray:
        y = np.atleast_2d(y)
        return (hadamard(y) / math.sqrt(self.padded) * self.signs)[:, : self.dim]


def rotated_radius(tau: float, n: int, padded_dim: int, beta: float) -> float:
    """Per-coordinate radius after rotation of an L2 radius ``tau`` (prob. 1 - beta)."""
    if padded_dim <= 1:
        return tau
    return min(tau, tau * math.sqrt(2.0 * math.log(2.0 * n * padded_dim / beta) / padded_dim))


# ---------------------------------------------------------------- estimator
@dataclass(frozen=True)
class WinsorizedMean:
    """The user-level estimator and its privacy parameters.

    Parameters
    ----------
    bound : float
        ``B``: every user's value lies in ``[-B, B]`` per coordinate (scalar) or has
        L2 norm at most ``B`` (vectors).
    tau : float
        Concentration radius of the users' averages around their mean (L2).
    range_noise, mean_noise : float
        Noise multipliers (noise scale / sensitivity) of the two releases.
    kind : str
        ``"gaussian"`` (approximate DP) or ``"laplace"`` (pure DP).
    rotate : bool
        Apply the randomized Hadamard rotation (Algorithm 3) for ``d > 1``.
    beta : float
        Failure probability used for the rotated radius.
    secure : bool
        Draw the noise of both releases from the OS CSPRNG (the rotation's signs
        are public randomness and still come from the generator).

    Both releases are mechanisms of :mod:`flwr_jdp.privacy.mechanisms`
    (:meth:`range_mechanism`, :meth:`mean_mechanism`: unit, sensitivity and noise
    in one place); :meth:`events` are those mechanisms' events.
    """

    bound: float
    tau: float
    range_noise: float
    mean_noise: float
    kind: str = "gaussian"
    rotate: bool = True
    beta: float = 0.01
    secure: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("gaussian", "laplace"):
            raise ValueError(f"kind must be 'gaussian' or 'laplace', got {self.kind!r}")
        for name in ("bound", "tau", "range_noise", "mean_noise"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def _mechanism(self, noise_multiplier: float, l1: float, l2: float,
                   denominator: float) -> GaussianSumMechanism | LaplaceSumMechanism:
        """Laplace with L1 sensitivity ``l1`` or Gaussian with L2 sensitivity ``l2``."""
        if self.kind == "laplace":
            return LaplaceSumMechanism(noise_multiplier, l1, denominator, secure=self.secure, unit="user")
        return GaussianSumMechanism(noise_multiplier, l2, denominator, secure=self.secure, unit="user")

    def range_mechanism(self, dims: int) -> GaussianSumMechanism | LaplaceSumMechanism:
        """Release 1: the ``(dims, bins)`` counts. Replacing one user moves ``2 dims``
        counts by one: L1 sensitivity ``2 dims``, L2 ``sqrt(2 dims)``."""
        return self._mechanism(self.range_noise, 2.0 * dims, math.sqrt(2.0 * dims), 1.0)

    def mean_mechanism(self, radius: float, dims: int, n: int) -> GaussianSumMechanism | LaplaceSumMechanism:
        """Release 2: the sum of ``n`` users' values winsorized to ``centre +- radius``
        per coordinate, divided by ``n``. Replacing one user moves each coordinate of
        the sum by at most ``width = 2 radius``: L1 ``width dims``, L2 ``width sqrt(dims)``."""
        width = 2.0 * radius
        return self._mechanism(self.mean_noise, width * dims, width * math.sqrt(dims), float(n))

    def events(self) -> list[dpa.DpEvent]:
        """The two releases as DpEvents: the events of :meth:`range_mechanism` and
        :meth:`mean_mechanism`, which depend on the noise multipliers only (the
        sensitivities scale the noise, not the event)."""
        return [self.range_mechanism(1).event(), self.mean_mechanism(1.0, 1, 1).event()]

    def event(self) -> dpa.DpEvent:
        """Both releases composed: what one estimate costs (user level)."""
        return ev.compose(self.events())

    def estimate(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Private mean of the users' ``values`` (shape ``(n,)`` or ``(n, d)``)."""
        x = np.asarray(values, dtype=np.float64)
        if len(x) == 0:  # before the reshape, which cannot infer a width from no rows
            raise ValueError("no users")
        scalar = x.ndim == 1
        x = x.reshape(len(x), -1)
        n, d = x.shape
        rotation = None
        tau, bound = self.tau, self.bound
        if d > 1 and self.rotate:
            rotation = RandomRotation.create(d, rng)
            x = rotation.apply(x)
            tau = rotated_radius(self.tau, n, rotation.padded, self.beta)
        dims = x.shape[1]
        centre = self._range(x, bound, tau, rng)
        radius = RADIUS_FACTOR * tau
        total = clipped_sum(x, centre, radius)
        mean = self.mean_mechanism(radius, dims, n).release_numpy([total], rng)[0]
        if rotation is not None:
            mean = rotation.invert(mean)[0]
        return mean[0] if scalar else mean

    def _range(self, x: np.ndarray, bound: float, tau: float, rng: np.random.Generator) -> np.ndarray:
        """Noisy-histogram approximate median per coordinate (Algorithm 1)."""
        edges, counts = histogram(x, bound, tau)
        counts = self.range_mechanism(counts.shape[0]).release_numpy([counts], rng)[0]
        best = counts.argmax(axis=1)
        return 0.5 * (edges[best] + edges[best + 1])


def histogram(x: np.ndarray, bound: float, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """Bin edges over ``[-B, B]`` (width ``tau``) and per-coordinate counts of the
    users' values, shape ``(d, bins)``. Each user adds one to one bin per
    coordinate, so replacing a user changes the counts by at most ``2d`` in L1 and
    ``sqrt(2d)`` in L2."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    dims = x.shape[1]
    edges = np.arange(-bound, bound + tau, tau)
    if len(edges) < 2:
        edges = np.array([-bound, bound])
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, np.clip(x, -bound, bound), side="right") - 1, 0, bins - 1)
    counts = np.zeros((dims, bins))
    np.add.at(counts, (np.broadcast_to(np.arange(dims), idx.shape), idx), 1.0)
    return edges, counts


def clipped_sum(x: np.ndarray, centre: np.ndarray, radius: float) -> np.ndarray:
    """Per-coordinate winsorized sum: values clipped to ``centre +- radius``.
    Replacing one user moves it by at most ``2 radius`` per coordinate."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    return np.clip(x, centre - radius, centre + radius).sum(axis=0)


def clipped_average(x: np.ndarray, centre: np.ndarray, radius: float) -> np.ndarray:
    """Per-coordinate winsorized average: values clipped to ``centre +- radius``.
    Replacing one of ``n`` users moves it by at most ``2 radius / n`` per coordinate."""
    return clipped_sum(x, centre, radius) / len(x)


def clipped_gaussian_mean(values: np.ndarray, bound: float, noise_multiplier: float,
                          rng: np.random.Generator) -> np.ndarray:
    """Baseline: clip every user's vector to L2 norm ``bound`` (the full range),
    average, add N(0, (z * 2B / n)^2) per coordinate. One ``Gaussian(z)`` event
    at user level (replace-one sensitivity ``2B / n``)."""
    x = np.asarray(values, dtype=np.float64)
    scalar = x.ndim == 1
    x = x.reshape(len(x), -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x * np.minimum(1.0, bound / np.maximum(norms, 1e-300))
    mech = GaussianSumMechanism(noise_multiplier, 2.0 * bound, float(len(x)), unit="user")
    mean = mech.release_numpy([x.sum(axis=0)], rng)[0]
    return mean[0] if scalar else mean


__all__ = ["RADIUS_FACTOR", "RandomRotation", "WinsorizedMean", "clipped_average",
           "clipped_gaussian_mean", "clipped_sum", "hadamard", "histogram", "rotated_radius"]
