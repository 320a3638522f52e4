"""Synthetic users for shared-embedding linear regression (paper section 4, eq. 2).

``x_ij ~ N(0, I_d)``, ``v_j* ~ N(0, I_k)``, ``U*`` a ``d x k`` matrix with
orthonormal columns, ``y_ij = <U*^T x_ij, v_j*> + N(0, sigma_F^2)``.

Users are generated in fixed blocks of :data:`BLOCK` users, each block from its own
seed, so any process (a SuperNode hosting some blocks, or the single-process
reference) produces bit-identical users without moving data around.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flwr_jdp.config_check import need

#: Users per generated block (the unit of data placement on SuperNodes).
BLOCK = 500


@dataclass(frozen=True)
class ProblemSpec:
    """The data-generating process: sizes, field noise and seed (all public)."""

    num_users: int = 50_000
    samples_per_user: int = 10
    dim: int = 50
    rank: int = 2
    field_noise: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        need(self.num_users >= 1, "num-users", ">= 1", self.num_users)
        need(self.samples_per_user >= 2, "samples-per-user", ">= 2", self.samples_per_user)
        need(self.dim >= 1, "dim", ">= 1", self.dim)
        need(1 <= self.rank <= self.dim, "rank", f"in [1, dim] = [1, {self.dim}]", self.rank)
        need(self.field_noise >= 0, "field-noise", ">= 0", self.field_noise)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_users // BLOCK)


@dataclass(frozen=True)
class Users:
    """A set of users: ``x`` (n, m, d), ``y`` (n, m), true ``v`` (n, k), ids (n,)."""

    ids: np.ndarray
    x: np.ndarray
    y: np.ndarray
    v_true: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@lru_cache(maxsize=16)
def true_embedding(spec: ProblemSpec) -> np.ndarray:
    """``U*``: ``d x k`` with orthonormal columns (Q factor of a Gaussian matrix)."""
    rng = np.random.default_rng([spec.seed, 0xE1B])
    q, _ = np.linalg.qr(rng.standard_normal((spec.dim, spec.rank)))
    return q


def block_users(spec: ProblemSpec, block: int) -> Users:
    """The users of one block (deterministic in ``spec`` and ``block``)."""
    if not 0 <= block < spec.num_blocks:
        raise ValueError(f"block {block} out of range [0, {spec.num_blocks})")
    start = block * BLOCK
    count = min(BLOCK, spec.num_users - start)
    rng = np.random.default_rng([spec.seed, 0xDA7A, block])
    m, d, k = spec.samples_per_user, spec.dim, spec.rank
    x = rng.standard_normal((count, m, d))
    v = rng.standard_normal((count, k))
    theta = v @ true_embedding(spec).T  # (count, d)
    y = np.einsum("jid,jd->ji", x, theta) + spec.field_noise * rng.standard_normal((count, m))
    return Users(np.arange(start, start + count), x, y, v)


def concat(parts: list[Users]) -> Users:
    """Concatenate user sets (in the given order)."""
    return Users(
        np.concatenate([p.ids for p in parts]),
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        np.concatenate([p.v_true for p in parts]),
    )


def users_of_blocks(spec: ProblemSpec, blocks: list[int]) -> Users:
    """The users of several blocks, concatenated in block order."""
    return concat([block_users(spec, b) for b in sorted(blocks)])


def all_users(spec: ProblemSpec) -> Users:
    """Every user of the problem (the single-process reference)."""
    return users_of_blocks(spec, list(range(spec.num_blocks)))


def node_blocks(spec: ProblemSpec, partition_id: int, num_partitions: int) -> list[int]:
    """Blocks hosted by SuperNode ``partition_id`` of ``num_partitions`` (round robin)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} not in [0, {num_partitions})")
    return list(range(partition_id, spec.num_blocks, num_partitions))


def user_groups(ids: np.ndarray, num_users: int, groups: int) -> np.ndarray:
    """Algorithm 1, lines 2 and 4: a uniformly random (public, data-independent)
    permutation of the users, cut into ``groups`` disjoint consecutive groups
    ``S_t``; returns the group of every user id in ``ids``."""
    if groups <= 1:
        return np.zeros(len(ids), dtype=np.int64)
    rank = np.empty(num_users, dtype=np.int64)
    rank[np.random.default_rng([0x5EED, num_users, groups]).permutation(num_users)] = np.arange(num_users)
    return (rank[np.asarray(ids)] * groups) // num_users


def subset(users: Users, mask: np.ndarray) -> Users:
    return Users(users.ids[mask], users.x[mask], users.y[mask], users.v_true[mask])
