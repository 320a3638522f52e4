"""Privacy events as data: constructors and a JSON codec for dp-accounting events.

Every mechanism in flwr-jdp describes each release as a ``dp_accounting.DpEvent``;
the ledger stores them as JSON so that it survives restarts.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import attr
import dp_accounting as dpa


def gaussian(noise_multiplier: float) -> dpa.DpEvent:
    """One release of a sum with sensitivity S plus N(0, (noise_multiplier*S)^2)."""
    return dpa.GaussianDpEvent(float(noise_multiplier))


def dp_sgd(noise_multiplier: float, sample_rate: float, steps: int) -> dpa.DpEvent:
    """``steps`` Poisson-sampled Gaussian releases (DP-SGD with rate ``sample_rate``).

    With ``sample_rate >= 1`` every unit is in every batch and no amplification by
    sampling is claimed.
    """
    if steps <= 0:
        return dpa.NoOpDpEvent()
    inner = gaussian(noise_multiplier)
    if sample_rate < 1.0:
        inner = dpa.PoissonSampledDpEvent(float(sample_rate), inner)
    if steps == 1:
        return inner
    return dpa.SelfComposedDpEvent(inner, int(steps))


def compose(events: list[dpa.DpEvent]) -> dpa.DpEvent:
    """Sequential composition of several events."""
    events = [e for e in events if not isinstance(e, dpa.NoOpDpEvent)]
    if not events:
        return dpa.NoOpDpEvent()
    if len(events) == 1:
        return events[0]
    return dpa.ComposedDpEvent(events)


def to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """Serialise an event (recursively) to plain JSON types (a fresh dict)."""
    return json.loads(canonical(event))


def _plain(value: Any) -> Any:
    """An event as plain JSON types: ``{"class_name": ..., field: value, ...}``.

    The same dict as dp-accounting's ``to_named_tuple`` without ``module_name``
    (so ledgers written before stay readable and mergeable), built straight from
    the attrs fields: ``to_named_tuple`` defines a new NamedTuple class per call,
    which made serialising thousands of per-subject events per round slow."""
    if isinstance(value, dpa.DpEvent):
        out = {"class_name": type(value).__name__}
        for field in attr.fields(type(value)):
            out[field.name] = _plain(getattr(value, field.name))
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _event_class(name: str) -> type:
    """A dp-accounting event class, or flwr-jdp's own (the Skellam mechanism's)."""
    if name == "SkellamDpEvent":
        from .skellam import SkellamDpEvent

        return SkellamDpEvent
    return getattr(dpa.dp_event, name)


def from_dict(data: Any) -> Any:
    """Inverse of :func:`to_dict`."""
    if isinstance(data, dict) and "class_name" in data:
        cls = _event_class(data["class_name"])
        kwargs = {k: from_dict(v) for k, v in data.items() if k != "class_name"}
        return cls(**kwargs)
    if isinstance(data, list):
        return [from_dict(v) for v in data]
    return data


def canonical(event: dpa.DpEvent) -> str:
    """A canonical string for an event (used to merge and cache). Hashable events
    (all but those holding a list, e.g. ComposedDpEvent) are serialised once."""
    try:
        return _canonical_cached(event)
    except TypeError:  # unhashable
        return _canonical(event)


def _canonical(event: dpa.DpEvent) -> str:
    return json.dumps(_plain(event), sort_keys=True)


_canonical_cached = functools.lru_cache(maxsize=8192)(_canonical)
