"""Where each data subject's records sit: the subject-to-silo map.

A subject's records are spread over ``s`` silos either uniformly or by the power
distribution ``P(x; alpha) = alpha x^(alpha - 1)`` on [0, 1] (Marathe et al.,
appendix E.2): each record draws ``x = u^(1/alpha)`` (``u`` uniform) and goes to
silo ``floor(s x)`` of a per-subject random ordering of the silos, so every subject
concentrates on its own few silos as ``alpha`` grows (``alpha = 1``: uniform).

The counts matrix (subjects x silos, records of each subject at each silo) is what
the horizontal accountant composes. It is metadata: exact accounting assumes it is
known to whoever accounts (e.g. a registry of which silos hold which subject);
the s-fold bound needs only each silo's largest per-subject count.
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
