"""The Gaussian releases of Priv-AltMin and their ledger events.

Every release adds noise of standard deviation ``z * S`` to a sum whose L2
sensitivity (user level, add/remove one user) is ``S``; the ledger records
``GaussianDpEvent(z)`` for it. A symmetric matrix is released with *Wigner* noise:
i.i.d. ``N(0, (z S)^2)`` on the upper triangle including the diagonal, mirrored
below. The released matrix is a function of its upper triangle, whose L2
sensitivity is at most the Frobenius sensitivity ``S`` of the matrix, so this is
the Gaussian mechanism with multiplier ``z``.

The noise and the event come from one mechanism object of
:mod:`flwr_jdp.privacy.mechanisms` (:class:`GaussianSumMechanism` for a vector,
:class:`SymmetricGaussianMechanism` for a symmetric matrix; unit: user):
:class:`GaussianRelease` only names the release and skips the draw when ``z = 0``.

Replace-one adjacency (the paper's) changes a sum by up to ``2 S`` in general; pass
``2 S`` as the sensitivity to protect against replacement.
"""

from __future__ import annotations

from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, SymmetricGaussianMechanism, wigner


@dataclass(frozen=True)
class GaussianRelease:
    """``sum + N(0, (z S)^2)`` per entry (vector) or per upper-triangle entry
    (``symmetric``), through :attr:`mechanism`; ``secure``: noise from the OS CSPRNG."""

    noise_multiplier: float
    sensitivity: float
    symmetric: bool = False
    secure: bool = False

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError("noise multiplier must be >= 0")
        if self.sensitivity <= 0 or not np.isfinite(self.sensitivity):
            raise ValueError("sensitivity must be a positive finite number")

    @property
    def mechanism(self) -> GaussianSumMechanism:
        """The mechanism that adds this release's noise and states its event."""
        kind = SymmetricGaussianMechanism if self.symmetric else GaussianSumMechanism
        return kind(float(self.noise_multiplier), float(self.sensitivity), 1.0, secure=self.secure, unit="user")

    @property
    def std(self) -> float:
        return self.mechanism.sum_noise_std

    def event(self) -> dpa.DpEvent:
        return self.mechanism.event()

    def noise(self, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        return self.mechanism.noise_numpy(shape, rng)

    def release(self, total: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.noise_multiplier == 0:
            return np.array(total, dtype=np.float64)
        return self.mechanism.release_numpy([np.asarray(total, dtype=np.float64)], rng)[0]


__all__ = ["GaussianRelease", "wigner"]
