"""Label-skewed partitions of a data set among owners, and users within an owner.

Training records are split among ``num_owners`` owners with flwr-datasets'
``PathologicalPartitioner`` (each owner holds at most ``classes_per_owner``
classes). The test set is split "in the same manner": every owner's test split
holds only the classes of its training split, and the test records of each class
are dealt evenly among the owners holding that class.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .datasets import ArrayDataset, load_dataset


@dataclass(frozen=True)
class OwnerData:
    """One owner's arrays. ``user_ids`` maps each training record to its user."""

    owner_id: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    user_ids: np.ndarray
    classes: tuple[int, ...]

    @property
    def num_users(self) -> int:
        return int(self.user_ids.max()) + 1 if len(self.user_ids) else 0


def _subset(ds: ArrayDataset, max_records: int, seed: int) -> ArrayDataset:
    if max_records <= 0 or max_records >= len(ds.y_train):
        return ds
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(ds.y_train), size=max_records, replace=False))
    return ArrayDataset(ds.x_train[idx], ds.y_train[idx], ds.x_test, ds.y_test)


@functools.lru_cache(maxsize=4)
def partition_indices(
    labels_key: tuple[int, ...], num_owners: int, classes_per_owner: int, seed: int
) -> tuple[tuple[np.ndarray, ...], tuple[tuple[int, ...], ...]]:
    """Training indices and class sets per owner (PathologicalPartitioner)."""
    import datasets
    from flwr_datasets.partitioner import PathologicalPartitioner

    labels = np.asarray(labels_key)
    num_classes = int(labels.max()) + 1
    table = datasets.Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})
    part = PathologicalPartitioner(
        num_partitions=num_owners,
        partition_by="label",
        num_classes_per_partition=min(classes_per_owner, num_classes),
        class_assignment_mode="first-deterministic",
        shuffle=True,
        seed=seed,
    )
    part.dataset = table
    indices, classes = [], []
    for pid in range(num_owners):
        idx = np.asarray(part.load_partition(pid)["idx"], dtype=np.int64)
        indices.append(idx)
        classes.append(tuple(sorted(int(c) for c in np.unique(labels[idx]))))
    return tuple(indices), tuple(classes)


def _split_test(y_test: np.ndarray, classes: tuple[tuple[int, ...], ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    per_owner: list[list[int]] = [[] for _ in classes]
    for c in np.unique(y_test):
        holders = [o for o, cls in enumerate(classes) if int(c) in cls]
        if not holders:
            continue
        idx = rng.permutation(np.flatnonzero(y_test == c))
        for k, chunk in enumerate(np.array_split(idx, len(holders))):
            per_owner[holders[k]].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in per_owner]


def assign_users(num_records: int, records_per_user: int, seed: int) -> np.ndarray:
    """Group an owner's records into users of ``records_per_user`` records each."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_records)
    users = np.empty(num_records, dtype=np.int64)
    users[order] = np.arange(num_records) // max(1, records_per_user)
    return users


@functools.lru_cache(maxsize=8)
def load_partitions(
    dataset: str,
    data_dir: str,
    num_owners: int,
    classes_per_owner: int,
    max_records: int,
    records_per_user: int,
    seed: int,
) -> tuple[OwnerData, ...]:
    """All owners' data for one configuration, built once per process."""
    ds = _subset(load_dataset(dataset, data_dir, seed), max_records, seed)
    if num_owners > len(ds.y_train):
        raise ValueError(
            f"num-owners={num_owners} exceeds the {len(ds.y_train)} training records"
        )
    indices, classes = partition_indices(
        tuple(int(v) for v in ds.y_train), num_owners, classes_per_owner, seed
    )
    test_idx = _split_test(ds.y_test, classes, seed)
    owners = []
    for o in range(num_owners):
        tr = indices[o]
        owners.append(
            OwnerData(
                owner_id=o,
                x_train=ds.x_train[tr],
                y_train=ds.y_train[tr],
                x_test=ds.x_test[test_idx[o]],
                y_test=ds.y_test[test_idx[o]],
                user_ids=assign_users(len(tr), records_per_user, seed + 7919 * (o + 1)),
                classes=classes[o],
            )
        )
    return tuple(owners)
