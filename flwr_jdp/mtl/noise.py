"""The noisy-mean release of DP-MTL and its two calibrations.

The mechanism (Algorithm 1, line 8)
    Each round the aggregator releases ``w~ = S / D + N(0, sigma^2 I_d)`` where
    ``S`` is the sum of the (ball-projected, ``||w_k|| <= B``) models of the tasks
    that took part and ``D = q m`` is a fixed denominator (``m`` tasks, each taking
    part with probability ``q``; ``q = 1``: every task, every round).

Unit and sensitivity
    The unit is one task's *whole data set* (task-level / owner-level joint DP).
    Whatever a task's data, its model lies in the ball, so one task moves ``S`` by
    at most ``B`` when it is added or removed (``add-remove``) and by at most ``2 B``
    when its data are replaced (``replace-one``, the neighbouring relation of the
    JDP definition the paper uses). The mean's sensitivity is that divided by
    ``D``: ``2B/m`` under replace-one, ``B/m`` under add/remove, with ``q = 1``.
    Every release is recorded as a dp-accounting ``GaussianDpEvent`` with noise
    multiplier ``z = sigma D / B`` (relative to the add/remove sensitivity ``B``;
    the ledger's ``neighbouring`` relation says whether ``2 B`` applies), wrapped in
    ``PoissonSampledDpEvent(q, .)`` when tasks are sampled.

Calibration modes
    ``paper``  Theorem 2: ``alpha = 4 log(1/delta)/epsilon`` and
               ``sigma = 8 B sqrt(T log(1/delta)) / (epsilon m)``, replace-one, every
               task every round. The paper's Lemma 1 states the Gaussian
               mechanism's RDP as ``2 alpha Delta^2 / sigma^2``, four times the exact
               ``alpha Delta^2 / (2 sigma^2)`` (Mironov 2017, Prop. 7), so Theorem 1
               reads ``2 alpha sum_t (2B)^2 / (m sigma)^2``. In this mode the ledger
               records the release *as the paper accounts it*: a Gaussian with half
               the true noise multiplier, whose RDP is exactly Theorem 1's value
               (conservative; :attr:`MeanRelease.exact_event` is the true one).
    ``tight``  The exact event above, calibrated by PLD (bisection on the noise
               multiplier) so that ``T`` releases reach the target epsilon, with
               subsampling amplification when ``q < 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting as dpa

from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon as event_epsilon
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism

CALIBRATIONS = ("paper", "tight")


def paper_alpha(eps: float, delta: float) -> float:
    """Theorem 2's Renyi order ``alpha = 4 log(1/delta) / epsilon``."""
    return 4.0 * math.log(1.0 / delta) / eps


def paper_sigma(eps: float, delta: float, radius: float, rounds: int, num_tasks: int) -> float:
    """Theorem 2's noise std on the mean: ``8 B sqrt(T log(1/delta)) / (epsilon m)``."""
    return 8.0 * radius * math.sqrt(rounds * math.log(1.0 / delta)) / (eps * num_tasks)


def theorem1_rdp(order: float, radius: float, num_tasks: int, sigma: float, rounds: int) -> float:
    """Theorem 1's RDP of ``T`` releases at ``order``:
    ``2 alpha T (max_j Delta h_j)^2 / (m sigma)^2`` with ``Delta h_j = 2 B``."""
    return 2.0 * order * rounds * (2.0 * radius) ** 2 / (num_tasks * sigma) ** 2


def theorem2_epsilon(eps: float, delta: float, radius: float, rounds: int, num_tasks: int,
                     sigma: float) -> float:
    """The epsilon Theorem 2's proof certifies for ``sigma``: Theorem 1's RDP at
    ``alpha`` plus the RDP-to-DP term ``log(1/delta)/(alpha - 1)`` (Lemma 2)."""
    alpha = paper_alpha(eps, delta)
    return theorem1_rdp(alpha, radius, num_tasks, sigma, rounds) + math.log(1.0 / delta) / (alpha - 1.0)


@dataclass(frozen=True)
class MeanRelease:
    """One round's noisy mean: unit, sensitivity and noise in one place.

    ``sigma`` is the noise std per coordinate of the released *mean*; ``radius`` is
    ``B``; ``sample_rate`` is ``q``; ``relation`` is ``replace-one`` or
    ``add-remove``; ``mode`` says how the ledger accounts it (see module doc)."""

    radius: float
    num_tasks: int
    sample_rate: float
    sigma: float
    relation: str = "replace-one"
    mode: str = "tight"

    @property
    def denominator(self) -> float:
        """``D = q m``: the fixed denominator of the mean."""
        return self.sample_rate * self.num_tasks

    @property
    def sum_sensitivity(self) -> float:
        """L2 sensitivity of the sum of models: ``2B`` (replace-one) or ``B``."""
        return (2.0 if self.relation == "replace-one" else 1.0) * self.radius

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the mean: ``sum_sensitivity / D``."""
        return self.sum_sensitivity / self.denominator

    @property
    def noise_multiplier(self) -> float:
        """``z = sigma D / B``: noise std over the add/remove sensitivity of the sum."""
        return self.sigma * self.denominator / self.radius

    def mechanism(self, secure: bool = False) -> GaussianSumMechanism:
        """The release as a mechanism (unit: one task): the sum of ball-projected
        models, sensitivity ``B`` (add/remove; the ledger's relation says whether
        ``2 B`` applies), noise ``N(0, (z B)^2 I)``, divided by ``D``; its noise std
        on the mean is ``z B / D = sigma``. :class:`MeanServer` adds this noise and
        :meth:`exact_event` is this mechanism's event."""
        return GaussianSumMechanism(self.noise_multiplier, self.radius, self.denominator,
                                    secure=secure, unit="task")

    def exact_event(self) -> dpa.DpEvent:
        """The release as it is (one round): :meth:`mechanism`'s event."""
        inner = self.mechanism().event()
        if self.sample_rate < 1.0:
            inner = dpa.PoissonSampledDpEvent(float(self.sample_rate), inner)
        return inner

    def event(self) -> dpa.DpEvent:
        """The release as the ledger records it: :meth:`exact_event` in ``tight``
        mode; in ``paper`` mode the Gaussian with half the multiplier, whose RDP is
        Theorem 1's (the paper's Lemma 1 constant)."""
        if self.mode == "paper":
            return ev.gaussian(self.mechanism().noise_multiplier / 2.0)
        return self.exact_event()

    def epsilon(self, rounds: int, delta: float, accountant: str = "pld", exact: bool = False) -> float:
        """Epsilon of ``rounds`` releases at ``delta`` (as recorded, or exact)."""
        if self.sigma <= 0:
            return math.inf
        one = self.exact_event() if exact else self.event()
        event = dpa.SelfComposedDpEvent(one, int(rounds)) if rounds > 1 else one
        return event_epsilon(event, delta, accountant, self.relation)


def tight_sigma(eps: float, delta: float, radius: float, rounds: int, num_tasks: int,
                sample_rate: float = 1.0, relation: str = "replace-one", accountant: str = "pld") -> float:
    """Smallest noise std on the mean such that ``rounds`` exact releases are
    ``(eps, delta)``-DP by ``accountant`` under ``relation`` (PLD: tight)."""
    def events(z: float) -> dpa.DpEvent:
        rel = MeanRelease(radius, num_tasks, sample_rate, z * radius / (sample_rate * num_tasks), relation)
        one = rel.exact_event()
        return dpa.SelfComposedDpEvent(one, int(rounds)) if rounds > 1 else one
    z = calibrate(eps, delta, events, accountant, relation=relation)
    return z * radius / (sample_rate * num_tasks)


def plan_release(eps: float, delta: float, radius: float, rounds: int, num_tasks: int,
                 sample_rate: float = 1.0, relation: str = "replace-one", mode: str = "tight",
                 accountant: str = "pld") -> MeanRelease:
    """The release each round uses for a target ``(eps, delta)`` over ``rounds``;
    ``eps = inf``: no noise (non-private mean-regularized MTL)."""
    if mode not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {mode!r}")
    if math.isinf(eps):
        return MeanRelease(radius, num_tasks, sample_rate, 0.0, relation, mode)
    if mode == "paper":
        if sample_rate < 1.0 or relation != "replace-one":
            raise ValueError("calibration 'paper' is Theorem 2: every task every round "
                             "(fraction-train = 1) under replace-one")
        sigma = paper_sigma(eps, delta, radius, rounds, num_tasks)
    else:
        sigma = tight_sigma(eps, delta, radius, rounds, num_tasks, sample_rate, relation, accountant)
    return MeanRelease(radius, num_tasks, sample_rate, sigma, relation, mode)


__all__ = ["CALIBRATIONS", "MeanRelease", "paper_alpha", "paper_sigma", "plan_release",
           "theorem1_rdp", "theorem2_epsilon", "tight_sigma"]
