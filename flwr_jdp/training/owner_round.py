"""What one owner does in one round, for every method, unit and noise placement.

The function returns the owner's *release* (the only thing that leaves it) and
updates its model in place; the caller keeps the personal parameters. Releases:

===========  ==========  =========================================================
unit         placement   release (shared parameters only)
===========  ==========  =========================================================
record/user  local       shared params after DP-SGD (noise added at every step)
record/user  central     sum of clipped per-unit gradients of one Poisson sample
owner        local       update clipped to C plus N(0, (z C)^2 I)
owner        central     update clipped to C (server adds the noise)
(no DP)      --          shared params after ordinary training (FedAvg)
===========  ==========  =========================================================

Personal parameters are trained on the owner's data without noise in every case.
No training loss or other data-dependent statistic is returned (it would not be
covered by the DP guarantee).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import protocol
from ..config import JobConfig
from ..data.partition import OwnerData
from ..params import ParamSplit, get_arrays
from ..privacy.mechanisms import GaussianSumMechanism, clip_numpy, numpy_rng
from ..privacy.units import NoisePlacement, PrivacyUnit
from .dp_sgd import clipped_gradient_sum, train_dp_sgd
from .plain import train_plain


@dataclass(frozen=True)
class OwnerPlan:
    """What the server accounts for this owner this round."""

    sample_rate: float
    steps: int
    noise_multiplier: float


def release_kind(cfg: JobConfig) -> str:
    """What the arrays of a train reply mean under ``cfg``."""
    if not cfg.dp:
        return protocol.KIND_PARAMS
    if cfg.unit is PrivacyUnit.OWNER:
        return protocol.KIND_DELTA
    if cfg.placement is NoisePlacement.CENTRAL:
        return protocol.KIND_GRAD_SUM
    return protocol.KIND_PARAMS


def train_owner_round(
    model: nn.Module,
    split: ParamSplit,
    data: OwnerData,
    cfg: JobConfig,
    plan: OwnerPlan,
    generator: torch.Generator,
) -> tuple[dict[str, np.ndarray], float]:
    """Train one owner for one round; return (release arrays, local training loss).

    The loss is for the owner's own log only and must not be sent.
    """
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    personal = [params[n] for n in split.personal]
    user_ids = data.user_ids if cfg.unit is PrivacyUnit.USER else None
    kind = release_kind(cfg)

    if not cfg.dp:
        loss = train_plain(model, shared + personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.learning_rate, generator=generator)
        return dict(get_arrays(model, split.shared)), loss

    if kind == protocol.KIND_DELTA:
        before = get_arrays(model, split.shared)
        loss = train_plain(model, shared + personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.learning_rate, generator=generator)
        after = get_arrays(model, split.shared)
        delta = clip_numpy([after[n] - before[n] for n in split.shared], cfg.clipping_norm)
        if cfg.placement is NoisePlacement.LOCAL:
            mech = GaussianSumMechanism(plan.noise_multiplier, cfg.clipping_norm, 1.0)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            delta = mech.release_numpy(delta, numpy_rng(seed))
        return dict(zip(split.shared, delta, strict=False)), loss

    if kind == protocol.KIND_GRAD_SUM:
        loss = train_plain(model, personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.personal_learning_rate, generator=generator)
        sums, _ = clipped_gradient_sum(model, split, data.x_train, data.y_train,
                                       user_ids=user_ids, clipping_norm=cfg.clipping_norm,
                                       sample_rate=plan.sample_rate, generator=generator)
        return dict(zip(split.shared, sums, strict=False)), loss

    loss = train_dp_sgd(model, split, data.x_train, data.y_train, user_ids=user_ids,
                        noise_multiplier=plan.noise_multiplier,
                        clipping_norm=cfg.clipping_norm, sample_rate=plan.sample_rate,
                        steps=plan.steps, lr=cfg.learning_rate,
                        personal_lr=cfg.personal_learning_rate, generator=generator)
    return dict(get_arrays(model, split.shared)), loss
