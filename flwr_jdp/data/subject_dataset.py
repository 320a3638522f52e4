"""Train/test arrays in which every training record belongs to a data subject."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SubjectDataset:
    """Train/test arrays with the data subject of every training record."""

    x_train: np.ndarray
    y_train: np.ndarray
    subject_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_subjects: int
    num_classes: int

    def validation_split(self, fraction: float, seed: int) -> tuple[SubjectDataset, tuple[np.ndarray, np.ndarray]]:
        """Carve a random ``fraction`` of the training records off as a validation
        set (for tuning; the test set is never used to choose anything)."""
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(self.y_train))
        cut = int(round(fraction * len(order)))
        val, keep = np.sort(order[:cut]), np.sort(order[cut:])
        train = SubjectDataset(self.x_train[keep], self.y_train[keep], self.subject_train[keep],
                               self.x_test, self.y_test, self.num_subjects, self.num_classes)
        return train, (self.x_train[val], self.y_train[val])
