"""The distributed-noise accounting, pinned by exact values.

Every number the ledger uses for ``noise-placement = "distributed"`` is compared, to
1e-9 relative, with a computation written here from the papers' formulas (in
``mpmath`` at 50 digits, exact binomials; nothing of :mod:`flwr_jdp.privacy.skellam`
is called to compute an expected value):

- the sensitivities of a rounded unit: ``delta_2`` (Kairouz, Liu, Steinke 2021: the
  L2 bound conditional randomized rounding is conditioned on) and ``delta_1 =
  min(delta_2^2, sqrt(d) delta_2)`` (an integer vector's L1 norm);
- the RDP of the multi-dimensional Skellam mechanism (Agarwal, Kairouz, Liu, NeurIPS
  2021, Theorem 3.5), for integer ``alpha > 1``::

      eps(alpha) = alpha D2^2 / (4 mu)
                   + min(((2 alpha - 1) D2^2 + 6 D1) / (16 mu^2), 3 D1 / (4 mu));

- Zhu and Wang's general upper bound for Poisson subsampling at rate ``q`` (ICML 2019,
  Theorem 6), as the code applies it (never above the unsampled bound)::

      eps'(alpha) = min(eps(alpha), log S / (alpha - 1)),
      S = (1-q)^(alpha-1) (1 + (alpha-1) q) + C(alpha,2) q^2 (1-q)^(alpha-2) e^eps(2)
          + 3 sum_{l=3..alpha} C(alpha,l) q^l (1-q)^(alpha-l) e^((l-1) eps(l));

- epsilon end to end: ``T`` rounds compose by adding RDP order by order, then
  ``eps = min_alpha T eps'(alpha) + log(1 - 1/alpha) - log(delta alpha) / (alpha - 1)``
  (Canonne, Kamath, Steinke 2020, Proposition 12) over the integer orders the code
  evaluates, as the ledger reports it for a schedule.

The settings are chosen so that each term matters: the second term of the Skellam bound
moves epsilon by well over 1e-9 (both branches of its minimum are taken), and each
branch of ``delta_1``'s minimum is taken.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import mpmath as mp
import pytest

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.schedule import Schedule
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.skellam import SkellamPlan, event_rdp, l1_bound, l2_bound, skellam_rdp, subsampled_rdp

mp.mp.dps = 50
REL = 1e-9
#: The rounding's failure probability the plan conditions on (ROUNDING_BETA).
BETA = 1e-3
#: The integer orders the RDP accountant evaluates (dp-accounting's and Opacus's defaults).
INTEGER_ORDERS = list(range(2, 64)) + [128, 256, 512, 1024]


# ---------------------------------------------------------------- independent formulas
def delta_2(scaled_norm: float, dim: int) -> mp.mpf:
    c, d = mp.mpf(scaled_norm), mp.mpf(dim)
    return mp.sqrt(c**2 + d / 4 + mp.sqrt(2 * mp.log(1 / mp.mpf(BETA))) * (c + mp.sqrt(d) / 2))


def delta_1(d2: mp.mpf, dim: int) -> mp.mpf:
    return min(d2**2, mp.sqrt(dim) * d2)


def skellam(alpha: int, d2, d1, mu, *, tail: bool = True) -> mp.mpf:  # noqa: ANN001
    d2, d1, mu = mp.mpf(d2), mp.mpf(d1), mp.mpf(mu)
    head = alpha * d2**2 / (4 * mu)
    second = min(((2 * alpha - 1) * d2**2 + 6 * d1) / (16 * mu**2), 3 * d1 / (4 * mu))
    return head + second if tail else head


def zhu_wang(q: float, alpha: int, eps) -> mp.mpf:  # noqa: ANN001 - eps: order -> base RDP
    if q >= 1:
        return eps(alpha)
    q = mp.mpf(q)
    s = (1 - q) ** (alpha - 1) * (1 + (alpha - 1) * q)
    s += math.comb(alpha, 2) * q**2 * (1 - q) ** (alpha - 2) * mp.exp(eps(2))
    s += 3 * mp.fsum(math.comb(alpha, ell) * q**ell * (1 - q) ** (alpha - ell) * mp.exp((ell - 1) * eps(ell))
                     for ell in range(3, alpha + 1))
    return min(eps(alpha), mp.log(s) / (alpha - 1))


def end_to_end(q: float, rounds: int, delta: float, d2, d1, mu, *, tail: bool = True) -> float:  # noqa: ANN001
    cache: dict[int, mp.mpf] = {}

    def eps(ell: int) -> mp.mpf:
        if ell not in cache:
            cache[ell] = skellam(ell, d2, d1, mu, tail=tail)
        return cache[ell]

    best = min(rounds * zhu_wang(q, a, eps) + mp.log(1 - mp.mpf(1) / a) - mp.log(mp.mpf(delta) * a) / (a - 1)
               for a in INTEGER_ORDERS)
    return float(max(best, 0))


# ----------------------------------------------------------------------- settings
#: (scaled norm gamma C, dim, noise multiplier z): mu = (z delta_2)^2 / 2.
PLANS = [
    (3.0, 10, 1.0),      # coarse: delta_1 = sqrt(d) delta_2; the second Skellam term a few %
    (4.0, 200, 0.8),     # delta_1 = delta_2^2; the second term's other branch at high orders
    (2.0**16, 1000, 1.2),  # a production scale: the Gaussian's RDP up to ~1e-9
]
#: (delta_2, delta_1, mu) given directly.
DIRECT = [(5.0, 12.0, 10.0), (5.0, 25.0, 2.0), (3.0, 3.0, 40.0), (1.0e3, 3.0e4, 7.0e5)]
ALPHAS = [2, 3, 7, 32, 256]


def _plan(scaled_norm: float, dim: int, z: float, owners: int = 5, survivors: int = 4, colluding: int = 1):
    return SkellamPlan(clipping_norm=0.5, scale=scaled_norm / 0.5, dim=dim, noise_multiplier=z,
                       num_owners=owners, min_survivors=survivors, colluding=colluding)


def _close(got: float, want) -> None:  # noqa: ANN001
    assert got == pytest.approx(float(want), rel=REL, abs=0.0), (got, float(want))


@pytest.mark.parametrize("scaled_norm,dim,z", PLANS)
def test_sensitivities_and_noise_of_a_plan(scaled_norm, dim, z):
    plan = _plan(scaled_norm, dim, z)
    d2 = delta_2(scaled_norm, dim)
    _close(plan.delta_2, d2)
    _close(l2_bound(scaled_norm, dim), d2)
    _close(plan.delta_1, delta_1(d2, dim))
    _close(l1_bound(float(d2), dim), delta_1(d2, dim))
    _close(plan.mu, (z * d2) ** 2 / 2)
    _close(plan.share_mu, (z * d2) ** 2 / 2 / (4 - 1))  # 4 survivors, 1 colluding: 3 honest bring mu


def test_each_branch_of_delta_1_is_taken():
    branches = set()
    for scaled_norm, dim, _ in PLANS:
        d2 = delta_2(scaled_norm, dim)
        branches.add("square" if d2**2 < mp.sqrt(dim) * d2 else "sqrt(d)")
        assert delta_1(d2, dim) > 1.5 * d2  # far from delta_2: the L1 bound is not the L2 one
    assert branches == {"square", "sqrt(d)"}


@pytest.mark.parametrize("d2,d1,mu", DIRECT)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_skellam_rdp_per_order(alpha, d2, d1, mu):
    _close(skellam_rdp(alpha, d2, d1, mu), skellam(alpha, d2, d1, mu))


def test_the_second_term_matters_and_both_of_its_branches_are_taken():
    shares, branches = [], set()
    for d2, d1, mu in DIRECT:
        for alpha in ALPHAS:
            first = ((2 * alpha - 1) * d2**2 + 6 * d1) / (16 * mu**2)
            branches.add("first" if first < 3 * d1 / (4 * mu) else "second")
            shares.append(float(1 - skellam(alpha, d2, d1, mu, tail=False) / skellam(alpha, d2, d1, mu)))
    assert branches == {"first", "second"}
    assert max(shares) > 0.05  # dropping it moves the bound by 5 %, far beyond REL


@pytest.mark.parametrize("scaled_norm,dim,z", PLANS)
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5, 1.0])
def test_subsampled_rdp_per_order(scaled_norm, dim, z, q):
    """``subsampled_rdp`` on the plan's own bound, and the plan's event through the
    accountant's entry point (:func:`event_rdp`), at every order, against Zhu and Wang."""
    plan = _plan(scaled_norm, dim, z)
    d2 = delta_2(scaled_norm, dim)
    d1, mu = delta_1(d2, dim), (z * d2) ** 2 / 2
    top = max(ALPHAS)
    base = [math.inf, math.inf] + [skellam_rdp(a, plan.delta_2, plan.delta_1, plan.mu) for a in range(2, top + 1)]
    got = event_rdp(plan.event(q), [float(a) for a in ALPHAS] + [2.5])
    assert math.isinf(got[-1])  # a fractional order has no bound here
    for i, alpha in enumerate(ALPHAS):
        want = zhu_wang(q, alpha, lambda ell: skellam(ell, d2, d1, mu))
        _close(subsampled_rdp(q, base, alpha), want)
        _close(got[i], want)


SCHEDULES = [  # (plan index, sampling rate, rounds, delta)
    (0, 0.1, 20, 1e-5),
    (0, 1.0, 3, 1e-6),
    (1, 0.05, 50, 1e-5),
    (2, 0.02, 200, 1e-5),
]


@pytest.mark.parametrize("index,q,rounds,delta", SCHEDULES)
def test_ledger_epsilon_of_a_schedule(index, q, rounds, delta):
    """The epsilon the server's ledger reports after ``rounds`` rounds of the schedule's
    distributed release (:meth:`Schedule.round_events`, the run's JobConfig), against
    the independent composition and conversion."""
    scaled_norm, dim, z = PLANS[index]
    cfg = parse_config({"noise-placement": "distributed", "num-owners": 5, "dropout-tolerance": 0.2,
                        "colluding-owners": 1, "clipping-norm": 0.5, "delta": delta})
    schedule = Schedule({o: q for o in range(5)}, {o: 1 for o in range(5)}, q, 500, dim=dim,
                        scale=scaled_norm / 0.5)
    ledgers = [PrivacyLedger(delta=delta, accountant=acc) for acc in ("pld", "rdp")]  # RDP for Skellam either way
    for r in range(rounds):
        for ledger in ledgers:
            ledger.record_round(r + 1, schedule.round_events(cfg, z, list(range(5))))
    d2 = delta_2(scaled_norm, dim)
    d1, mu = delta_1(d2, dim), (z * d2) ** 2 / 2
    want = end_to_end(q, rounds, delta, d2, d1, mu)
    for ledger in ledgers:
        _close(ledger.epsilon(), want)
        _close(ledger.scope_epsilon(SERVER_SCOPE), want)
    if index == 0:  # where the second term and delta_1 matter, they move epsilon far beyond REL
        assert want > 1.001 * end_to_end(q, rounds, delta, d2, d1, mu, tail=False)
        assert want > 1.001 * end_to_end(q, rounds, delta, d2, d2, mu)


def test_owner_and_server_account_the_same_release():
    """The owner's own charge (its plan from its run config) is the server's event."""
    from flwr_jdp.joint_dp.distributed import owner_plan

    cfg = parse_config({"noise-placement": "distributed", "num-owners": 5, "dropout-tolerance": 0.2,
                        "colluding-owners": 1, "clipping-norm": 0.5})
    scaled_norm, dim, z = PLANS[0]
    plan = owner_plan(cfg, z, dim, scaled_norm / 0.5)
    assert plan == _plan(scaled_norm, dim, z)
    event = plan.event(0.1)
    assert isinstance(event, dpa.PoissonSampledDpEvent) and event.sampling_probability == 0.1
    d2 = delta_2(scaled_norm, dim)
    _close(event.event.l2_sensitivity, d2)
    _close(event.event.l1_sensitivity, delta_1(d2, dim))
    _close(event.event.mu, (z * d2) ** 2 / 2)
