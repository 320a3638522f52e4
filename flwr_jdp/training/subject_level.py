"""One silo's local training round under each subject-level mechanism.

Records are Poisson-sampled at rate ``q`` (expected batch ``B = q n``; or subjects,
see *Sampling* below). The noisy sum is divided by ``B``, which must be public for the
division to be post-processing: ``SiloPlan.normaliser`` (the run's public
``batch-size`` in the public-cap mode, where ``q`` is public too); ``q n`` with the
silo's own size ``n`` is data-dependent and kept only for the reported-counts mode. Per step, with ``C`` the clipping norm and ``z`` the noise
multiplier (always relative to the per-step sensitivity stated below):

============== ================================================ ======================
method          released gradient                               per-step sensitivity
============== ================================================ ======================
fedavg          mean batch gradient, no clipping, no noise        (no privacy)
local-item-dp   (sum_r clip(g_r) + N(0, (zC)^2)) / B              C per *record*
higradavg-dp    (sum_a mean_{r of a} clip(g_r) + N(0,(zC)^2)) / B  C per *subject*
local-group-dp  (sum_r clip(g_r) + N(0, (sigma_Z C)^2)) / B       Z C per subject (group DP)
  fixed G       (sum_r clip(g_r) + N(0, (z G C)^2)) / B, <= G       G C per subject
                records of a subject per batch
user-ldp        clip(mean batch gradient) + N(0, (z 2C)^2)         2C per subject
============== ================================================ ======================

HiGradAvgDP (Algorithm 1) clips every record, averages the clipped gradients of
each subject in the batch, and sums over subjects, so one subject moves the sum by
at most ``C`` however many of its records were drawn. UserLDP (Algorithm 2) clips
the whole batch gradient to ``C``; removing a subject replaces one clipped vector
by another, so the sensitivity is ``2C`` (the paper says ``C``); the noise here is
scaled to ``2C``. LocalGroupDP (Algorithm 3) reads the group size ``Z`` (largest
number of records of one subject) off each batch and uses ``sigma_Z`` from
:mod:`flwr_jdp.subject.group_privacy`. With a fixed, public group size ``G``
(``SiloPlan.group_size > 0``, beyond the paper) each subject keeps at most ``G`` of its
sampled records in the batch (chosen uniformly at random), so one subject moves the
record sum by at most ``G C`` whatever the data, and the noise ``z G C`` is data
independent: it is accounted exactly as HiGradAvgDP at multiplier ``z`` (same
inclusion rate, sensitivity ``G C`` in place of ``C``).

Sampling (``SiloPlan.sampling``):

- ``records`` (the paper's): records are Poisson-sampled at rate ``q``, ``B = q n``
  records. A subject with ``k`` records here is in the batch with probability
  ``1 - (1-q)^k``, so a silo's heaviest subjects are sampled almost every step.
- ``subjects`` (HiGradAvgDP only; beyond the paper): the silo's *subjects* are
  Poisson-sampled at rate ``q``, and each sampled subject contributes
  ``records_per_subject`` of its records here, drawn uniformly without replacement
  (all of them if it has fewer, or if ``records_per_subject = 0``). Every subject is
  then in the batch with probability exactly ``q`` whatever its record count, and
  ``B = q u`` is the expected number of subjects (``u`` subjects at the silo).
  The sum of per-subject means still moves by at most ``C`` per subject.

All parameters are shared in this setting (the silos' models are averaged). The
noise comes from :class:`GaussianSumMechanism`, the object the accounting reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .. import import_opacus_quietly
from ..privacy.mechanisms import GaussianSumMechanism, clip_coefficients
from .dp_sgd import UnitBatch, clipped_unit_sum, poisson_sample
from .plain import record_losses

import_opacus_quietly()
from opacus import GradSampleModule  # noqa: E402 - after the quiet import (no root log handler)

METHODS = ("fedavg", "local-item-dp", "higradavg-dp", "local-group-dp", "user-ldp")
SAMPLING = ("records", "subjects")
PER_SAMPLE = ("local-item-dp", "higradavg-dp", "local-group-dp")


@dataclass(frozen=True)
class SiloData:
    """One silo's records and the subject of each."""

    x: torch.Tensor
    y: torch.Tensor
    subject: torch.Tensor

    @classmethod
    def from_numpy(cls, x: np.ndarray, y: np.ndarray, subject: np.ndarray) -> SiloData:
        x = np.asarray(x)  # token ids (sequence models) stay integers
        dtype = np.int64 if np.issubdtype(x.dtype, np.integer) else np.float32
        return cls(torch.from_numpy(np.ascontiguousarray(x, dtype=dtype)),
                   torch.from_numpy(np.asarray(y, dtype=np.int64)),
                   torch.from_numpy(np.asarray(subject, dtype=np.int64)))

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class SiloPlan:
    """What a silo does in one round (fixed by the server before the round)."""

    method: str
    sample_rate: float
    steps: int
    lr: float
    clipping_norm: float = 1.0
    noise_multiplier: float = 0.0
    #: LocalGroupDP: group size Z -> sigma_Z (see :mod:`flwr_jdp.subject.group_privacy`)
    group_noise: Callable[[int], float] | None = None
    #: ``records``: Poisson over records at ``sample_rate``; ``subjects``: Poisson over
    #: the silo's subjects (HiGradAvgDP only), ``records_per_subject`` each (0 = all)
    sampling: str = "records"
    records_per_subject: int = 1
    #: LocalGroupDP with a fixed public group size ``G`` (0: the paper's data-dependent ``Z``)
    group_size: int = 0
    #: the public divisor of the noisy sum (expected batch size); 0: ``sample_rate`` times
    #: this silo's records (subjects), data-dependent (reported-counts mode only)
    normaliser: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(f"sample rate must be in (0, 1], got {self.sample_rate}")
        if self.group_size < 0 or (self.group_size and self.method != "local-group-dp"):
            raise ValueError(f"group_size must be 0, or > 0 for local-group-dp; got {self.group_size}")
        if self.method == "local-group-dp" and not self.group_size and self.group_noise is None:
            raise ValueError("local-group-dp needs group_noise (or a fixed group_size)")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if self.sampling == "subjects" and self.method != "higradavg-dp":
            raise ValueError("sampling = subjects is for higradavg-dp only")
        if self.records_per_subject < 0:
            raise ValueError(f"records_per_subject must be >= 0, got {self.records_per_subject}")
        if not (self.normaliser >= 0 and np.isfinite(self.normaliser)):
            raise ValueError(f"normaliser must be >= 0 and finite, got {self.normaliser}")


@dataclass
class BatchStats:
    """Per-batch group size Z and number of distinct subjects (paper Figure 2 c, d)."""

    group_sizes: list[int] = field(default_factory=list)
    distinct_subjects: list[int] = field(default_factory=list)
    noise_multipliers: list[float] = field(default_factory=list)


def poisson_records(n: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of a Poisson(``rate``) sample of ``n`` records."""
    return torch.nonzero(torch.rand(n, generator=generator) < rate, as_tuple=False).flatten()


def rank_within_subject(subjects: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random rank of every record among its subject's records (0, 1, ...):
    the order of one subject's records is uniform and independent of the others'."""
    n = len(subjects)
    _, unit = torch.unique(subjects, return_inverse=True)
    perm = torch.randperm(n, generator=generator)
    order = perm[torch.sort(unit[perm], stable=True).indices]
    counts = torch.bincount(unit[order])
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n) - torch.repeat_interleave(starts, counts)
    return rank


def cap_per_subject(records: torch.Tensor, subjects: torch.Tensor, cap: int,
                    generator: torch.Generator) -> torch.Tensor:
    """Keep at most ``cap`` of each subject's records in ``records``, chosen uniformly
    at random (a subject's kept records depend only on its own records)."""
    if len(records) == 0:
        return records
    return records[rank_within_subject(subjects[records], generator) < cap]


def poisson_subjects(subjects: torch.Tensor, rate: float, records_per_subject: int,
                     generator: torch.Generator) -> torch.Tensor:
    """Indices of the records of a Poisson(``rate``) sample of the subjects in
    ``subjects`` (the subject of each record): each subject is kept independently
    with probability ``rate`` and brings ``records_per_subject`` of its records,
    drawn uniformly without replacement (all if it has fewer; 0 = all). The
    records are the first ones of each subject in one uniform permutation of the
    silo: the relative order of one subject's records in it is uniform and
    independent of the other subjects', as the accounting's proof requires."""
    n = len(subjects)
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    ids, unit = torch.unique(subjects, return_inverse=True)
    records = poisson_sample(unit, len(ids), rate, generator).records
    if records_per_subject > 0:
        records = records[rank_within_subject(subjects, generator)[records] < records_per_subject]
    return records


def subject_batch(records: torch.Tensor, subjects: torch.Tensor) -> UnitBatch:
    """The batch with subjects as units (for per-subject averaging)."""
    _, inverse, counts = torch.unique(subjects[records], return_inverse=True, return_counts=True)
    return UnitBatch(records, inverse, int(len(counts)))


def record_batch(records: torch.Tensor) -> UnitBatch:
    return UnitBatch(records, torch.arange(len(records)), len(records))


def group_size(batch: UnitBatch) -> int:
    """``Z``: the largest number of records of one subject in the batch (0 if empty)."""
    if len(batch.records) == 0:
        return 0
    return int(torch.bincount(batch.units).max())


def clipped_batch_gradient(grads: list[torch.Tensor], clipping_norm: float) -> list[torch.Tensor]:
    """Clip the whole batch gradient (all parameters jointly) to ``clipping_norm``."""
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    factor = clip_coefficients(norm.reshape(1), clipping_norm)[0]
    return [g * factor for g in grads]


def _step(params: list[nn.Parameter], update: list[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for p, g in zip(params, update, strict=True):
            p.add_(g, alpha=-lr)


def train_silo_round(model: nn.Module, data: SiloData, plan: SiloPlan, generator: torch.Generator,
                     stats: BatchStats | None = None) -> float:
    """Run ``plan.steps`` steps of ``plan.method`` on ``model`` in place; returns the
    mean training loss (local diagnostics only, never sent)."""
    stats = stats if stats is not None else BatchStats()
    n = len(data)
    by_subjects = plan.sampling == "subjects"
    if plan.normaliser > 0:
        expected = float(plan.normaliser)  # public (the run's batch-size)
    else:  # reported-counts mode: the silo's size, data-dependent
        expected = plan.sample_rate * (int(torch.unique(data.subject).numel()) if by_subjects else n)
    net = GradSampleModule(model, loss_reduction="sum") if plan.method in PER_SAMPLE else model
    params = [p for p in net.parameters() if p.requires_grad]
    net.train()
    losses = []
    for _ in range(plan.steps):
        records = (poisson_subjects(data.subject, plan.sample_rate, plan.records_per_subject, generator)
                   if by_subjects else poisson_records(n, plan.sample_rate, generator))
        if plan.group_size:
            records = cap_per_subject(records, data.subject, plan.group_size, generator)
        by_subject = subject_batch(records, data.subject)
        stats.group_sizes.append(group_size(by_subject))
        stats.distinct_subjects.append(by_subject.num_units)
        for p in params:
            p.grad = None
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        if len(records):
            out = net(data.x[records])
            loss = record_losses(out, data.y[records]).sum()
            loss.backward()
            losses.append(float(loss.detach()) / len(records))
        update = _update(plan, params, records, by_subject, expected, generator, stats)
        _step(params, update, plan.lr)
    if isinstance(net, GradSampleModule):
        for p in params:
            p.grad_sample = None
        net._close()  # noqa: SLF001 - removes the Opacus hooks
    for p in params:
        p.grad = None
    return float(np.mean(losses)) if losses else float("nan")


def _update(plan: SiloPlan, params: list[nn.Parameter], records: torch.Tensor, by_subject: UnitBatch,
            expected: float, generator: torch.Generator, stats: BatchStats) -> list[torch.Tensor]:
    empty = len(records) == 0
    zeros = [torch.zeros_like(p) for p in params]
    if plan.method == "fedavg":
        return zeros if empty else [p.grad / len(records) for p in params]
    if plan.method == "user-ldp":
        grads = zeros if empty else clipped_batch_gradient([p.grad / len(records) for p in params],
                                                           plan.clipping_norm)
        mech = GaussianSumMechanism(plan.noise_multiplier, 2.0 * plan.clipping_norm, 1.0)
        stats.noise_multipliers.append(plan.noise_multiplier)
        return mech.release_torch(grads, generator)
    if plan.method == "higradavg-dp":
        sums = zeros if empty else clipped_unit_sum(params, by_subject, plan.clipping_norm)
    else:
        sums = zeros if empty else clipped_unit_sum(params, record_batch(records), plan.clipping_norm)
    z, sensitivity = plan.noise_multiplier, plan.clipping_norm
    if plan.method == "local-group-dp" and plan.group_size:
        sensitivity = plan.group_size * plan.clipping_norm  # <= G records of a subject, each <= C
    elif plan.method == "local-group-dp":
        z = plan.group_noise(max(1, group_size(by_subject)))
    stats.noise_multipliers.append(z)
    mech = GaussianSumMechanism(z, sensitivity, expected)
    return mech.release_torch(sums, generator)
