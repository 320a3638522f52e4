"""Local trainers: non-private, DP-SGD on shared parameters, per-unit gradient sums."""

from .dp_sgd import clipped_gradient_sum, clipped_unit_sum, poisson_sample, train_dp_sgd
from .plain import evaluate, train_plain

__all__ = [
    "clipped_gradient_sum",
    "clipped_unit_sum",
    "evaluate",
    "poisson_sample",
    "train_dp_sgd",
    "train_plain",
]
