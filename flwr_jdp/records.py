"""Helpers for Flower records shared by every system's messages.

Not a protocol: each system's message keys live in its own ``protocol`` module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord


@dataclass(frozen=True)
class ArraySpec:
    """Expected shape and dtype of one shared parameter."""

    shape: tuple[int, ...]
    dtype: str


def spec_of(record: ArrayRecord) -> dict[str, ArraySpec]:
    """Spec of every array in ``record`` (the global shared parameters)."""
    return {k: ArraySpec(tuple(a.shape), str(a.dtype)) for k, a in record.items()}


def hosted_owners(num_owners: int, partition_id: int, num_partitions: int) -> list[int]:
    """Owners hosted by the node with ``partition_id`` out of ``num_partitions``."""
    return [o for o in range(num_owners) if o % num_partitions == partition_id]


def to_record(named: dict) -> ArrayRecord:
    """An ArrayRecord of named numpy arrays (key order preserved)."""
    if not named:
        return ArrayRecord()
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in named.items()})
