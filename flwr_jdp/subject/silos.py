"""Where each data subject's records sit: the subject-to-silo map.

A subject's records are spread over ``s`` silos either uniformly or by the power
distribution ``P(x; alpha) = alpha x^(alpha - 1)`` on [0, 1] (Marathe et al.,
appendix E.2): each record draws ``x = u^(1/alpha)`` (``u`` uniform) and goes to
silo ``floor(s x)`` of a per-subject random ordering of the silos, so every subject
concentrates on its own few silos as ``alpha`` grows (``alpha = 1``: uniform).

The counts matrix (subjects x silos, records of each subject at each silo) is what
the horizontal accountant composes in the reported-counts mode
(``max-records-per-subject = 0``). It is data-dependent metadata, not DP: exact
accounting assumes it is known to whoever accounts. In the default public-cap mode
each silo instead truncates every subject to at most ``K`` records
(:func:`truncate_per_subject`) and the server accounts for the worst-case subject,
``K`` records at every silo, without seeing any count.
"""

from __future__ import annotations

import numpy as np


def assign_records(subject_of_record: np.ndarray, num_silos: int, alpha: float = 1.0,
                   seed: int = 0) -> np.ndarray:
    """Silo index of every record."""
    if num_silos < 1:
        raise ValueError(f"num-silos must be >= 1, got {num_silos}")
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1 (1 = uniform), got {alpha}")
    subjects = np.asarray(subject_of_record, dtype=np.int64)
    rng = np.random.default_rng(seed)
    num_subjects = int(subjects.max()) + 1 if len(subjects) else 0
    orders = np.argsort(rng.random((num_subjects, num_silos)), axis=1)  # per-subject ordering
    x = rng.random(len(subjects)) ** (1.0 / alpha)
    slot = np.minimum((x * num_silos).astype(np.int64), num_silos - 1)
    return orders[subjects, slot]


def subject_silo_counts(subject_of_record: np.ndarray, silo_of_record: np.ndarray,
                        num_subjects: int, num_silos: int) -> np.ndarray:
    """Records of each subject at each silo, shape (subjects, silos)."""
    counts = np.zeros((num_subjects, num_silos), dtype=np.int64)
    np.add.at(counts, (np.asarray(subject_of_record), np.asarray(silo_of_record)), 1)
    return counts


def truncate_per_subject(subject_of_record: np.ndarray, max_records: int,
                         seed: tuple[int, ...] = (0,)) -> np.ndarray:
    """Indices (ascending) of the records kept when every subject keeps at most
    ``max_records`` of its records (all of them if it has no more).

    Which records of a subject are kept is a uniformly random choice made by a
    generator seeded with ``(*seed, subject id)`` (a public local seed): it depends
    on that subject's own records only, so adding or removing one subject changes
    the kept records of that subject alone (a per-subject local transformation)."""
    subjects = np.asarray(subject_of_record, dtype=np.int64)
    if max_records < 1:
        raise ValueError(f"max_records must be >= 1, got {max_records}")
    keep = np.ones(len(subjects), dtype=bool)
    ids, inverse, counts = np.unique(subjects, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")  # each subject's records, contiguous, in data order
    starts = np.cumsum(counts) - counts
    for j in np.flatnonzero(counts > max_records):
        rows = order[starts[j]:starts[j] + counts[j]]
        rng = np.random.default_rng([int(x) % (1 << 64) for x in (*seed, ids[j])])
        keep[rows[rng.permutation(len(rows))[max_records:]]] = False
    return np.flatnonzero(keep)
