"""Validation of owners' replies before anything is aggregated.

A reply is dropped, with a logged reason, when the node reported an error, when it
carries a record that is not an expected owner record (for example an owner trying
to send personal layers, or an owner it was not asked to train), or when an owner's
arrays have missing or extra keys, wrong shapes or dtypes, non-finite values, or
(for clipped updates the server noises) a norm above the clipping norm. Nothing here
raises: a hostile reply can only get itself dropped.

With ``zero_invalid`` (central noise: the server noises what it aggregates) only a
structurally malformed reply (error, unexpected records, missing or extra keys,
wrong shapes or dtypes, undecodable bytes, bad metrics) is dropped. An owner whose
arrays are well-formed but whose *values* are invalid (NaN or Inf, or a norm above
``max_norm`` beyond :data:`NORM_SLACK`) is kept with all-zero arrays and the reason
in :attr:`ValidReplies.zeroed`: its contribution to the noised sum is then zero,
a function of its own reply only, and the sum's denominator stays the expected
count. The server re-clips every kept contribution before noising it
(:meth:`flwr_jdp.strategies.JointDP._aggregate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from flwr_jdp.joint_dp import protocol
from flwr_jdp.privacy.mechanisms import global_norm_numpy
from flwr_jdp.records import ArraySpec, spec_of  # noqa: F401 - re-exported

#: Relative slack on the clipping norm check (float32 rounding). An update within
#: it is accepted and re-clipped to exactly the clipping norm by the server before
#: any noise is added; never trusted as it is.
NORM_SLACK = 1e-3

#: Probability that an honest owner's Poisson sample holds more units than
#: :func:`max_sampled_units` (per owner and round).
SAMPLE_TAIL = 1e-9



@dataclass
class ValidReplies:
    """Owner id -> arrays (in spec order) and weight; and the drop reasons.

    ``zeroed``: owners kept in ``arrays`` with all-zero arrays because their values
    were invalid (``zero_invalid``), with the reason."""

    arrays: dict[int, list[np.ndarray]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    zeroed: dict[int, str] = field(default_factory=dict)



def check_arrays(record: object, spec: dict[str, ArraySpec], max_norm: float | None) -> str | None:
    """Reason to reject one owner's ArrayRecord, or None if it is valid."""
    arrays, reason = decode_arrays(record, spec)
    return reason if arrays is None else check_values(arrays, spec, max_norm)


def decode_arrays(record: object, spec: dict[str, ArraySpec]) -> tuple[list[np.ndarray] | None, str | None]:
    """The arrays of one owner's ArrayRecord in spec order, or the reason it is
    structurally malformed (type, keys, shapes, dtypes, bytes); values unchecked."""
    if not isinstance(record, ArrayRecord):
        return None, f"expected an ArrayRecord, got {type(record).__name__}"
    keys = set(record.keys())
    if keys != set(spec):
        extra, missing = sorted(keys - set(spec)), sorted(set(spec) - keys)
        return None, f"array keys differ from the shared parameters (extra={extra}, missing={missing})"
    arrays = []
    for name, want in spec.items():
        arr = record[name]
        if tuple(arr.shape) != want.shape:
            return None, f"array '{name}' has shape {tuple(arr.shape)}, expected {want.shape}"
        if str(arr.dtype) != want.dtype:
            return None, f"array '{name}' has dtype {arr.dtype}, expected {want.dtype}"
        try:
            value = arr.numpy()
        except Exception as err:  # noqa: BLE001 - malformed bytes from a client
            return None, f"array '{name}' cannot be decoded: {err}"
        if tuple(value.shape) != want.shape or str(value.dtype) != want.dtype:
            return None, f"array '{name}' decodes to {value.dtype}{tuple(value.shape)}, expected {want.dtype}{want.shape}"
        arrays.append(value)
    return arrays, None


def check_values(arrays: list[np.ndarray], spec: dict[str, ArraySpec], max_norm: float | None) -> str | None:
    """Reason the values of well-formed ``arrays`` are invalid (NaN or Inf; a global
    norm above ``max_norm * (1 + NORM_SLACK)``), or None."""
    for name, value in zip(spec, arrays, strict=True):
        if not np.all(np.isfinite(value)):
            return f"array '{name}' has NaN or Inf values"
    if max_norm is not None:
        norm = global_norm_numpy(arrays)
        if norm > max_norm * (1 + NORM_SLACK):
            return f"update norm {norm:.4g} exceeds the clipping norm {max_norm:.4g}"
    return None


def max_sampled_units(num_units: int, rate: float, tail: float = SAMPLE_TAIL) -> int:
    """A public bound on the units in one Poisson sample (rate ``rate``) of
    ``num_units`` units, exceeded with probability at most ``tail``: ``num_units``
    when ``rate >= 1``, else ``min(num_units, ceil(mu + t))`` with ``mu = n q`` and
    ``t = L/3 + sqrt(L^2/9 + 2 L mu)``, ``L = ln(1/tail)`` (Bernstein's inequality,
    ``P(X - mu >= t) <= exp(-t^2 / (2 (mu + t/3)))``)."""
    n = max(0, int(num_units))
    if rate >= 1.0 or n == 0:
        return n
    mu = n * float(rate)
    log_tail = math.log(1.0 / tail)
    t = log_tail / 3.0 + math.sqrt(log_tail**2 / 9.0 + 2.0 * log_tail * mu)
    return min(n, math.ceil(mu + t))


def check_metrics(record: object, required: tuple[str, ...]) -> tuple[dict[str, float] | None, str | None]:
    """Parse one owner's MetricRecord: every required key a finite, non-negative number."""
    if not isinstance(record, MetricRecord):
        return None, f"expected a MetricRecord, got {type(record).__name__}"
    out = {}
    for key in required:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, f"metric '{key}' missing or not a number ({value!r})"
        if not math.isfinite(value) or value < 0:
            return None, f"metric '{key}' must be finite and >= 0, got {value!r}"
        out[key] = float(value)
    for key, value in record.items():  # the app's own metrics (drop-in): kept if numbers
        if key not in out and isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[key] = float(value)
    return out, None


def _owner_records(content, owners: list[int]) -> dict:
    """The records of a reply keyed per owner: a node hosting one owner may use
    Flower's standard keys (``arrays``, ``metrics``) for it (the drop-in client)."""
    records = dict(content.items())
    if len(owners) == 1:
        for std, keyed in ((protocol.ARRAYS, protocol.owner_key(owners[0])),
                           (protocol.METRICS, protocol.metrics_key(owners[0]))):
            if std in records and keyed not in records:
                records[keyed] = records.pop(std)
    return records


def validate_replies(
    replies: list[Message],
    requested: dict[int, list[int]],
    spec: dict[str, ArraySpec] | None,
    *,
    max_norm: float | None = None,
    required_metrics: tuple[str, ...] = (protocol.NUM_EXAMPLES,),
    zero_invalid: bool = False,
) -> ValidReplies:
    """Check every reply; ``requested`` maps node id -> owners asked of it.

    ``spec`` None means the reply carries metrics only (evaluation).
    ``zero_invalid``: an owner whose arrays are well-formed but whose values are
    invalid is kept with zero arrays (reason in ``zeroed``) instead of dropped.
    """
    out = ValidReplies()
    for msg in replies:
        node = msg.metadata.src_node_id
        owners = requested.get(node)
        if owners is None:
            continue  # a reply from a node we did not ask: ignore
        if msg.has_error():
            for o in owners:
                out.dropped[o] = f"node {node} reported an error: {msg.error.reason}"
            continue
        content = _owner_records(msg.content, owners)
        allowed = {protocol.metrics_key(o) for o in owners}
        if spec is not None:
            allowed |= {protocol.owner_key(o) for o in owners}
        unexpected = sorted(set(content.keys()) - allowed)
        if unexpected:
            for o in owners:
                out.dropped[o] = f"node {node} sent unexpected records {unexpected}"
            continue
        for o in owners:
            reason = invalid = None
            arrays = None
            if spec is not None:
                rec = content.get(protocol.owner_key(o))
                arrays, reason = (None, "no array record") if rec is None else decode_arrays(rec, spec)
                if arrays is not None:
                    reason = check_values(arrays, spec, max_norm)
                    if reason is not None and zero_invalid:
                        invalid, reason = reason, None
                        arrays = [np.zeros(want.shape, dtype=want.dtype) for want in spec.values()]
            if reason is None:
                metrics, reason = check_metrics(content.get(protocol.metrics_key(o)), required_metrics)
            if reason is not None:
                out.dropped[o] = f"owner {o} (node {node}): {reason}"
                continue
            if invalid is not None:
                out.zeroed[o] = f"owner {o} (node {node}): {invalid}"
            if arrays is not None:
                out.arrays[o] = arrays
            out.metrics[o] = metrics
            out.weights[o] = metrics.get(protocol.NUM_EXAMPLES, 1.0)
    for owners in requested.values():
        for o in owners:
            if o not in out.metrics and o not in out.dropped:
                out.dropped[o] = f"owner {o}: no reply"
    return out
