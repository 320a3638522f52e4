"""One interface, two backends: epsilon of a DpEvent at delta, by PLD or RDP.

- ``pld`` (default): dp-accounting's privacy-loss-distribution accountant, the
  tightest numerical accountant it offers (add/remove neighbouring relation,
  pessimistic discretisation, so the result is an upper bound).
- ``rdp``: Renyi DP (see :mod:`flwr_jdp.privacy.rdp`), looser but cheap.

Neighbouring relation (``relation``): ``add-remove`` (default; one unit present or
absent) or ``replace-one`` (one unit's data replaced; the task-level unit of joint
DP as Kearns et al. define it). A release's noise multiplier is always relative
to the add/remove sensitivity ``S`` of the sum (one unit's bound); under
``replace-one`` the sum moves by up to ``2 S``. Unsampled Gaussian and Laplace
releases under replace-one are therefore converted *exactly* to add/remove
releases with half the noise multiplier (resp. scale); Poisson-sampled releases
under replace-one use dp-accounting's PLD with ``NeighboringRelation.REPLACE_ONE``
(RDP has no such bound in dp-accounting and refuses them).

Every event is first normalised to a multiset of *base* events (a Gaussian, a
Poisson-sampled Gaussian, ...) with counts, by flattening sequential composition.
The PLD of each base event is built once per process and self-composed ``count``
times, so many owners with different sampling rates, and many rounds, stay cheap.
Results are also cached per (event, delta, backend).
"""

from __future__ import annotations

import functools
import json
import math

import attr
import dp_accounting as dpa
from dp_accounting.pld import PLDAccountant

from . import events as ev
from .backends import ACCOUNTANTS, RELATIONS
from .rdp import rdp_epsilon

#: PLD discretisation of the privacy loss; dp-accounting's default.
PLD_DISCRETIZATION = 1e-4
#: A coarser discretisation, about 8 times cheaper. Still a pessimistic upper
#: bound, only a looser one; calibration searches with it and then settles the
#: answer with :data:`PLD_DISCRETIZATION` (see :mod:`.calibration`).
PLD_COARSE_DISCRETIZATION = 1e-3


def check_accountant(name: str) -> str:
    """Return ``name`` if it is a known backend, else raise ``ValueError``."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    return name


def check_relation(name: str) -> str:
    """Return ``name`` if it is a known neighbouring relation, else raise ``ValueError``."""
    if name not in RELATIONS:
        raise ValueError(f"neighbouring relation must be one of {RELATIONS}, got {name!r}")
    return name


def as_add_remove(event: dpa.DpEvent) -> dpa.DpEvent:
    """The add/remove event equivalent to ``event`` under replace-one, where that is
    exact: a Gaussian (Laplace) release whose sum moves by ``2 S`` is an add/remove
    release with half the noise multiplier (scale). Sampled events are returned
    unchanged (see :func:`epsilon`)."""
    if isinstance(event, dpa.GaussianDpEvent):
        return dpa.GaussianDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, dpa.LaplaceDpEvent):
        return dpa.LaplaceDpEvent(event.noise_multiplier / 2.0)
    if type(event).__name__ == "SkellamDpEvent":  # the integer sum moves by twice as much
        return attr.evolve(event, l2_sensitivity=2 * event.l2_sensitivity,
                           l1_sensitivity=2 * event.l1_sensitivity)
    if isinstance(event, dpa.SelfComposedDpEvent):
        return dpa.SelfComposedDpEvent(as_add_remove(event.event), event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return dpa.ComposedDpEvent([as_add_remove(e) for e in event.events])
    return event


def epsilon(event: dpa.DpEvent, delta: float, accountant: str = "pld",
            relation: str = "add-remove", discretization: float = PLD_DISCRETIZATION) -> float:
    """Epsilon spent by ``event`` at ``delta`` under ``relation`` (an upper bound).

    ``discretization`` is the PLD's loss grid (ignored by RDP). Any value gives an
    upper bound; the ledger always uses the default, :data:`PLD_DISCRETIZATION`.
    """
    check_accountant(accountant)
    check_relation(relation)
    if isinstance(event, dpa.NoOpDpEvent):
        return 0.0
    if relation == "replace-one":
        event = as_add_remove(event)
        sampled = "PoissonSampledDpEvent" in ev.canonical(event)
        if not sampled:
            relation = "add-remove"
        elif accountant == "rdp" or "SkellamDpEvent" in ev.canonical(event):
            raise ValueError("RDP of Poisson-sampled releases under replace-one is not "
                             "supported; use the pld accountant")
    return _cached_epsilon(ev.canonical(event), float(delta), accountant, relation,
                           float(discretization))


def base_counts(event: dpa.DpEvent, count: int = 1, out: dict[str, int] | None = None) -> dict[str, int]:
    """Flatten sequential composition: canonical base event -> number of releases."""
    out = {} if out is None else out
    if isinstance(event, dpa.NoOpDpEvent):
        return out
    if isinstance(event, dpa.SelfComposedDpEvent):
        return base_counts(event.event, count * event.count, out)
    if isinstance(event, dpa.ComposedDpEvent):
        for e in event.events:
            base_counts(e, count, out)
        return out
    key = ev.canonical(event)
    out[key] = out.get(key, 0) + count
    return out


@functools.lru_cache(maxsize=512)
def _base_pld(event_json: str, relation: str = "add-remove",
              discretization: float = PLD_DISCRETIZATION):
    rel = (dpa.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
           else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc = PLDAccountant(neighboring_relation=rel,
                        value_discretization_interval=discretization)
    acc.compose(ev.from_dict(json.loads(event_json)))
    if acc._contains_non_dp_event:  # noqa: SLF001 - e.g. a Gaussian with no noise
        return None  # not DP at any epsilon: its privacy loss distribution is empty
    return acc._pld  # noqa: SLF001 - the composed PrivacyLossDistribution


@functools.lru_cache(maxsize=256)
def _self_composed_pld(event_json: str, count: int, relation: str = "add-remove",
                       discretization: float = PLD_DISCRETIZATION):
    pld = _base_pld(event_json, relation, discretization)
    if pld is None:
        return None
    return pld.self_compose(count) if count > 1 else pld


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(event_json: str, delta: float, accountant: str,
                    relation: str = "add-remove",
                    discretization: float = PLD_DISCRETIZATION) -> float:
    event = ev.from_dict(json.loads(event_json))
    if accountant == "rdp" or "SkellamDpEvent" in event_json:  # no PLD for it: RDP (conservative)
        return rdp_epsilon(event, delta)
    total = None
    for base, count in sorted(base_counts(event).items()):
        pld = _self_composed_pld(base, count, relation, discretization)
        if pld is None:  # a release that is not DP (no noise): no finite epsilon
            return math.inf
        total = pld if total is None else total.compose(pld)
    if total is None:
        return 0.0
    value = float(total.get_epsilon_for_delta(delta))
    return value if math.isfinite(value) else math.inf


def screened_max_epsilon(events: list[dpa.DpEvent], delta: float,
                         floor: float = 0.0) -> tuple[float, int, dict[int, float]]:
    """The largest PLD epsilon (add/remove, ledger grid) over many ``events``,
    computing as few ledger-grid PLDs as possible (e.g. one event per subject).

    Two cheaper upper bounds screen the events: the RDP epsilon, and the PLD
    epsilon on the coarse grid :data:`PLD_COARSE_DISCRETIZATION` (pessimistic
    discretisation, so also an upper bound on the true epsilon, and a tight one).
    The event with the largest RDP bound is computed first; then the events whose
    RDP bound exceeds the best value so far get a coarse PLD, and they are settled
    on the ledger grid in decreasing order of it until the best value is at least
    the next coarse bound. An event is skipped only when one of its upper bounds
    is at most a value already attained (or ``floor``), so the result is at least
    every event's true epsilon: a valid bound for all of them. It equals the
    maximum of the ledger-grid epsilons whenever the bounds lie above them. That
    is expected (RDP is looser than PLD; a coarser pessimistic grid rounds up
    more) and is what the tests check, but it is not proved; the guarantee
    claimed is only the valid bound.

    Returns ``(value, index, exact)``: the maximum (``floor`` if no event
    exceeds it), the index of an event attaining it (-1 if none), and the
    ledger-grid epsilon of every event that was computed, by index.
    """
    best, arg, exact = float(floor), -1, {}

    def settle(j: int) -> None:
        nonlocal best, arg
        exact[j] = epsilon(events[j], delta, "pld")
        if exact[j] > best:
            best, arg = exact[j], j

    if len(events) <= 2:
        for j in range(len(events)):
            settle(j)
        return best, arg, exact
    rdp = [epsilon(e, delta, "rdp") for e in events]
    order = sorted(range(len(events)), key=rdp.__getitem__, reverse=True)
    if rdp[order[0]] > best:
        settle(order[0])
    coarse = {j: epsilon(events[j], delta, "pld", discretization=PLD_COARSE_DISCRETIZATION)
              for j in order[1:] if rdp[j] > best}
    for j in sorted(coarse, key=coarse.__getitem__, reverse=True):
        if coarse[j] <= best:
            break
        settle(j)
    return best, arg, exact
