"""The Gaussian sum mechanism, clipping, and the noise source.

Every DP release in flwr-jdp is "a sum of clipped contributions, one per protected
unit, plus Gaussian noise, divided by a public denominator". This module is the one
place that turns (noise multiplier, sensitivity, denominator) into a noise standard
deviation; the trainers and the server add exactly that noise, and the ledger
records ``GaussianDpEvent(noise_multiplier)`` (wrapped in the sampling of the step)
for it.

Noise source: when no seed is given, generators are seeded from the operating
system's CSPRNG (``secrets``), so noise cannot be predicted from the configuration.
A seed is used only when a test or a reproduction asks for one.
"""

from __future__ import annotations

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
class GaussianSumMechanism:
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
    """

    noise_multiplier: float
    sensitivity: float
    denominator: float = 1.0

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ValueError("noise_multiplier must be >= 0")
        if self.sensitivity <= 0:
            raise ValueError("sensitivity must be > 0")
        if self.denominator <= 0:
            raise ValueError("denominator must be > 0")

    @property
    def sum_noise_std(self) -> float:
        """Standard deviation of the noise added to the sum: ``z * S``."""
        return self.noise_multiplier * self.sensitivity

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise in the released (normalised) value."""
        return self.sum_noise_std / self.denominator

    def event(self) -> dpa.DpEvent:
        """The privacy event of one release (before any sampling)."""
        import dp_accounting as dpa

        return dpa.GaussianDpEvent(self.noise_multiplier)

    def release_torch(
        self, sums: list[torch.Tensor], generator: torch.Generator | None
    ) -> list[torch.Tensor]:
        """Noise and normalise a list of summed tensors."""
        std = self.sum_noise_std
        out = []
        for s in sums:
            noise = torch.normal(0.0, std, size=s.shape, generator=generator, dtype=s.dtype)
            out.append((s + noise) / self.denominator)
        return out

    def release_numpy(
        self, sums: list[np.ndarray], rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Noise and normalise a list of summed arrays."""
        std = self.sum_noise_std
        return [
            ((s + rng.normal(0.0, std, size=s.shape)) / self.denominator).astype(s.dtype)
            for s in sums
        ]


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
