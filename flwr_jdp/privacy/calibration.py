"""Calibration: the smallest noise multiplier whose epsilon reaches a target.

A bisection over the same accountant the ledger uses, so that a calibrated run
never reports more than its target. The returned multiplier ``z`` satisfies
``epsilon(z) <= target`` and ``epsilon(z) >= (1 - rel_tol) * target`` unless the
target is reached at the lower end of the search range.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting as dpa

from .accountants import PLD_COARSE_DISCRETIZATION, PLD_DISCRETIZATION, epsilon

#: Smallest noise multiplier calibration will return.
MIN_NOISE_MULTIPLIER = 0.05
MAX_NOISE_MULTIPLIER = 1e4


def pld_grid(target_epsilon: float) -> float:
    """The PLD loss grid calibration settles on for ``target_epsilon``: the
    ledger's (:data:`~.accountants.PLD_DISCRETIZATION`) up to epsilon 10, above
    it ``ceil(epsilon)`` times coarser (see :func:`calibrate`)."""
    scale = 1.0 if target_epsilon <= 10 else float(math.ceil(target_epsilon))
    return PLD_DISCRETIZATION * scale


def calibrate(
    target_epsilon: float,
    delta: float,
    event_fn: Callable[[float], dpa.DpEvent | list[dpa.DpEvent]],
    accountant: str = "pld",
    rel_tol: float = 0.005,
    relation: str = "add-remove",
) -> float:
    """Smallest ``z`` with ``max_k epsilon(event_fn(z)[k]) <= target_epsilon``.

    ``event_fn`` may return several events (for example one per owner); the
    maximum of their epsilons must meet the target (joint-DP over disjoint owners).
    ``relation`` is the neighbouring relation (see :mod:`.accountants`).

    With the PLD accountant the search runs in two stages: a bisection on a coarse
    PLD grid (:data:`~.accountants.PLD_COARSE_DISCRETIZATION`, about 8 times
    cheaper), then a short search on the ledger's own grid that starts from the
    coarse answer. Only the second stage decides, so the guarantee above holds for
    the epsilon the ledger will report.
    """
    if target_epsilon <= 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")
    # Large targets mean small noise multipliers, whose privacy-loss distributions
    # span a range that grows as 1/z**2: on a fixed grid one PLD then takes minutes.
    # Above epsilon 10 the grids are a whole multiple of the ledger's, growing with
    # the target (:func:`pld_grid`; at epsilon 1000 the interval is 0.1, a relative
    # precision of 1e-4). A pessimistic PLD on a grid that is a multiple of another
    # rounds every loss up at least as far, so the ledger's epsilon is at most the
    # one calibrated here.
    fine_grid = pld_grid(target_epsilon)
    coarse_grid = PLD_COARSE_DISCRETIZATION * fine_grid / PLD_DISCRETIZATION

    def eps_with(backend: str, discretization: float = fine_grid) -> Callable[[float], float]:
        def one(e, z_backend: str) -> float:  # noqa: ANN001
            try:
                return epsilon(e, delta, z_backend, relation, discretization)
            except ValueError:
                if z_backend == "rdp" and relation == "replace-one":
                    # RDP has no replace-one bound for sampled events; the ledger
                    # refuses those too, so this only ranks candidates (bracketing).
                    return epsilon(e, delta, "pld", relation, discretization)
                raise

        def eps(z: float) -> float:
            out = event_fn(z)
            events = out if isinstance(out, list) else [out]
            return max(one(e, backend) for e in events)
        return eps

    if accountant != "pld":
        return _bisect(eps_with(accountant), eps_with("rdp"), target_epsilon, rel_tol)
    # Stage 1: the coarse grid, to a tighter tolerance so stage 2 rarely moves.
    coarse = _bisect(eps_with("pld", coarse_grid), eps_with("rdp"),
                     target_epsilon, rel_tol / 4.0)
    # Stage 2: the ledger's grid, bracketing around the coarse answer.
    eps = eps_with("pld")
    hi = coarse
    while eps(hi) > target_epsilon:  # the fine grid is tighter, so this is rare
        hi *= 1.01
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"target epsilon {target_epsilon:g} is unreachable with a noise "
                             f"multiplier <= {MAX_NOISE_MULTIPLIER:g}")
    if eps(hi) >= (1.0 - rel_tol) * target_epsilon or hi <= MIN_NOISE_MULTIPLIER:
        return hi
    lo = hi * 0.99
    while lo > MIN_NOISE_MULTIPLIER and eps(lo) <= target_epsilon:
        hi, lo = lo, lo * 0.99
    if lo <= MIN_NOISE_MULTIPLIER and eps(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    return _narrow(eps, lo, hi, target_epsilon, rel_tol)


def _bisect(eps: Callable[[float], float], rdp_eps: Callable[[float], float],
            target_epsilon: float, rel_tol: float) -> float:
    """Bisection on ``eps``, bracketed cheaply by ``rdp_eps`` (RDP upper-bounds PLD)."""
    hi = 1.0
    while rdp_eps(hi) > target_epsilon:
        hi *= 2.0
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"target epsilon {target_epsilon:g} is unreachable with a noise "
                             f"multiplier <= {MAX_NOISE_MULTIPLIER:g}")
    while eps(hi) > target_epsilon:  # only if PLD > RDP (never expected)
        hi *= 1.25
    lo = hi / 2.0
    while lo > MIN_NOISE_MULTIPLIER and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    if lo <= MIN_NOISE_MULTIPLIER and eps(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    return _narrow(eps, lo, hi, target_epsilon, rel_tol)


def _narrow(eps: Callable[[float], float], lo: float, hi: float,
            target_epsilon: float, rel_tol: float) -> float:
    """Bisect while ``eps(lo) > target >= eps(hi)`` until ``eps(hi)`` is within
    ``rel_tol`` of the target; returns ``hi``."""
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
        if eps(hi) >= (1.0 - rel_tol) * target_epsilon or (hi - lo) < 1e-7 * hi:
            break
    return hi
