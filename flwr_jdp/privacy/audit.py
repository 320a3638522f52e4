"""Empirical privacy audit: a statistical lower bound on a mechanism's epsilon.

Run the mechanism many times on two neighbouring data sets, ``D`` and ``D`` plus
one *canary* unit, and distinguish them with threshold tests on one scalar of the
output. For a threshold ``t`` with false-positive rate ``FPR = P[M(D) > t]`` and
true-positive rate ``TPR = P[M(D') > t]``, (epsilon, delta)-DP implies
``TPR <= e^epsilon FPR + delta`` (and the same with the roles swapped), so

    epsilon >= log((TPR - delta) / FPR).

With Clopper-Pearson bounds (TPR from below, FPR from above) at a confidence
Bonferroni-corrected over a *fixed* grid of thresholds, the result is a lower
bound on the true epsilon with probability at least ``1 - alpha``. A correct
mechanism never gives a bound above its claim (except with probability alpha); a
mechanism that adds too little noise does, given enough trials.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """Two-sided (1 - alpha) Clopper-Pearson interval of a binomial proportion."""
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return lo, hi


@dataclass(frozen=True)
class AuditResult:
    """The best threshold test and the epsilon lower bound it certifies."""

    epsilon_lower_bound: float
    threshold: float
    fpr_upper: float
    tpr_lower: float
    trials: int


def epsilon_lower_bound(
    without: np.ndarray, with_canary: np.ndarray, delta: float, thresholds: Sequence[float],
    alpha: float = 0.05,
) -> AuditResult:
    """Lower bound on epsilon from scalar outputs on D (``without``) and D' (``with_canary``).

    Both directions (``> t`` and ``< t``) of every threshold are tested; the
    confidence is Bonferroni-corrected over all of them."""
    tests = 2 * len(thresholds)
    a = alpha / tests
    best = AuditResult(0.0, float("nan"), 1.0, 0.0, len(without))
    for t in thresholds:
        for sign in (1.0, -1.0):
            fp = int(np.sum(sign * without > sign * t))
            tp = int(np.sum(sign * with_canary > sign * t))
            _, fpr_hi = clopper_pearson(fp, len(without), a)
            tpr_lo, _ = clopper_pearson(tp, len(with_canary), a)
            if tpr_lo - delta <= 0 or fpr_hi <= 0:
                continue
            eps = math.log((tpr_lo - delta) / fpr_hi)
            if eps > best.epsilon_lower_bound:
                best = AuditResult(eps, float(t), fpr_hi, tpr_lo, len(without))
    return best


def audit_sum_mechanism(
    release: Callable[[np.ndarray, np.random.Generator], np.ndarray],
    records: np.ndarray,
    canary: np.ndarray,
    delta: float,
    trials: int,
    rng: np.random.Generator,
    thresholds: Sequence[float],
    alpha: float = 0.05,
) -> AuditResult:
    """Audit a mechanism that releases a noisy sum of (already clipped) records.

    ``release(sum, rng)`` is the mechanism under test. The statistic is the
    released vector's projection on the canary's direction."""
    direction = canary / np.linalg.norm(canary)
    base = records.sum(axis=0)
    without = np.array([release(base, rng) @ direction for _ in range(trials)])
    with_c = np.array([release(base + canary, rng) @ direction for _ in range(trials)])
    shift = base @ direction
    return epsilon_lower_bound(without - shift, with_c - shift, delta, thresholds, alpha)


def audit_two_run(
    release: Callable[[bool], float],
    trials: int,
    delta: float,
    thresholds: Sequence[float],
    alpha: float = 0.05,
) -> AuditResult:
    """Two-run canary audit of any release, through whatever code produces it.

    ``release(with_canary)`` runs the mechanism under test once, on ``D`` (False)
    or on ``D'`` = ``D`` plus the canary unit (True), with fresh noise, and returns
    one scalar of the *released* output (e.g. its projection on the canary's
    direction, scaled so that the canary moves it by about 1). It is called
    ``trials`` times on each side, all ``D`` runs first; each side's runs must be
    independent of one another. The thresholds must be fixed before the runs (they
    are the Bonferroni family of :func:`epsilon_lower_bound`). The result is a
    lower bound on the epsilon of one call at ``delta``, valid with probability at
    least ``1 - alpha``: a release that is (epsilon, delta)-DP with respect to
    adding the canary gives a bound above epsilon with probability at most alpha.
    """
    if trials < 1:
        raise ValueError("trials must be >= 1")
    without = np.array([float(release(False)) for _ in range(trials)])
    with_c = np.array([float(release(True)) for _ in range(trials)])
    if not (np.all(np.isfinite(without)) and np.all(np.isfinite(with_c))):
        raise ValueError("the release gave a non-finite statistic")
    return epsilon_lower_bound(without, with_c, delta, thresholds, alpha)


def max_certifiable_epsilon(trials: int, num_thresholds: int, delta: float = 0.0,
                            alpha: float = 0.05) -> float:
    """The largest bound :func:`epsilon_lower_bound` can give with ``trials`` runs a
    side and ``num_thresholds`` thresholds (no false positive, every true positive):
    the audit's ceiling, whatever the mechanism. A mutant is only caught if the
    claim lies below it."""
    a = alpha / (2 * num_thresholds)
    _, fpr_hi = clopper_pearson(0, trials, a)
    tpr_lo, _ = clopper_pearson(trials, trials, a)
    return math.log((tpr_lo - delta) / fpr_hi)


__all__ = ["AuditResult", "audit_sum_mechanism", "audit_two_run", "clopper_pearson", "epsilon_lower_bound",
           "max_certifiable_epsilon"]
