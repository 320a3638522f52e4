"""Label-skewed partitions of a data set among owners, and users within an owner.

Two partitioners, both giving every owner at most ``classes_per_owner`` classes:

``balanced`` (default; the papers' "split evenly")
    ``max_records`` training records are split so that every owner holds exactly
    ``N // n`` or ``N // n + 1`` records. Owner ``o`` holds the ``k`` classes at
    positions ``o*k .. o*k+k-1`` (mod the number of classes) of a seeded class
    permutation, so every class is held by as many owners as possible alike; each
    owner's size is spread evenly over its classes, and each class's records are
    drawn at random (seeded) from the whole training set.
``pathological``
    flwr-datasets' ``PathologicalPartitioner`` on a random ``max_records`` subset
    (sizes vary from owner to owner).

The test set is split "in the same manner": every owner's test split holds only
the classes of its training split, and the test records of each class are dealt
evenly among the owners holding that class.

For hyperparameter tuning, ``validation_fraction > 0`` replaces every owner's test
split by a validation split of *training-set* records; the test set is then not
touched at all. Two sources (``validation_source``):

``carve`` (default)
    a seeded random ``validation_fraction`` of the owner's own training split; the
    owner trains on the rest. With few records per owner this is pessimistic for
    models that lean on the owner's own label distribution (personal layers,
    per-silo training): a held-out record leaves its class rarer in what the owner
    trains on. On Fashion-MNIST, N = 10,000, 8 classes per owner, the class of a
    held-out record has, on average, 0.083 of the remaining training records at
    n = 512 and 0.103 at n = 256, against 0.125 for a test record
    (``examples/joint_dp/validation_bias.py``; ``tests/test_partition.py`` checks
    the effect on the embedded digits).
``pool``
    training-set records that no owner holds (outside the ``max_records`` subset),
    dealt exactly as the test split is: for every class as many as the test set
    holds, split evenly among the owners of that class. The owners' training splits
    are those of the test runs, unchanged, so a tuning run trains on exactly the
    records (and under exactly the privacy schedule) of the cell it tunes;
    ``validation_fraction`` only switches validation on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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


VALIDATION_SOURCES = ("carve", "pool")


def _subset_index(num_train: int, max_records: int, seed: int) -> np.ndarray:
    """Training-set indices of the pathological partitioner's random subset."""
    if max_records <= 0 or max_records >= num_train:
        return np.arange(num_train)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_train, size=max_records, replace=False))


def _subset(ds: ArrayDataset, max_records: int, seed: int) -> ArrayDataset:
    if max_records <= 0 or max_records >= len(ds.y_train):
        return ds
    idx = _subset_index(len(ds.y_train), max_records, seed)
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


def balanced_indices(
    labels: np.ndarray, num_owners: int, classes_per_owner: int, total: int, seed: int
) -> tuple[tuple[np.ndarray, ...], tuple[tuple[int, ...], ...]]:
    """Training indices and class sets per owner, every owner ``total // n`` or
    ``total // n + 1`` records (see the module docstring)."""
    rng = np.random.default_rng(seed)
    present = np.unique(labels)
    num_classes = len(present)
    k = min(classes_per_owner, num_classes)
    order = present[rng.permutation(num_classes)]
    classes = [[int(order[(o * k + j) % num_classes]) for j in range(k)] for o in range(num_owners)]
    sizes = [total // num_owners + (1 if o < total % num_owners else 0) for o in range(num_owners)]
    # slot[o][j]: records owner o takes from its j-th class
    slots = [[len(chunk) for chunk in np.array_split(np.arange(sizes[o]), k)] for o in range(num_owners)]
    available = {int(c): int((labels == c).sum()) for c in present}

    def demand() -> dict[int, int]:
        out = dict.fromkeys(available, 0)
        for o in range(num_owners):
            for j, c in enumerate(classes[o]):
                out[c] += slots[o][j]
        return out

    need = demand()
    for c in sorted(available, key=lambda c: available[c] - need[c]):
        # move the excess of a short class to the same owners' other classes
        while need[c] > available[c]:
            moved = False
            for o in range(num_owners):
                if c not in classes[o] or need[c] <= available[c]:
                    continue
                j = classes[o].index(c)
                spare = [i for i, d in enumerate(classes[o]) if d != c and need[d] < available[d]]
                if slots[o][j] == 0 or not spare:
                    continue
                i = max(spare, key=lambda i: available[classes[o][i]] - need[classes[o][i]])
                slots[o][j] -= 1
                slots[o][i] += 1
                need[c] -= 1
                need[classes[o][i]] += 1
                moved = True
            if not moved:
                raise ValueError(
                    f"cannot split {total} records evenly among {num_owners} owners with "
                    f"{k} classes each: class {c} has only {available[c]} records"
                )
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in available}
    indices = []
    for o in range(num_owners):
        idx: list[int] = []
        for j, c in enumerate(classes[o]):
            idx.extend(pools[c][: slots[o][j]])
            del pools[c][: slots[o][j]]
        indices.append(np.sort(np.asarray(idx, dtype=np.int64)))
    held = tuple(tuple(sorted(int(c) for c in np.unique(labels[i]))) for i in indices)
    return tuple(indices), held


def _deal_by_class(y_ref: np.ndarray, classes: tuple[tuple[int, ...], ...],
                   draw: Callable[[int, list[int]], np.ndarray]) -> list[np.ndarray]:
    """Indices per owner: for every class of ``y_ref`` that some owner holds (in
    class order), ``draw(class, holders)`` gives the class's records in random order,
    and they are split evenly among the owners holding the class."""
    per_owner: list[list[int]] = [[] for _ in classes]
    for c in np.unique(y_ref):
        holders = [o for o, cls in enumerate(classes) if int(c) in cls]
        if not holders:
            continue
        idx = draw(int(c), holders)
        for k, chunk in enumerate(np.array_split(idx, len(holders))):
            per_owner[holders[k]].extend(chunk.tolist())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in per_owner]


def _split_test(y_test: np.ndarray, classes: tuple[tuple[int, ...], ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return _deal_by_class(y_test, classes, lambda c, _: rng.permutation(np.flatnonzero(y_test == c)))


def split_pool(y_train: np.ndarray, used: np.ndarray, y_test: np.ndarray,
               classes: tuple[tuple[int, ...], ...], seed: int) -> list[np.ndarray]:
    """Validation indices (into the training set) per owner, from the training
    records whose indices are not in ``used``: for every class, as many as
    ``y_test`` holds of it, split evenly among the owners holding the class, as
    :func:`_split_test` deals the test records. Raises ``ValueError`` naming the
    class when fewer records are left than the class has owners."""
    rng = np.random.default_rng([seed, 29])
    free = np.ones(len(y_train), dtype=bool)
    free[np.asarray(used, dtype=np.int64)] = False

    def draw(c: int, holders: list[int]) -> np.ndarray:
        pool = np.flatnonzero(free & (y_train == c))
        if len(pool) < len(holders):
            raise ValueError(
                f"run-config key 'validation-source'='pool': class {c} has {len(pool)} "
                f"training records outside the 'max-records' subset, fewer than its "
                f"{len(holders)} owners; lower 'max-records' or use 'carve'")
        return rng.permutation(pool)[: int(np.sum(y_test == c))]

    return _deal_by_class(y_test, classes, draw)


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
    partitioner: str = "balanced",
    validation_fraction: float = 0.0,
    validation_source: str = "carve",
) -> tuple[OwnerData, ...]:
    """All owners' data for one configuration, built once per process.

    ``validation_fraction > 0`` evaluates on a validation split from ``validation_source``
    (module docstring) instead of the test split."""
    if validation_source not in VALIDATION_SOURCES:
        raise ValueError(f"validation_source must be one of {VALIDATION_SOURCES}, got {validation_source!r}")
    full = load_dataset(dataset, data_dir, seed)
    ds = _subset(full, max_records, seed) if partitioner == "pathological" else full
    total = len(full.y_train) if max_records <= 0 else min(max_records, len(full.y_train))
    if num_owners > total:
        raise ValueError(f"num-owners={num_owners} exceeds the {total} training records")
    if partitioner == "pathological":
        indices, classes = partition_indices(
            tuple(int(v) for v in ds.y_train), num_owners, classes_per_owner, seed
        )
    elif partitioner == "balanced":
        indices, classes = balanced_indices(ds.y_train, num_owners, classes_per_owner, total, seed)
    else:
        raise ValueError(f"partitioner must be 'balanced' or 'pathological', got {partitioner!r}")
    test_idx = _split_test(ds.y_test, classes, seed)
    pooled = validation_fraction > 0 and validation_source == "pool"
    if pooled:  # indices into the full training set of every record some owner may hold
        used = (_subset_index(len(full.y_train), max_records, seed) if partitioner == "pathological"
                else np.concatenate(indices))
        val_idx = split_pool(full.y_train, used, ds.y_test, classes, seed)
    owners = []
    for o in range(num_owners):
        tr = indices[o]
        x_test, y_test = ds.x_test[test_idx[o]], ds.y_test[test_idx[o]]
        if pooled:
            x_test, y_test = full.x_train[val_idx[o]], full.y_train[val_idx[o]]
        elif validation_fraction > 0:
            perm = np.random.default_rng([seed, o, 17]).permutation(tr)
            held = int(round(validation_fraction * len(tr)))
            held = min(max(held, 1), len(tr) - 1) if len(tr) > 1 else 0
            val, tr = np.sort(perm[:held]), np.sort(perm[held:])
            x_test, y_test = ds.x_train[val], ds.y_train[val]
        owners.append(
            OwnerData(
                owner_id=o,
                x_train=ds.x_train[tr],
                y_train=ds.y_train[tr],
                x_test=x_test,
                y_test=y_test,
                user_ids=assign_users(len(tr), records_per_user, seed + 7919 * (o + 1)),
                classes=classes[o],
            )
        )
    return tuple(owners)
