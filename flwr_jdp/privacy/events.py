"""Privacy events as data: constructors and a JSON codec for dp-accounting events.

Every mechanism in flwr-jdp describes each release as a ``dp_accounting.DpEvent``;
the ledger stores them as JSON so that it survives restarts.
"""

from __future__ import annotations

import functools
import json
from typing import Any

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


def _tuple_to_dict(value: Any) -> Any:
    if hasattr(value, "_fields") and "class_name" in value._fields:
        out = {"class_name": value.class_name}
        for field in value._fields:
            if field in ("module_name", "class_name"):
                continue
            out[field] = _tuple_to_dict(getattr(value, field))
        return out
    if isinstance(value, (list, tuple)):
        return [_tuple_to_dict(v) for v in value]
    return value


def from_dict(data: Any) -> Any:
    """Inverse of :func:`to_dict`."""
    if isinstance(data, dict) and "class_name" in data:
        cls = getattr(dpa.dp_event, data["class_name"])
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
    return json.dumps(_tuple_to_dict(event.to_named_tuple()), sort_keys=True)


_canonical_cached = functools.lru_cache(maxsize=8192)(_canonical)
