"""Local trainers: non-private, DP-SGD on shared parameters, per-owner rounds."""

from .dp_sgd import clipped_gradient_sum, clipped_unit_sum, poisson_sample, train_dp_sgd
from .owner_round import (
    OwnerPlan,
    adapted_model,
    fit_personal,
    release_kind,
    release_model,
    train_owner_round,
)
from .plain import evaluate, train_plain

__all__ = [
    "OwnerPlan",
    "adapted_model",
    "clipped_gradient_sum",
    "clipped_unit_sum",
    "evaluate",
    "fit_personal",
    "poisson_sample",
    "release_kind",
    "release_model",
    "train_dp_sgd",
    "train_owner_round",
    "train_plain",
]
