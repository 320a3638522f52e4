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

Personal coupling (record and user units; ``personal-coupling``)
    DP-SGD's per-step guarantee (sensitivity ``C`` per unit, composed adaptively)
    needs each step's gradient function to depend on the data only through the
    unit being differentiated and through earlier *released* outputs. Personal
    parameters trained without noise on the owner's data break this: removing one
    record changes them, and through them every other record's shared gradient, so
    one step's sensitivity is no longer bounded by ``C``.

    ``decoupled`` (default) keeps the guarantee. The release is computed on a copy
    of the model whose personal parameters hold their *public* seeded initial
    values and are frozen, so the shared release is plain DP-SGD (local) or a plain
    clipped sum (central) and the ledger's event is exact. The owner's own personal
    parameters are fitted separately (:func:`fit_personal`) with the shared
    parameters frozen at the broadcast values: a function of public DP output and
    the owner's own data (the billboard model), so the joint-DP guarantee holds.

    ``interleaved`` is the joint-DP paper's Algorithm 1: personal parameters are
    updated on the same batches and the shared gradients are taken through them.
    The ledger then records the DP-SGD event, but the record/user-level guarantee
    is *not* established; it is kept only to reproduce the paper and is logged as
    such. With the owner unit the owner's whole update is the unit, so coupling is
    irrelevant there and personal parameters train on the same batches.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flwr_jdp.data.partition import OwnerData
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.params import ParamSplit, get_arrays, set_arrays
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, clip_numpy, numpy_rng
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit
from flwr_jdp.training.dp_sgd import clipped_gradient_sum, train_dp_sgd
from flwr_jdp.training.plain import train_plain


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


def fit_personal(model: nn.Module, split: ParamSplit, data: OwnerData, cfg: JobConfig,
                 generator: torch.Generator) -> float:
    """Fit the owner's personal parameters on its own training data, shared
    parameters frozen (``local-epochs`` epochs of SGD at ``personal-learning-rate``);
    returns the mean loss (for the owner's own log only).

    With ``augment-shift`` > 0 every batch's images are randomly translated (the
    trunk is then run per batch, not cached). Used by the decoupled coupling.
    Nothing it computes is released: with the shared
    parameters at the broadcast (DP) values, the result is a function of public DP
    output and the owner's own data, which joint DP allows.
    """
    params = dict(model.named_parameters())
    personal = [params[n] for n in split.personal]
    if _head_only(model, split) and len(data.y_train) and not cfg.augment_shift:
        # The trunk is frozen and per-record: compute its features once and train
        # the head on them (same batches, same updates, one trunk pass in all).
        head = _Head(model)
        features = trunk_features(model, data.x_train)
        return train_plain(head, personal, features, data.y_train, epochs=cfg.local_epochs,
                           batch_size=cfg.batch_size, lr=cfg.personal_learning_rate,
                           generator=generator)
    return train_plain(model, personal, data.x_train, data.y_train, epochs=cfg.local_epochs,
                       batch_size=cfg.batch_size, lr=cfg.personal_learning_rate,
                       generator=generator, augment_shift=cfg.augment_shift)


class _Head(nn.Module):
    """``model.head`` as a module (its parameters are the model's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.head(features)


def _head_only(model: nn.Module, split: ParamSplit) -> bool:
    """True if ``model`` splits into a per-record ``trunk`` and a ``head`` (its
    ``HEAD_PREFIXES``) and every personal parameter is in the head."""
    prefixes = getattr(model, "HEAD_PREFIXES", None)
    if not prefixes or not callable(getattr(model, "trunk", None)):
        return False
    return bool(split.personal) and all(n.startswith(tuple(prefixes)) for n in split.personal)


@torch.no_grad()
def trunk_features(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """``model.trunk`` of every record of ``x`` (in chunks of ``batch_size``)."""
    xt = torch.from_numpy(np.ascontiguousarray(x))
    chunks = [model.trunk(xt[i : i + batch_size]) for i in range(0, len(xt), batch_size)]
    return torch.cat(chunks).numpy()


def adapted_model(model: nn.Module, data: OwnerData, cfg: JobConfig,
                  generator: torch.Generator) -> nn.Module:
    """The owner's evaluated model under ``finetune-epochs`` > 0: a copy of ``model``
    (broadcast shared + personal parameters) after ``finetune-epochs`` epochs of plain
    SGD on *all* its parameters over the owner's training records, in batches of
    ``batch-size`` at ``finetune-learning-rate``; ``model`` itself is not changed.

    Joint DP (unit: one record of another owner): the copy is a function of the
    broadcast, which is DP, and of this owner's own data, which joint DP lets the
    owner's own model use freely. It is never stored in ``context.state`` and never
    sent, so no release depends on it and the ledger records nothing for it.
    """
    out = copy.deepcopy(model)
    if cfg.finetune_epochs > 0:
        train_plain(out, list(out.parameters()), data.x_train, data.y_train, epochs=cfg.finetune_epochs,
                    batch_size=cfg.batch_size, lr=cfg.finetune_learning_rate, generator=generator,
                    augment_shift=cfg.augment_shift)
    return out


def release_model(model: nn.Module, split: ParamSplit,
                  public_personal: dict[str, np.ndarray]) -> nn.Module:
    """A copy of ``model`` whose personal parameters hold the public values
    ``public_personal`` and are frozen: the model a decoupled release is computed
    on (its shared gradients do not depend on the owner's personal state)."""
    out = copy.deepcopy(model)
    _set_public_frozen(out, split, public_personal)
    return out


def _set_public_frozen(model: nn.Module, split: ParamSplit,
                       public_personal: dict[str, np.ndarray]) -> None:
    """Set ``model``'s personal parameters to ``public_personal`` and freeze them."""
    missing = set(split.personal) - set(public_personal)
    if missing:
        raise ValueError(f"public values missing for personal parameters {sorted(missing)}")
    set_arrays(model, {n: public_personal[n] for n in split.personal})
    params = dict(model.named_parameters())
    for n in split.personal:
        params[n].requires_grad_(False)


@contextmanager
def public_personal_swapped(model: nn.Module, split: ParamSplit,
                            public_personal: dict[str, np.ndarray]) -> Iterator[nn.Module]:
    """``model`` itself as :func:`release_model` would copy it, for the block: its
    personal parameters hold the public values ``public_personal`` and are frozen.

    On exit every parameter and buffer of ``model`` holds its value from before
    the block again, with its ``requires_grad`` flag and each submodule's training
    mode, so the owner's model is left as it came (its gradients are cleared).
    Same release as on the copy (tests/test_fast_paths.py checks it bit for bit),
    without copying the model for every owner and round."""
    params = dict(model.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    flags = {n: p.requires_grad for n, p in params.items()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    modes = [(m, m.training) for m in model.modules()]
    try:
        _set_public_frozen(model, split, public_personal)
        yield model
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
                p.requires_grad_(flags[n])
                p.grad = None
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for m, mode in modes:
            m.training = mode


def train_owner_round(
    model: nn.Module,
    split: ParamSplit,
    data: OwnerData,
    cfg: JobConfig,
    plan: OwnerPlan,
    generator: torch.Generator,
    public_personal: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], float]:
    """Train one owner for one round; return (release arrays, local training loss).

    The loss is for the owner's own log only and must not be sent. Under the
    decoupled coupling (``cfg.decoupled``) ``public_personal`` (the seeded initial
    personal values) is required, the release is computed on ``model`` with those
    values swapped in (:func:`public_personal_swapped`, the model
    :func:`release_model` copies), and ``model`` (with the owner's personal state) is
    left as it came: fit its personal parameters with :func:`fit_personal`.
    """
    if cfg.decoupled:
        if public_personal is None:
            raise ValueError("the decoupled coupling needs the public initial personal values")
        with public_personal_swapped(model, split, public_personal) as release:
            return _decoupled_release(release, split, data, cfg, plan, generator)
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    personal = [params[n] for n in split.personal]
    user_ids = data.user_ids if cfg.unit is PrivacyUnit.USER else None
    kind = release_kind(cfg)

    if not cfg.dp:
        loss = train_plain(model, shared + personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.learning_rate, generator=generator, augment_shift=cfg.augment_shift)
        return dict(get_arrays(model, split.shared)), loss

    if kind == protocol.KIND_DELTA:
        before = get_arrays(model, split.shared)
        loss = train_plain(model, shared + personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.learning_rate, generator=generator, augment_shift=cfg.augment_shift)
        after = get_arrays(model, split.shared)
        delta = clip_numpy([after[n] - before[n] for n in split.shared], cfg.clipping_norm)
        if cfg.placement is NoisePlacement.LOCAL:
            mech = GaussianSumMechanism(plan.noise_multiplier, cfg.clipping_norm, 1.0,
                                        secure=cfg.secure_noise)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            delta = mech.release_numpy(delta, numpy_rng(seed))
        return dict(zip(split.shared, delta, strict=False)), loss

    if kind == protocol.KIND_GRAD_SUM:
        loss = train_plain(model, personal, data.x_train, data.y_train,
                           epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                           lr=cfg.personal_learning_rate, generator=generator,
                           augment_shift=cfg.augment_shift)
        sums, _ = clipped_gradient_sum(model, split, data.x_train, data.y_train,
                                       user_ids=user_ids, clipping_norm=cfg.clipping_norm,
                                       sample_rate=plan.sample_rate, generator=generator,
                                       secure_noise=cfg.secure_noise)
        return dict(zip(split.shared, sums, strict=False)), loss

    loss = train_dp_sgd(model, split, data.x_train, data.y_train, user_ids=user_ids,
                        noise_multiplier=plan.noise_multiplier,
                        clipping_norm=cfg.clipping_norm, sample_rate=plan.sample_rate,
                        steps=plan.steps, lr=cfg.learning_rate,
                        personal_lr=cfg.personal_learning_rate, generator=generator,
                        secure_noise=cfg.secure_noise)
    return dict(get_arrays(model, split.shared)), loss


def _decoupled_release(model: nn.Module, split: ParamSplit, data: OwnerData, cfg: JobConfig,
                       plan: OwnerPlan, generator: torch.Generator) -> tuple[dict[str, np.ndarray], float]:
    """Record/user-unit release on a model whose personal parameters are public
    and frozen: DP-SGD on the shared parameters (local noise) or one clipped
    gradient sum (central noise). No personal parameter is updated."""
    user_ids = data.user_ids if cfg.unit is PrivacyUnit.USER else None
    if release_kind(cfg) == protocol.KIND_GRAD_SUM:
        sums, _ = clipped_gradient_sum(model, split, data.x_train, data.y_train,
                                       user_ids=user_ids, clipping_norm=cfg.clipping_norm,
                                       sample_rate=plan.sample_rate, generator=generator,
                                       secure_noise=cfg.secure_noise)
        return dict(zip(split.shared, sums, strict=False)), float("nan")
    loss = train_dp_sgd(model, split, data.x_train, data.y_train, user_ids=user_ids,
                        noise_multiplier=plan.noise_multiplier,
                        clipping_norm=cfg.clipping_norm, sample_rate=plan.sample_rate,
                        steps=plan.steps, lr=cfg.learning_rate, personal_lr=0.0,
                        generator=generator, secure_noise=cfg.secure_noise)
    return dict(get_arrays(model, split.shared)), loss
