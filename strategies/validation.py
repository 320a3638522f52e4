"""Validation of owners' replies before anything is aggregated.

A reply is dropped, with a logged reason, when the node reported an error, when it
carries a record that is not an expected owner record (for example an owner trying
to send personal layers, or an owner it was not asked to train), or when an owner's
arrays have missing or extra keys, wrong shapes or dtypes, non-finite values, or
(for clipped updates the server noises) a norm above the clipping norm. Nothing here
raises: a hostile reply can only get itself dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from flwr_jdp import protocol
from flwr_jdp.privacy.mechanisms import global_norm_numpy

#: Relative slack on the clipping norm check (float32 rounding).
NORM_SLACK = 1e-3


@dataclass(frozen=True)
class ArraySpec:
    """Expected shape and dtype of one shared parameter."""

    shape: tuple[int, ...]
    dtype: str


@dataclass
class ValidReplies:
    """Owner id -> arrays (in spec order) and weight; and the drop reasons."""

    arrays: dict[int, list[np.ndarray]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)


def spec_of(record: ArrayRecord) -> dict[str, ArraySpec]:
    """Spec of every array in ``record`` (the global shared parameters)."""
    return {k: ArraySpec(tuple(a.shape), str(a.dtype)) for k, a in record.items()}


def check_arrays(record: object, spec: dict[str, ArraySpec], max_norm: float | None) -> str | None:
    """Reason to reject one owner's ArrayRecord, or None if it is valid."""
    if not isinstance(record, ArrayRecord):
        return f"expected an ArrayRecord, got {type(record).__name__}"
    keys = set(record.keys())
    if keys != set(spec):
        extra, missing = sorted(keys - set(spec)), sorted(set(spec) - keys)
        return f"array keys differ from the shared parameters (extra={extra}, missing={missing})"
    arrays = []
    for name, want in spec.items():
        arr = record[name]
        if tuple(arr.shape) != want.shape:
            return f"array '{name}' has shape {tuple(arr.shape)}, expected {want.shape}"
        if str(arr.dtype) != want.dtype:
            return f"array '{name}' has dtype {arr.dtype}, expected {want.dtype}"
        try:
            value = arr.numpy()
        except Exception as err:  # noqa: BLE001 - malformed bytes from a client
            return f"array '{name}' cannot be decoded: {err}"
        if not np.all(np.isfinite(value)):
            return f"array '{name}' has NaN or Inf values"
        arrays.append(value)
    if max_norm is not None:
        norm = global_norm_numpy(arrays)
        if norm > max_norm * (1 + NORM_SLACK):
            return f"update norm {norm:.4g} exceeds the clipping norm {max_norm:.4g}"
    return None


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
    return out, None


def validate_replies(
    replies: list[Message],
    requested: dict[int, list[int]],
    spec: dict[str, ArraySpec] | None,
    *,
    max_norm: float | None = None,
    required_metrics: tuple[str, ...] = (protocol.NUM_EXAMPLES,),
) -> ValidReplies:
    """Check every reply; ``requested`` maps node id -> owners asked of it.

    ``spec`` None means the reply carries metrics only (evaluation).
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
        content = msg.content
        allowed = {protocol.metrics_key(o) for o in owners}
        if spec is not None:
            allowed |= {protocol.owner_key(o) for o in owners}
        unexpected = sorted(set(content.keys()) - allowed)
        if unexpected:
            for o in owners:
                out.dropped[o] = f"node {node} sent unexpected records {unexpected}"
            continue
        for o in owners:
            reason = None
            arrays = None
            if spec is not None:
                rec = content.get(protocol.owner_key(o))
                reason = "no array record" if rec is None else check_arrays(rec, spec, max_norm)
                if reason is None:
                    arrays = [rec[k].numpy() for k in spec]
            if reason is None:
                metrics, reason = check_metrics(content.get(protocol.metrics_key(o)), required_metrics)
            if reason is not None:
                out.dropped[o] = f"owner {o} (node {node}): {reason}"
                continue
            if arrays is not None:
                out.arrays[o] = arrays
            out.metrics[o] = metrics
            out.weights[o] = metrics.get(protocol.NUM_EXAMPLES, 1.0)
    for owners in requested.values():
        for o in owners:
            if o not in out.metrics and o not in out.dropped:
                out.dropped[o] = f"owner {o}: no reply"
    return out
