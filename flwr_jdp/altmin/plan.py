"""Priv-AltMin's privacy plan: how the budget is split over its releases.

The run makes ``1 + 2 E`` Gaussian releases at user level (add/remove one user):
the initialisation matrix, then per epoch ``A`` and ``b`` (section 6's full-batch
variant, ``T = 1``: every epoch uses every user, so the epochs compose
sequentially). Release ``r`` gets a share ``s_r`` of the budget (``sum s_r = 1``)
and noise multiplier ``z_r = z / sqrt(s_r)``; Gaussian releases compose exactly to
one Gaussian with ``1 / z^2 = sum_r 1 / z_r^2``, i.e. ``rho = 1 / (2 z^2)``-zCDP.
``z`` is calibrated so that the PLD accountant's epsilon of the composed events is
at most the target (the same events the ledger records).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa

from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon as event_epsilon
from flwr_jdp.privacy.calibration import calibrate

EPOCH_WEIGHTS = ("even", "linear")


@dataclass(frozen=True)
class BudgetSplit:
    """Shares of the budget: ``init_share`` for the initialisation, the rest over
    epochs (``even`` or ``linear``: epoch ``e`` weighted ``e``, later epochs less
    noisy), each epoch's share split ``a_share : 1 - a_share`` between ``A`` and ``b``."""

    epochs: int
    init_share: float = 0.2
    epoch_weights: str = "even"
    a_share: float = 0.5

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if not 0.0 < self.init_share <= 1.0 or (self.epochs == 0 and self.init_share != 1.0 and False):
            raise ValueError(f"init-share must be in (0, 1], got {self.init_share}")
        if self.epochs > 0 and self.init_share >= 1.0:
            raise ValueError("init-share must be < 1 when epochs > 0")
        if self.epoch_weights not in EPOCH_WEIGHTS:
            raise ValueError(f"epoch-weights must be one of {EPOCH_WEIGHTS}, got {self.epoch_weights!r}")
        if not 0.0 < self.a_share < 1.0:
            raise ValueError(f"a-share must be in (0, 1), got {self.a_share}")

    def shares(self) -> list[float]:
        """``[init, A_1, b_1, A_2, b_2, ...]`` summing to 1."""
        if self.epochs == 0:
            return [1.0]
        raw = [1.0] * self.epochs if self.epoch_weights == "even" else [float(e + 1) for e in range(self.epochs)]
        rest = 1.0 - self.init_share
        out = [self.init_share]
        for w in raw:
            s = rest * w / sum(raw)
            out += [s * self.a_share, s * (1.0 - self.a_share)]
        return out


@dataclass(frozen=True)
class NoisePlan:
    """Noise multipliers of every release, from the overall ``z``."""

    split: BudgetSplit
    noise_multiplier: float  # z of the composed Gaussian; 0 = non-private

    def multipliers(self) -> list[float]:
        if self.noise_multiplier == 0:
            return [0.0] * len(self.split.shares())
        return [self.noise_multiplier / math.sqrt(s) for s in self.split.shares()]

    def init_multiplier(self) -> float:
        return self.multipliers()[0]

    def epoch_multipliers(self, epoch: int) -> tuple[float, float]:
        zs = self.multipliers()
        return zs[1 + 2 * epoch], zs[2 + 2 * epoch]

    def events(self) -> list[dpa.DpEvent]:
        return [dpa.GaussianDpEvent(z) for z in self.multipliers()]

    def event(self) -> dpa.DpEvent:
        return ev.compose(self.events())

    @property
    def zcdp(self) -> float:
        """``rho`` of ``rho``-zCDP: ``sum_r 1 / (2 z_r^2)`` (inf if non-private)."""
        if self.noise_multiplier == 0:
            return math.inf
        return sum(1.0 / (2.0 * z * z) for z in self.multipliers())

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        if self.noise_multiplier == 0:
            return math.inf
        return event_epsilon(self.event(), delta, accountant)


def calibrate_plan(split: BudgetSplit, target_epsilon: float, delta: float, accountant: str = "pld") -> NoisePlan:
    """The smallest overall ``z`` whose composed releases meet ``(target_epsilon, delta)``."""
    z = calibrate(target_epsilon, delta, lambda zz: NoisePlan(split, zz).event(), accountant)
    return NoisePlan(split, z)
