"""DP-SGD on the shared parameters only, with per-sample gradients from torch.func (or Opacus).

Privacy guarantee (per step, add/remove neighbouring of one unit):

- ``record`` unit: each record's gradient of the shared parameters is clipped to
  L2 norm ``C``; the clipped gradients of a Poisson sample (rate ``q``) of records
  are summed; N(0, (z C)^2 I) is added; the result is divided by the expected batch
  size ``q * n_records``. One step is ``PoissonSampled(q, Gaussian(z))``.
- ``user`` unit: users (not records) are Poisson-sampled; each record's gradient is
  clipped to ``C`` and averaged over the user's records in the batch, so one user's
  contribution has norm <= ``C``; sum over users, noise N(0, (z C)^2 I), divide by
  ``q * n_users``.

A record whose per-sample gradient has a NaN or Inf anywhere (a corrupt record, an
overflow) is given the gradient zero before clipping, in every unit, for the local
DP-SGD step and for the central clipped sum alike: its term then has norm 0 <= C,
so the unit's bound still holds, and the release stays finite (one bad record
neither poisons the noisy release nor gets its owner's reply dropped). Under the
user unit the zeroed record still counts in its user's average. Per-sample
gradients depend only on their own record (GroupNorm or no norm, never
BatchNorm), so the other records' terms are unchanged.

Personal parameters get the ordinary mean gradient of the same batch and no noise:
an owner may use its own data freely for its own model, and personal parameters are
never released. The noise comes from :class:`GaussianSumMechanism`, the same object
whose event the ledger records.

Per-sample gradients come from whole-model ``torch.func``
(:class:`~flwr_jdp.training.per_sample.FuncPerSample`: ``vmap(grad(...))`` over
``functional_call``, about a plain step's cost) or, for a model class on which that
fails, from Opacus's hooks (``GradSampleModule``): the first failure is logged once
per class and the step is recomputed with Opacus. Either way the gradients land in
``p.grad_sample`` and go through the same :func:`clipped_unit_sum` and the same
mechanism, so the release and the ledger do not depend on the path.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import import_opacus_quietly
from ..params import ParamSplit
from ..privacy.mechanisms import GaussianSumMechanism, clip_coefficients, secure_uniform
from . import per_sample
from .plain import to_tensors

# Opacus's per-sample hooks on the first layer fire although its input (the data)
# needs no gradient; torch warns about it on every backward. Nothing is wrong.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed "
                        "with respect to module outputs since no inputs require gradients")

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from opacus import GradSampleModule


def _grad_sample_module(model: nn.Module) -> GradSampleModule:
    """``model`` wrapped by Opacus for per-sample gradients (summed loss)."""
    import_opacus_quietly()
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
    return _batch_of(unit_of_record, torch.rand(num_units, generator=generator) < rate)


def secure_poisson_sample(unit_of_record: torch.Tensor, num_units: int, rate: float) -> UnitBatch:
    """:func:`poisson_sample` with uniforms from the OS CSPRNG (``secure-noise``)."""
    return _batch_of(unit_of_record, torch.from_numpy(secure_uniform(num_units)) <= rate)


def _draw_batch(unit_of_record: torch.Tensor, num_units: int, rate: float,
                generator: torch.Generator, secure: bool) -> UnitBatch:
    if secure:
        return secure_poisson_sample(unit_of_record, num_units, rate)
    return poisson_sample(unit_of_record, num_units, rate, generator)


def _batch_of(unit_of_record: torch.Tensor, chosen: torch.Tensor) -> UnitBatch:
    mask = chosen[unit_of_record]
    records = torch.nonzero(mask, as_tuple=False).flatten()
    _, inverse = torch.unique(unit_of_record[records], return_inverse=True)
    return UnitBatch(records, inverse, int(chosen.sum()))


def clipped_unit_sum(
    shared: list[nn.Parameter], batch: UnitBatch, clipping_norm: float
) -> list[torch.Tensor]:
    """Sum over units of (per-record clipped gradients averaged within the unit).

    Reads the per-sample gradients in ``grad_sample`` of each shared parameter
    (torch.func's or Opacus's). Every unit's term has L2 norm <= ``clipping_norm``
    over all shared parameters jointly. A record whose gradient has a non-finite
    value is zeroed before clipping: it is found by its norm, which is then NaN or
    infinite (a finite gradient whose norm overflows is zeroed too, as clipping
    would scale it by C / inf = 0 anyway). One fused norm per parameter and one
    matrix-vector product: element-wise passes over the ``records x parameters``
    gradients (``isfinite``, ``g * g``) cost more than the backward pass itself.
    A linear layer's weight may hold its per-sample gradients factored
    (:class:`~flwr_jdp.training.per_sample.OuterProducts`): same norms, same sums.
    """
    per_sample, weights, _ = _clipping_weights(shared, batch, clipping_norm)
    return [_weighted_sum(weights, g).reshape(p.shape) for g, p in zip(per_sample, shared, strict=False)]


def _clipping_weights(shared: list[nn.Parameter], batch: UnitBatch, clipping_norm: float) -> tuple[list, torch.Tensor,
                                                                                                   torch.Tensor]:
    """(per-record gradients as rows, non-finite records zeroed; each record's weight,
    its clipping factor over its unit's record count; each record's unit)."""
    n = len(batch.records)
    per_sample = [_rows(p.grad_sample, n) for p in shared]
    norms = torch.linalg.vector_norm(torch.stack([_row_norms(g) for g in per_sample]), dim=0)
    finite = torch.isfinite(norms)
    if not bool(finite.all()):
        per_sample = [_keep_rows(g, finite) for g in per_sample]
        norms = torch.where(finite, norms, torch.zeros((), dtype=norms.dtype))
    factors = clip_coefficients(norms, clipping_norm)
    units = batch.units.to(factors.device)  # the sample is drawn on the CPU; gradients may be on a GPU
    counts = torch.bincount(units, minlength=batch.num_units).clamp(min=1).to(factors.dtype)
    return per_sample, factors / counts[units], units  # clip, then average within the unit


def clipped_unit_rows(shared: list[nn.Parameter], batch: UnitBatch, clipping_norm: float) -> torch.Tensor:
    """Each unit's term of :func:`clipped_unit_sum` as one row (units x parameters,
    float64, the shared parameters flattened in order): the rows sum to the clipped
    sum, and each row has L2 norm <= ``clipping_norm`` (distributed noise rounds them
    one by one)."""
    d = sum(p.numel() for p in shared)
    n = len(batch.records)
    if n == 0:
        return torch.zeros((0, d), dtype=torch.float64)
    per_sample, weights, units = _clipping_weights(shared, batch, clipping_norm)
    dense = torch.cat([(g.materialize() if hasattr(g, "materialize") else g)
                       .reshape(n, -1).to(torch.float64) for g in per_sample], dim=1)
    rows = torch.zeros((batch.num_units, d), dtype=torch.float64, device=dense.device)
    rows.index_add_(0, units, dense * weights.to(torch.float64)[:, None])
    return rows


def _rows(grad_sample: torch.Tensor | per_sample.OuterProducts, n: int):  # noqa: ANN202
    """Per-sample gradients as ``(records, -1)`` (factored ones as they are)."""
    return grad_sample if isinstance(grad_sample, per_sample.OuterProducts) else grad_sample.reshape(n, -1)


def _row_norms(g) -> torch.Tensor:  # noqa: ANN001
    return g.row_norms() if isinstance(g, per_sample.OuterProducts) else torch.linalg.vector_norm(g, dim=1)


def _keep_rows(g, keep: torch.Tensor):  # noqa: ANN001, ANN202
    if isinstance(g, per_sample.OuterProducts):
        return g.keep_rows(keep)
    return torch.where(keep[:, None], g, torch.zeros((), dtype=g.dtype))


def _weighted_sum(weights: torch.Tensor, g) -> torch.Tensor:  # noqa: ANN001
    return g.weighted_sum(weights) if isinstance(g, per_sample.OuterProducts) else weights @ g


def finite_rows(per_sample_rows: list) -> torch.Tensor:
    """Boolean mask of the records (rows) whose per-sample gradients are finite in
    every parameter (``per_sample_rows``: one ``(records, -1)`` tensor, or
    :class:`~flwr_jdp.training.per_sample.OuterProducts`, per parameter)."""
    finite = torch.ones(len(per_sample_rows[0]), dtype=torch.bool)
    for g in per_sample_rows:
        finite &= g.finite_rows() if isinstance(g, per_sample.OuterProducts) else torch.isfinite(g).all(dim=1)
    return finite


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


class _OpacusPerSample:
    """Per-sample gradients from Opacus's hooks (the fallback path)."""

    name = "opacus"

    def __init__(self, model: nn.Module) -> None:
        self.gsm = _grad_sample_module(model)
        self.gsm.train()

    def backward(self, xt: torch.Tensor, yt: torch.Tensor, batch: UnitBatch) -> float:
        return _backward_batch(self.gsm, xt, yt, batch)

    def close(self) -> None:
        _release_hooks(self.gsm)


#: Model classes on which torch.func failed, with the reason (logged once each).
_FUNC_FAILED: dict[type, str] = {}


class _PerSampleGrads:
    """The per-sample gradient path for ``model``: :class:`FuncPerSample` unless
    ``per_sample.BACKEND`` says otherwise or the model's class failed it before;
    on a first failure, Opacus's hooks (the failing call is recomputed by them).
    ``summed``: parameters whose batch sum is also wanted in ``.grad``."""

    def __init__(self, model: nn.Module, summed: tuple[str, ...]) -> None:
        self.model = model
        backend = per_sample.BACKEND
        self.impl: per_sample.FuncPerSample | _OpacusPerSample | None = None
        if backend == "opacus" or (backend == "auto" and type(model) in _FUNC_FAILED):
            self.impl = _OpacusPerSample(model)
            return
        try:
            self.impl = per_sample.FuncPerSample(model, summed)
        except per_sample.FuncUnsupported as err:
            if backend == "func":
                raise
            self.impl = _OpacusPerSample(model)
            self._record_failure(err)

    @property
    def name(self) -> str:
        return self.impl.name

    def backward(self, xt: torch.Tensor, yt: torch.Tensor, batch: UnitBatch) -> float:
        """Per-sample gradients (``p.grad_sample``) of the batch's summed loss;
        returns the mean loss before the step (nan for an empty batch)."""
        if isinstance(self.impl, _OpacusPerSample):
            return self.impl.backward(xt, yt, batch)
        if per_sample.BACKEND == "func":
            return self.impl.backward(xt[batch.records], yt[batch.records])
        try:
            return self.impl.backward(xt[batch.records], yt[batch.records])
        except Exception as err:  # noqa: BLE001 - any failure of the transform
            self.impl.close()
            self.impl = _OpacusPerSample(self.model)
            loss = self.impl.backward(xt, yt, batch)  # an error here is the data's, not vmap's
            self._record_failure(err)
            return loss

    def _record_failure(self, err: Exception) -> None:
        cls = type(self.model)
        if cls not in _FUNC_FAILED:
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            _FUNC_FAILED[cls] = reason
            log.warning("per-sample gradients of %s.%s: torch.func failed (%s); using Opacus hooks",
                        cls.__module__, cls.__qualname__, reason)

    def close(self) -> None:
        if self.impl is not None:
            self.impl.close()


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
    secure_noise: bool = False,
) -> float:
    """Run ``steps`` DP-SGD steps on the shared parameters; returns the mean loss.

    ``user_ids`` selects the user unit (None: record unit). ``personal_lr = 0``
    leaves the personal parameters untouched (the decoupled coupling, whose
    personal parameters are public and frozen). ``secure_noise``: noise and Poisson
    sampling from the OS CSPRNG (:func:`~flwr_jdp.privacy.mechanisms.secure_gaussian`),
    ``generator`` unused for them.
    """
    xt, yt = to_tensors(x, y)
    unit_of_record, num_units = _unit_index(len(yt), user_ids)
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    personal = [params[n] for n in split.personal]
    mech = GaussianSumMechanism(noise_multiplier, clipping_norm, sample_rate * num_units,
                                secure=secure_noise)
    with _frozen(personal if personal_lr == 0 else []):  # no personal gradient needed
        grads = _PerSampleGrads(model, split.personal if personal_lr > 0 else ())
        losses = []
        for _ in range(steps):
            batch = _draw_batch(unit_of_record, num_units, sample_rate, generator, secure_noise)
            loss = grads.backward(xt, yt, batch)
            with torch.no_grad():
                if len(batch.records):
                    sums = clipped_unit_sum(shared, batch, clipping_norm)
                else:
                    sums = [torch.zeros_like(p) for p in shared]
                for p, g in zip(shared, mech.release_torch(sums, generator), strict=False):
                    p.add_(g, alpha=-lr)
                if len(batch.records) and personal_lr > 0:
                    for p, g in zip(personal, _personal_grads(shared, personal, batch), strict=True):
                        p.add_(g / len(batch.records), alpha=-personal_lr)
            if len(batch.records) and np.isfinite(loss):
                losses.append(loss)
        grads.close()
    return float(np.mean(losses)) if losses else float("nan")


def _personal_grads(shared: list[nn.Parameter], personal: list[nn.Parameter],
                    batch: UnitBatch) -> list[torch.Tensor]:
    """Summed gradients of the personal parameters (interleaved coupling) over the
    batch's records whose per-sample gradients, shared and personal, are all
    finite: a non-finite record is left out of the personal step too."""
    grads = [p.grad for p in personal]
    if all(g is not None and bool(torch.isfinite(g).all()) for g in grads):
        return grads  # the usual case: no record was zeroed
    n = len(batch.records)
    rows = [_rows(p.grad_sample, n) for p in shared + personal
            if getattr(p, "grad_sample", None) is not None]
    finite = finite_rows(rows)
    return [torch.where(finite[:, None], p.grad_sample.reshape(n, -1),
                        torch.zeros((), dtype=p.dtype)).sum(0).reshape(p.shape) for p in personal]


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
    secure_noise: bool = False,
) -> tuple[list[np.ndarray], int]:
    """For central noise: the sum of clipped per-unit shared gradients of one Poisson
    sample, *without* noise (the trusted aggregator adds it). Returns (sums, units).
    ``secure_noise``: the Poisson sample is drawn from the OS CSPRNG."""
    xt, yt = to_tensors(x, y)
    unit_of_record, num_units = _unit_index(len(yt), user_ids)
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    with _frozen([params[n] for n in split.personal]):
        grads = _PerSampleGrads(model, ())
        batch = _draw_batch(unit_of_record, num_units, sample_rate, generator, secure_noise)
        grads.backward(xt, yt, batch)
        with torch.no_grad():
            sums = batch_sums(shared, batch, clipping_norm)
        out = [s.detach().cpu().numpy().copy() for s in sums]
        grads.close()
    return out, batch.num_units
