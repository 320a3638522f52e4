"""RDP backend: dp-accounting's RDP, tightened by Opacus's subsampled-Gaussian bound.

Both dp-accounting and Opacus compute valid upper bounds on the Renyi divergence of
the Poisson-subsampled Gaussian mechanism; they differ slightly at fractional orders.
For every order we keep the smaller of the two (the minimum of two upper bounds is
an upper bound), then convert to (epsilon, delta) with dp-accounting's conversion.
This reproduces Opacus's reference values (e.g. 7.32911 for z=1.5, q=0.04, 2250
steps, delta=1e-5) while still supporting every event dp-accounting knows.
"""

from __future__ import annotations

import functools
import json
import logging

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from .. import import_opacus_quietly
from . import events as ev

#: Orders: Opacus's defaults united with dp-accounting's defaults.
ORDERS = sorted(
    set([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
    | set(float(o) for o in dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
)


def _opacus_rdp(q: float, z: float, orders: np.ndarray) -> np.ndarray | None:
    try:
        import_opacus_quietly()
        from opacus.accountants.analysis import rdp as opacus_rdp
    except ImportError:  # pragma: no cover - opacus is a dependency
        return None
    # Opacus warns (and returns inf) at fractional orders where its series does not
    # converge; the minimum with dp-accounting's value then keeps the latter.
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        vec = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(orders))
    finally:
        logger.setLevel(level)
    return np.nan_to_num(np.asarray(vec, dtype=float), nan=np.inf)


def rdp_vector(event: dpa.DpEvent, orders: list[float] | None = None) -> np.ndarray:
    """RDP of ``event`` at ``orders`` (composition adds RDP order by order)."""
    orders_arr = np.asarray(orders or ORDERS, dtype=float)
    if isinstance(event, dpa.NoOpDpEvent):
        return np.zeros_like(orders_arr)
    if isinstance(event, dpa.SelfComposedDpEvent):
        return event.count * rdp_vector(event.event, orders)
    if isinstance(event, dpa.ComposedDpEvent):
        total = np.zeros_like(orders_arr)
        for e in event.events:
            total = total + rdp_vector(e, orders)
        return total
    if orders is None:  # the default orders: base events are computed once per process
        return _base_rdp(ev.canonical(event)).copy()
    return _base_rdp_at(event, orders_arr)


@functools.lru_cache(maxsize=4096)
def _base_rdp(event_json: str) -> np.ndarray:
    return _base_rdp_at(ev.from_dict(json.loads(event_json)), np.asarray(ORDERS, dtype=float))


def _base_rdp_at(event: dpa.DpEvent, orders_arr: np.ndarray) -> np.ndarray:
    from .skellam import event_rdp  # the distributed mechanism's own bound

    skellam = event_rdp(event, orders_arr)
    if skellam is not None:
        return skellam
    acc = RdpAccountant(list(orders_arr))
    # dp-accounting logs a warning (through absl) for every fractional order whose
    # series does not converge and excludes that order (its RDP is inf there); the
    # minimum with Opacus's bound below, and the other orders, make up for it, so
    # the warning says nothing a user can act on.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc.compose(event)
    finally:
        absl.setLevel(level)
    vec = np.asarray(acc._rdp, dtype=float)  # noqa: SLF001 - documented attribute
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        other = _opacus_rdp(event.sampling_probability, event.event.noise_multiplier, orders_arr)
        if other is not None:
            vec = np.minimum(vec, other)
    return vec


def rdp_epsilon(event: dpa.DpEvent, delta: float) -> float:
    """Epsilon at ``delta`` of ``event`` by RDP."""
    vec = rdp_vector(event)
    eps, _ = compute_epsilon(ORDERS, vec, delta)
    return float(eps)
