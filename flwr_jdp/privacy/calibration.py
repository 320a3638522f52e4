"""Calibration: the smallest noise multiplier whose epsilon reaches a target.

A bisection over the same accountant the ledger uses, so that a calibrated run
never reports more than its target. The returned multiplier ``z`` satisfies
``epsilon(z) <= target`` and ``epsilon(z) >= (1 - rel_tol) * target`` unless the
target is reached at the lower end of the search range.
"""

from __future__ import annotations

from collections.abc import Callable

import dp_accounting as dpa

from .accountants import epsilon

#: Smallest noise multiplier calibration will return.
MIN_NOISE_MULTIPLIER = 0.05
MAX_NOISE_MULTIPLIER = 1e4


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
    """
    if target_epsilon <= 0:
        raise ValueError(f"target epsilon must be > 0, got {target_epsilon}")

    def eps(z: float, backend: str = accountant) -> float:
        out = event_fn(z)
        events = out if isinstance(out, list) else [out]
        if backend == "rdp" and relation == "replace-one":
            backend = "pld"  # RDP has no replace-one bound for sampled events
        return max(epsilon(e, delta, backend, relation) for e in events)

    # Bracket cheaply: RDP upper-bounds PLD, so an RDP-calibrated z is feasible.
    hi = 1.0
    while eps(hi, "rdp") > target_epsilon:
        hi *= 2.0
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError("target epsilon is unreachable with noise multiplier <= 1e4")
    while eps(hi) > target_epsilon:  # only if PLD > RDP (never expected)
        hi *= 1.25
    lo = hi / 2.0
    while lo > MIN_NOISE_MULTIPLIER and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    if lo <= MIN_NOISE_MULTIPLIER and eps(MIN_NOISE_MULTIPLIER) <= target_epsilon:
        return MIN_NOISE_MULTIPLIER
    # Invariant: eps(lo) > target >= eps(hi).
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
        if eps(hi) >= (1.0 - rel_tol) * target_epsilon or (hi - lo) < 1e-7 * hi:
            break
    return hi

