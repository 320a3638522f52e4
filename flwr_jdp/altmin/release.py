"""The Gaussian releases of Priv-AltMin and their ledger events (one place).

Every release adds noise of standard deviation ``z * S`` to a sum whose L2
sensitivity (user level, add/remove one user) is ``S``; the ledger records
``GaussianDpEvent(z)`` for it. A symmetric matrix is released with *Wigner* noise:
i.i.d. ``N(0, (z S)^2)`` on the upper triangle including the diagonal, mirrored
below. The released matrix is a function of its upper triangle, whose L2
sensitivity is at most the Frobenius sensitivity ``S`` of the matrix, so this is
the Gaussian mechanism with multiplier ``z``.

Replace-one adjacency (the paper's) changes a sum by up to ``2 S`` in general; pass
``2 S`` as the sensitivity to protect against replacement.
"""

from __future__ import annotations

from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np


@dataclass(frozen=True)
class GaussianRelease:
    """``sum + N(0, (z S)^2)`` per entry (vector) or per upper-triangle entry (``symmetric``)."""

    noise_multiplier: float
    sensitivity: float
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError("noise multiplier must be >= 0")
        if self.sensitivity <= 0 or not np.isfinite(self.sensitivity):
            raise ValueError("sensitivity must be a positive finite number")

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def event(self) -> dpa.DpEvent:
        return dpa.GaussianDpEvent(float(self.noise_multiplier))

    def noise(self, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if not self.symmetric:
            return rng.normal(0.0, self.std, size=shape)
        return wigner(shape[0], self.std, rng)

    def release(self, total: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.noise_multiplier == 0:
            return np.array(total, dtype=np.float64)
        return np.asarray(total, dtype=np.float64) + self.noise(total.shape, rng)


def wigner(size: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Symmetric matrix with i.i.d. ``N(0, std^2)`` entries on and above the diagonal."""
    upper = np.triu(rng.normal(0.0, std, size=(size, size)))
    return upper + np.triu(upper, 1).T
