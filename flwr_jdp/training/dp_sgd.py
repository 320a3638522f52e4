"""DP-SGD on the shared parameters only, with per-sample gradients from Opacus.

Privacy guarantee (per step, add/remove neighbouring of one unit):

- ``record`` unit: each record's gradient of the shared parameters is clipped to
  L2 norm ``C``; the clipped gradients of a Poisson sample (rate ``q``) of records
  are summed; N(0, (z C)^2 I) is added; the result is divided by the expected batch
  size ``q * n_records``. One step is ``PoissonSampled(q, Gaussian(z))``.
- ``user`` unit: users (not records) are Poisson-sampled; each record's gradient is
  clipped to ``C`` and averaged over the user's records in the batch, so one user's
  contribution has norm <= ``C``; sum over users, noise N(0, (z C)^2 I), divide by
  ``q * n_users``.

Personal parameters get the ordinary mean gradient of the same batch and no noise:
an owner may use its own data freely for its own model, and personal parameters are
never released. The noise comes from :class:`GaussianSumMechanism`, the same object
whose event the ledger records.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..params import ParamSplit
from ..privacy.mechanisms import GaussianSumMechanism, clip_coefficients
from .plain import to_tensors

if TYPE_CHECKING:  # Opacus is imported on first use: a ClientApp process that only
    from opacus import GradSampleModule  # evaluates (a fresh process per message) skips ~2.5 s

_preload: threading.Thread | None = None


def preload_opacus() -> None:
    """Start importing Opacus in a background thread, once per process.

    Called where a process will soon need per-sample gradients (the set-up query of
    a run that uses them): the ~2 s import then overlaps with the wait for the first
    training message instead of delaying it. The first use blocks until the import
    is done (Python's per-module import lock), so it sees the same module either
    way. The thread is not a daemon, so a process that exits first waits for it
    rather than stopping an import half-way; nothing it does is released."""
    global _preload
    if _preload is None and "opacus" not in sys.modules:
        _preload = threading.Thread(target=importlib.import_module, args=("opacus",),
                                    name="opacus-preload")
        _preload.start()


def _grad_sample_module(model: nn.Module) -> GradSampleModule:
    """``model`` wrapped by Opacus for per-sample gradients (summed loss)."""
    from opacus import GradSampleModule

    return GradSampleModule(model, loss_reduction="sum")


@contextmanager
def _frozen(params: list[nn.Parameter]) -> Iterator[None]:
    """Take ``params`` out of autograd for the block, then restore their flags.

    Used where the personal parameters' gradients are not needed (the decoupled
    release, the central clipped sum): Opacus then computes per-sample gradients
    of the shared parameters only, and backward still flows through the frozen
    layers to the shared ones, so the shared gradients are unchanged (a speed-up,
    not a change of any released number; tests/test_fast_paths.py).
    """
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)


@dataclass(frozen=True)
class UnitBatch:
    """A Poisson sample of units: the record indices and each record's unit index."""

    records: torch.Tensor
    units: torch.Tensor  # unit index (0..k-1) of each record within the batch
    num_units: int


def poisson_sample(unit_of_record: torch.Tensor, num_units: int, rate: float, generator: torch.Generator) -> UnitBatch:
    """Include each unit independently with probability ``rate``."""
    chosen = torch.rand(num_units, generator=generator) < rate
    mask = chosen[unit_of_record]
    records = torch.nonzero(mask, as_tuple=False).flatten()
    _, inverse = torch.unique(unit_of_record[records], return_inverse=True)
    return UnitBatch(records, inverse, int(chosen.sum()))


def clipped_unit_sum(
    shared: list[nn.Parameter], batch: UnitBatch, clipping_norm: float
) -> list[torch.Tensor]:
    """Sum over units of (per-record clipped gradients averaged within the unit).

    Reads Opacus's ``grad_sample`` of each shared parameter. Every unit's term has
    L2 norm <= ``clipping_norm`` over all shared parameters jointly.
    """
    n = len(batch.records)
    per_sample = [p.grad_sample.reshape(n, -1) for p in shared]
    norms = torch.sqrt(sum((g * g).sum(1) for g in per_sample))
    factors = clip_coefficients(norms, clipping_norm)
    counts = torch.bincount(batch.units, minlength=batch.num_units).clamp(min=1).to(factors.dtype)
    weights = factors / counts[batch.units]  # clip, then average within the unit
    return [(weights @ g).reshape(p.shape) for g, p in zip(per_sample, shared, strict=False)]


def batch_sums(shared: list[nn.Parameter], batch: UnitBatch, clipping_norm: float) -> list[torch.Tensor]:
    """:func:`clipped_unit_sum`, or zeros for an empty Poisson sample."""
    if len(batch.records) == 0:
        return [torch.zeros_like(p) for p in shared]
    return clipped_unit_sum(shared, batch, clipping_norm)


def _release_hooks(gsm: GradSampleModule) -> None:
    for p in gsm.parameters():
        p.grad_sample = None
        p.grad = None
    gsm._close()  # noqa: SLF001 - removes Opacus hooks, leaves the plain model


def _unit_index(num_records: int, user_ids: np.ndarray | None) -> tuple[torch.Tensor, int]:
    if user_ids is None:
        return torch.arange(num_records), num_records
    ids = torch.from_numpy(np.asarray(user_ids, dtype=np.int64))
    return ids, int(ids.max()) + 1 if len(ids) else 0


def _backward_batch(gsm: GradSampleModule, xt, yt, batch: UnitBatch) -> float:
    """Per-sample gradients of the batch's summed loss; returns the mean loss
    before the step (nan for an empty batch)."""
    for p in gsm.parameters():
        p.grad = None
        p.grad_sample = None
    if len(batch.records) == 0:
        return float("nan")
    loss = F.cross_entropy(gsm(xt[batch.records]), yt[batch.records], reduction="sum")
    loss.backward()
    return float(loss.detach()) / len(batch.records)


def train_dp_sgd(
    model: nn.Module,
    split: ParamSplit,
    x: np.ndarray,
    y: np.ndarray,
    *,
    user_ids: np.ndarray | None,
    noise_multiplier: float,
    clipping_norm: float,
    sample_rate: float,
    steps: int,
    lr: float,
    personal_lr: float,
    generator: torch.Generator,
) -> float:
    """Run ``steps`` DP-SGD steps on the shared parameters; returns the mean loss.

    ``user_ids`` selects the user unit (None: record unit). ``personal_lr = 0``
    leaves the personal parameters untouched (the decoupled coupling, whose
    personal parameters are public and frozen).
    """
    xt, yt = to_tensors(x, y)
    unit_of_record, num_units = _unit_index(len(yt), user_ids)
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    personal = [params[n] for n in split.personal]
    mech = GaussianSumMechanism(noise_multiplier, clipping_norm, sample_rate * num_units)
    with _frozen(personal if personal_lr == 0 else []):  # no personal gradient needed
        gsm = _grad_sample_module(model)
        gsm.train()
        losses = []
        for _ in range(steps):
            batch = poisson_sample(unit_of_record, num_units, sample_rate, generator)
            loss = _backward_batch(gsm, xt, yt, batch)
            with torch.no_grad():
                if len(batch.records):
                    sums = clipped_unit_sum(shared, batch, clipping_norm)
                else:
                    sums = [torch.zeros_like(p) for p in shared]
                for p, g in zip(shared, mech.release_torch(sums, generator), strict=False):
                    p.add_(g, alpha=-lr)
                if len(batch.records) and personal_lr > 0:
                    for p in personal:
                        p.add_(p.grad / len(batch.records), alpha=-personal_lr)
            if len(batch.records):
                losses.append(loss)
        _release_hooks(gsm)
    return float(np.mean(losses)) if losses else float("nan")


def clipped_gradient_sum(
    model: nn.Module,
    split: ParamSplit,
    x: np.ndarray,
    y: np.ndarray,
    *,
    user_ids: np.ndarray | None,
    clipping_norm: float,
    sample_rate: float,
    generator: torch.Generator,
) -> tuple[list[np.ndarray], int]:
    """For central noise: the sum of clipped per-unit shared gradients of one Poisson
    sample, *without* noise (the trusted aggregator adds it). Returns (sums, units)."""
    xt, yt = to_tensors(x, y)
    unit_of_record, num_units = _unit_index(len(yt), user_ids)
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    with _frozen([params[n] for n in split.personal]):
        gsm = _grad_sample_module(model)
        gsm.train()
        batch = poisson_sample(unit_of_record, num_units, sample_rate, generator)
        _backward_batch(gsm, xt, yt, batch)
        with torch.no_grad():
            sums = batch_sums(shared, batch, clipping_norm)
        out = [s.detach().cpu().numpy().copy() for s in sums]
        _release_hooks(gsm)
    return out, batch.num_units
