"""The distributed Skellam mechanism: integer noise that owners add in shares and
secure aggregation sums (``noise-placement = "distributed"``).

Unit, sensitivity, noise, in one place
    Unit: one record (or one user) of one owner, as under central noise. Each unit's
    clipped gradient ``g_u`` (``||g_u||_2 <= C``) is scaled by ``gamma`` and rounded
    to an integer vector ``R_u`` by *conditional randomized rounding*: each
    coordinate is rounded up with probability equal to its fractional part, and the
    rounding is drawn again until ``||R_u||_2 <= delta_2``, where
    ``delta_2 = sqrt((gamma C)^2 + d/4 + sqrt(2 ln(1/beta)) (gamma C + sqrt(d)/2))``
    (Kairouz, Liu, Steinke 2021, Lemma for randomized rounding; after 100 failed
    draws, with probability below ``beta^100``, the unit contributes zero). An
    integer vector has ``||R_u||_1 <= min(||R_u||_2^2, sqrt(d) ||R_u||_2)``, so adding
    or removing one unit moves the integer sum by at most ``delta_2`` in L2 and
    ``delta_1 = min(delta_2^2, sqrt(d) delta_2)`` in L1, whatever the rounding draws
    were (the released distribution is a mixture of shifts within those bounds, and
    Renyi divergence is jointly quasi-convex).
    Noise: owner ``i`` adds ``Sk(mu_i)`` (``Poisson(mu_i) - Poisson(mu_i)``, each
    coordinate); Skellam noise is closed under summation, so the survivors' shares
    sum to ``Sk(sum_i mu_i)``. Shares are planned so that the honest survivors alone
    (at least ``min-survivors - colluding-owners`` owners) bring ``mu = (z delta_2)^2
    / 2``: the noise's variance is ``2 mu = (z delta_2)^2``, the central
    mechanism's ``(z C)^2`` in units of the scaled gradient.
    Accounting: the multi-dimensional Skellam mechanism is ``(alpha, eps(alpha))``-RDP
    for integer ``alpha > 1`` with ``eps(alpha) = alpha delta_2^2 / (4 mu) +
    min(((2 alpha - 1) delta_2^2 + 6 delta_1) / (16 mu^2), 3 delta_1 / (4 mu))``
    (Agarwal, Kairouz, Liu, NeurIPS 2021, Theorem 3.5); Poisson sampling at rate ``q``
    uses Zhu and Wang's general upper bound for Poisson-subsampled RDP (ICML 2019,
    Theorem 6), valid for any base mechanism. Conservative: RDP is used for these
    events whichever accountant the run names (no PLD of the subsampled Skellam
    mechanism is known in closed form), and only integer orders are used.
    Modular arithmetic: the sum is computed modulo ``M = 2**31`` (Flower's SecAgg+
    quantises to int32); a coordinate wraps only if ``|signal + noise| >= M/2``,
    whose probability :func:`wrap_probability` bounds and the run logs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import attr
import dp_accounting as dpa
import numpy as np
from scipy.special import gammaln, logsumexp

#: The modulus of the secure sum (values are int32 in Flower's SecAgg+ client mod).
MODULUS = 2**31
#: The largest scaled clipping norm ``gamma C`` (rounding error is then negligible).
MAX_SCALED_NORM = 2.0**16
#: The probability that one randomized rounding exceeds the bound ``delta_2`` (only
#: how often a rounding is drawn again; privacy does not depend on it).
ROUNDING_BETA = 1e-3
#: Integer Renyi orders used for the Skellam events.
ORDERS = tuple(range(2, 257))
#: Draws of a unit's rounding before it contributes zero instead.
MAX_ROUNDING_DRAWS = 100


@attr.define(frozen=True)
class SkellamDpEvent(dpa.DpEvent):
    """One release of an integer sum with L2 / L1 sensitivities ``l2_sensitivity`` /
    ``l1_sensitivity`` plus ``Sk(mu)`` noise in every coordinate (variance ``2 mu``)."""

    l2_sensitivity: float
    l1_sensitivity: float
    mu: float


def skellam_rdp(alpha: int, l2: float, l1: float, mu: float) -> float:
    """Agarwal, Kairouz and Liu's RDP bound of the multi-dimensional Skellam mechanism."""
    if mu <= 0:
        return math.inf
    head = alpha * l2 * l2 / (4.0 * mu)
    tail = min(((2 * alpha - 1) * l2 * l2 + 6.0 * l1) / (16.0 * mu * mu), 3.0 * l1 / (4.0 * mu))
    return head + tail


def subsampled_rdp(q: float, base: list[float], alpha: int) -> float:
    """Zhu and Wang's general upper bound (ICML 2019, Theorem 6) on the RDP of order
    ``alpha`` (an integer >= 2) of a mechanism run on a Poisson sample at rate ``q``,
    from the base mechanism's RDP ``base[l]`` at orders ``l = 2..alpha`` (``base`` is
    indexed by order; entries 0 and 1 unused); never more than ``base[alpha]``."""
    if q >= 1.0:
        return base[alpha]
    if q <= 0.0:
        return 0.0
    lq, l1q = math.log(q), math.log1p(-q)
    terms = [(alpha - 1) * l1q + math.log1p((alpha - 1) * q)]
    log_binom = lambda n, k: gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)  # noqa: E731
    terms.append(log_binom(alpha, 2) + 2 * lq + (alpha - 2) * l1q + base[2])
    for ell in range(3, alpha + 1):
        terms.append(math.log(3.0) + log_binom(alpha, ell) + ell * lq + (alpha - ell) * l1q
                     + (ell - 1) * base[ell])
    return min(float(logsumexp(terms)) / (alpha - 1), base[alpha])


def event_rdp(event: dpa.DpEvent, orders: np.ndarray) -> np.ndarray | None:
    """RDP of a Skellam event (plain or Poisson-sampled) at ``orders`` (inf at
    non-integer orders), or None if ``event`` is not one."""
    q = 1.0
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, SkellamDpEvent):
        q, event = float(event.sampling_probability), event.event
    if not isinstance(event, SkellamDpEvent):
        return None
    top = int(max((o for o in orders if float(o).is_integer()), default=1))
    base = [math.inf, math.inf] + [skellam_rdp(a, event.l2_sensitivity, event.l1_sensitivity, event.mu)
                                   for a in range(2, top + 1)]
    out = np.full(len(orders), np.inf)
    for i, o in enumerate(orders):
        if float(o).is_integer() and o >= 2:
            out[i] = subsampled_rdp(q, base, int(o))
    return out


def l2_bound(scaled_norm: float, dim: int, beta: float = ROUNDING_BETA) -> float:
    """The L2 norm a rounded unit is conditioned on (``delta_2``)."""
    root = math.sqrt(dim) / 2.0
    return math.sqrt(scaled_norm**2 + dim / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (scaled_norm + root))


def l1_bound(l2: float, dim: int) -> float:
    """An integer vector's L1 norm from its L2 bound (``delta_1``)."""
    return min(l2 * l2, math.sqrt(dim) * l2)


@dataclass(frozen=True)
class SkellamPlan:
    """Everything the owners and the server must agree on for one round.

    ``scale``: gamma (integers per unit of gradient); ``dim``: number of shared
    parameters; ``noise_multiplier``: z (noise std ``z delta_2``); ``num_owners``: the
    owners whose shares a round asks for; ``min_survivors``: the fewest of them whose
    masked vectors the server will unmask; ``colluding``: owners that may pool their
    shares with the server."""

    clipping_norm: float
    scale: float
    dim: int
    noise_multiplier: float
    num_owners: int
    min_survivors: int
    colluding: int = 0

    def __post_init__(self) -> None:
        if self.min_survivors - self.colluding < 1:
            raise ValueError(f"min_survivors ({self.min_survivors}) - colluding ({self.colluding}) must be >= 1")

    @property
    def delta_2(self) -> float:
        return l2_bound(self.scale * self.clipping_norm, self.dim)

    @property
    def delta_1(self) -> float:
        return l1_bound(self.delta_2, self.dim)

    @property
    def mu(self) -> float:
        """The Skellam parameter the honest survivors bring at least (variance ``2 mu``)."""
        return (self.noise_multiplier * self.delta_2) ** 2 / 2.0

    @property
    def share_mu(self) -> float:
        """Each owner's share: the honest survivors bring ``mu`` even if only
        ``min_survivors - colluding`` of them are honest and alive."""
        return self.mu / (self.min_survivors - self.colluding)

    def with_honest_floor(self, honest: int | None) -> SkellamPlan:
        """The plan of an owner that assumes at least ``honest`` honest owners (itself
        included) whose shares reach the sum, whatever the run config says: its share
        is ``mu / min(min_survivors - colluding, honest)`` (``honest`` None: the run's)."""
        if honest is None or honest >= self.min_survivors - self.colluding:
            return self
        return dataclasses.replace(self, colluding=self.min_survivors - int(honest))

    def event(self, sample_rate: float) -> dpa.DpEvent:
        """The round's release as the server (and any coalition) sees it: the honest
        survivors' shares, ``(min_survivors - colluding) * share_mu = mu`` at least."""
        inner = SkellamDpEvent(float(self.delta_2), float(self.delta_1), float(self.mu))
        return dpa.PoissonSampledDpEvent(float(sample_rate), inner) if sample_rate < 1.0 else inner


def choose_scale(clipping_norm: float, max_units: float, dim: int) -> float:
    """gamma: ``gamma C`` as large as :data:`MAX_SCALED_NORM` allows while a round's
    largest sum (``max_units`` units, each at most ``delta_2`` in any coordinate)
    stays within an eighth of the modulus, which leaves the noise three eighths
    (:func:`wrap_probability` says how likely it is to need more)."""
    room = MODULUS / 8.0 - dim  # the rounding adds less than one per coordinate and unit
    scaled = min(MAX_SCALED_NORM, room / (max(1.0, max_units) * 1.001))
    if scaled < 4.0 * math.sqrt(dim):
        raise ValueError(f"{max_units:g} units per round leave an integer scale of {scaled:.3g} per clipping "
                         f"norm, too coarse for {dim} parameters (rounding would dominate): fewer units "
                         "per round (batch-size) are needed")
    return float(scaled / clipping_norm)


def wrap_probability(plan: SkellamPlan, max_units: float, num_survivors: int | None = None) -> float:
    """An upper bound on the probability that any coordinate of the round's sum
    wraps around the modulus, given at most ``max_units`` units in the sum: the
    signal is at most ``max_units * delta_2`` in a coordinate, and the noise (a sum
    of ``num_survivors`` shares, variance ``2 n mu_share``) obeys Bernstein's bound
    ``P(|X| >= t) <= 2 exp(-t^2 / (2 (v + t/3)))`` for a sum of Poisson differences."""
    n = plan.num_owners if num_survivors is None else num_survivors
    t = MODULUS / 2.0 - max_units * plan.delta_2
    if t <= 0:
        return 1.0
    var = 2.0 * n * plan.share_mu
    log_p = math.log(2.0 * plan.dim) - t * t / (2.0 * (var + t / 3.0))
    return float(min(1.0, math.exp(log_p)))


def round_units(scaled: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Conditional randomized rounding of each row of ``scaled`` (units x d, float64)
    to integers with L2 norm <= ``bound`` (int64)."""
    floor = np.floor(scaled)
    frac = scaled - floor
    out = np.zeros(scaled.shape, dtype=np.int64)
    todo = np.arange(scaled.shape[0])
    for _ in range(MAX_ROUNDING_DRAWS):
        if todo.size == 0:
            break
        up = rng.random((todo.size, scaled.shape[1])) < frac[todo]
        cand = floor[todo] + up
        ok = np.einsum("ij,ij->i", cand, cand) <= bound * bound
        out[todo[ok]] = cand[ok].astype(np.int64)
        todo = todo[~ok]
    return out  # rows still in ``todo`` stay zero (within the bound)


def skellam_noise(size: int, mu: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of ``Sk(mu)`` (int64)."""
    if mu <= 0:
        return np.zeros(int(size), dtype=np.int64)
    return rng.poisson(mu, int(size)).astype(np.int64) - rng.poisson(mu, int(size)).astype(np.int64)


def to_field(values: np.ndarray) -> np.ndarray:
    """Integers reduced into ``[0, MODULUS)``."""
    return np.mod(values.astype(np.int64), MODULUS)


def from_field(values: np.ndarray) -> np.ndarray:
    """The centred integers in ``[-MODULUS/2, MODULUS/2)`` of field elements."""
    v = np.mod(values.astype(np.int64), MODULUS)
    return np.where(v >= MODULUS // 2, v - MODULUS, v)


__all__ = ["MODULUS", "SkellamDpEvent", "SkellamPlan", "choose_scale", "event_rdp", "from_field", "l1_bound",
           "l2_bound", "round_units", "skellam_noise", "skellam_rdp", "subsampled_rdp", "to_field",
           "wrap_probability"]
