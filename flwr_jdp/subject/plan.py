"""The privacy plan of a subject-level run: noise multiplier, rounds, accounting.

Computed once, by the server, before training, in one of two modes:

- **public cap** (``max-records-per-subject = K > 0``, the default): nothing
  data-dependent is used. Each silo keeps at most ``K`` records of each subject
  (a per-subject local truncation) and samples at the public ``sample-rate``; its
  noisy sum is divided by the public ``batch-size``. The plan is made for the
  worst-case subject, one with ``K`` records at every one of the ``s`` silos: the
  horizontal accountant on the single count row ``[K] * s`` (presence ``[1] * s``
  under ``sampling = subjects``, :func:`worst_case_counts`). A subject with fewer
  records or at fewer silos has a dominated event (its inclusion rate grows with its
  count, and a silo without it adds nothing), so the plan's epsilon bounds every
  subject's: conservative and data-independent. Not for the paper's
  ``inclusion = record`` accounting or ``local-group-dp`` with ``group-size = 0``.
- **reported counts** (``max-records-per-subject = 0``, the paper's reproduction):
  the silos report their subject-to-silo counts (data-dependent, not DP) and the
  plan uses them as below; each silo's rate is ``batch-size`` over its size.

With the counts (reported, or the worst-case row):

- ``higradavg-dp`` and ``user-ldp`` (per-step subject sensitivity ``C`` and ``2C``
  with the noise scaled to it, see :mod:`flwr_jdp.training.subject_level`): each
  silo's round is :class:`~flwr_jdp.privacy.horizontal.SiloRelease`. With
  ``inclusion = subject`` (default) a subject with ``k`` records at a silo is
  sampled at ``1 - (1-q)^k``; ``inclusion = record`` is the paper's accounting
  (record rate ``q``), which under-accounts subjects with several records per
  silo and is kept only to reproduce the paper; its true epsilon is reported.
  ``accounting``: ``exact`` calibrates ``z`` to the maximum over subjects of the
  composition across their silos; ``scaled-steps`` to the s-fold bound (paper
  remedy b: the number of batches scaled by ``s``); ``sqrt-rounds`` to one silo
  and trains ``floor(R / sqrt(s))`` rounds (paper remedy a, Theorem 4.2).
- ``local-item-dp``: record-level DP-SGD calibrated per silo (records are at one
  silo, so silos compose in parallel); unit = record, not subject.
- ``local-group-dp``: ``sigma_Z`` from group privacy; ``scaled-steps`` or
  ``sqrt-rounds`` define the budget's batch count and the rounds. Its epsilon is
  the paper's claim (data-dependent noise; see :mod:`.group_privacy`). With a fixed
  ``group-size`` ``G > 0`` (at most ``G`` records of a subject per batch, noise
  ``z G C``) it is planned and accounted as ``higradavg-dp`` at multiplier ``z``:
  the same releases, with the sensitivity ``G C`` in place of ``C``.

With ``sampling = subjects`` (HiGradAvgDP) each silo samples its subjects at
``q_i = batch-size / u_i`` (``u_i`` subjects at silo ``i``; ``batch-size`` is then the
expected number of subjects per batch; the public ``sample-rate`` in the public-cap
mode), and every subject present at a silo is included at ``q_i`` whatever its count
(:class:`~flwr_jdp.privacy.horizontal.SiloRelease`).

Per-silo record-level epsilon is increasing in the sampling rate (sampling at
``q' < q`` is sampling at ``q'/q`` of the rate-``q`` sample, post-processing), so
calibrating to the largest rate covers every silo.

Under the public cap ``target-epsilon`` is a hard budget in every accounting mode: a
plan whose ``epsilon`` exceeds it is refused (:func:`over_target`) by the server at
start-up and by every silo, which recomputes the plan itself
(:mod:`flwr_jdp.subject.silo_guard`); rounds and calibration steps
(:func:`schedule`) use no count in either mode.

The plan's epsilons: ``epsilon`` is the exact subject-level epsilon of what is
actually run (max over subjects, subject inclusion rates, PLD; in the public-cap
mode the worst-case subject's, an upper bound for every subject) for the methods
that have one, ``epsilon_sfold`` the s-fold bound, ``epsilon_claimed`` what the
accounting mode claims.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..privacy.accountants import epsilon as event_epsilon
from ..privacy.calibration import calibrate
from ..privacy.events import dp_sgd as record_event
from ..privacy.horizontal import HorizontalAccountant, SiloRelease, sqrt_rounds
from .config import SubjectDPConfig


@dataclass(frozen=True)
class SubjectPlan:
    """Noise and rounds of a run, and the epsilons they give."""

    noise_multiplier: float
    rounds: int
    sample_rates: tuple[float, ...]
    calibration_steps: int  # batches per silo the noise was calibrated for
    unit: str
    epsilon: float
    epsilon_sfold: float
    epsilon_claimed: float

    def to_dict(self) -> dict:
        return asdict(self)


def sample_rates(records_per_silo: np.ndarray, batch_size: int) -> tuple[float, ...]:
    return tuple(min(1.0, batch_size / max(1, int(n))) for n in records_per_silo)


def releases(rates: tuple[float, ...], z: float, steps: int, sampling: str = "records") -> list[SiloRelease]:
    return [SiloRelease(q, z, steps, sampling=sampling) for q in rates]


def worst_case_counts(cfg: SubjectDPConfig) -> np.ndarray:
    """The one count row the public-cap mode plans and accounts for: ``K`` records
    at every one of the ``num-silos`` silos (shape ``(1, s)``)."""
    if not cfg.public_cap:
        raise ValueError("worst_case_counts needs max-records-per-subject > 0")
    return np.full((1, cfg.num_silos), cfg.max_records_per_subject, dtype=np.int64)


def silo_rates(cfg: SubjectDPConfig, counts: np.ndarray | None = None) -> tuple[float, ...]:
    """Each silo's Poisson rate: of records (``sampling = records``) or of subjects;
    the public ``sample-rate`` at every silo in the public-cap mode."""
    if cfg.public_cap:
        return (float(cfg.sample_rate),) * cfg.num_silos
    if cfg.sampling == "subjects":
        return sample_rates((counts > 0).sum(axis=0), cfg.batch_size)
    return sample_rates(counts.sum(axis=0), cfg.batch_size)


def accounting_counts(cfg: SubjectDPConfig, counts: np.ndarray) -> np.ndarray:
    """The subject-to-silo counts the accountant needs: with ``sampling = subjects`` a
    subject's epsilon depends only on which silos hold it, so the counts are reduced
    to presence (0/1). The epsilon is the same; far fewer distinct rows are composed."""
    return (counts > 0).astype(np.int64) if cfg.sampling == "subjects" else counts


def planning_counts(cfg: SubjectDPConfig, counts: np.ndarray | None) -> np.ndarray:
    """The counts a plan is made on: the worst-case row in the public-cap mode (then
    ``counts`` must be None: no reported count may enter it), else the reported ones."""
    if cfg.public_cap:
        if counts is not None:
            raise ValueError("max-records-per-subject > 0 plans for the worst-case subject; reported counts "
                             "are for max-records-per-subject = 0")
        return worst_case_counts(cfg)
    if counts is None:
        raise ValueError("max-records-per-subject = 0 (reported counts) needs the subject-to-silo counts")
    return np.asarray(counts)


def schedule(cfg: SubjectDPConfig, silos: int | None = None) -> tuple[int, int]:
    """``(rounds, calibration steps)`` of the plan: ``budget-rounds``, or
    ``floor(R / sqrt(s))`` under ``sqrt-rounds``; ``local-steps`` per round over the
    budget's rounds, times ``s`` under ``scaled-steps``. No count enters them, so every
    silo derives them from the run config (``silos``: ``num-silos`` unless given)."""
    s = cfg.num_silos if silos is None else int(silos)
    R, steps = cfg.budget_rounds, cfg.local_steps
    if cfg.method == "local-item-dp":
        return R, steps * R
    rounds = sqrt_rounds(R, s) if cfg.accounting == "sqrt-rounds" else R
    return rounds, steps * R * (s if cfg.accounting == "scaled-steps" else 1)


def over_target(cfg: SubjectDPConfig, plan: SubjectPlan) -> str | None:
    """Why a public-cap plan is refused (its epsilon exceeds ``target-epsilon``), naming
    the keys to change; None if it is within the target. ``target-epsilon`` is a hard
    budget under the public cap: the server refuses such a plan at start-up and every
    silo refuses to train under it. (With reported counts, the paper's reproduction and
    not DP, the plan's epsilon is reported, whatever it is.)"""
    if not (cfg.public_cap and cfg.private) or plan.epsilon <= cfg.target_epsilon * (1 + 1e-9):
        return None
    head = (f"the plan ({cfg.method}, accounting = {cfg.accounting!r}, {plan.rounds} rounds, z = "
            f"{plan.noise_multiplier:.4g}) spends epsilon {plan.epsilon:.4g} > run-config key 'target-epsilon' = "
            f"{cfg.target_epsilon:g}, a hard budget with max-records-per-subject > 0")
    if cfg.noise_multiplier > 0:
        return (f"{head}: run-config key 'noise-multiplier' = {cfg.noise_multiplier:g} is too small for "
                f"'budget-rounds' = {cfg.budget_rounds}; raise it, lower 'budget-rounds', or set "
                "'noise-multiplier' = 0 to calibrate it to the target")
    if cfg.accounting == "sqrt-rounds":
        return (f"{head}: run-config key 'accounting' = 'sqrt-rounds' calibrates one silo's releases, but under "
                "the public cap the worst-case subject is at every silo; set 'accounting' to 'exact' or "
                "'scaled-steps'")
    return f"{head}: raise 'target-epsilon' or lower 'budget-rounds'"


def make_plan(cfg: SubjectDPConfig, counts: np.ndarray | None = None, accountant: str = "pld") -> SubjectPlan:
    """Calibrate (or take) the noise and fix the rounds for ``cfg``: on the reported
    ``counts`` (``max-records-per-subject = 0``), or on the worst-case subject in the
    public-cap mode (``counts`` None)."""
    counts = planning_counts(cfg, counts)
    s = counts.shape[1]
    rates = silo_rates(cfg, counts)
    R, steps = cfg.budget_rounds, cfg.local_steps
    nan = float("nan")
    if not cfg.private:
        return SubjectPlan(0.0, R, rates, 0, "none", math.inf, math.inf, math.inf)
    rounds, cal_steps = schedule(cfg, s)
    target, delta = cfg.target_epsilon, cfg.delta
    if cfg.method == "local-item-dp":
        z = cfg.noise_multiplier or calibrate(
            target, delta, lambda z: [record_event(z, max(rates), cal_steps)], accountant)
        eps = event_epsilon(record_event(z, max(rates), cal_steps), delta, accountant)
        return SubjectPlan(z, rounds, rates, cal_steps, "record", eps, nan, target)
    if cfg.method == "local-group-dp" and not cfg.group_size:
        return SubjectPlan(0.0, rounds, rates, cal_steps, "subject (group DP, claimed)", nan, nan, target)
    acc = HorizontalAccountant(accounting_counts(cfg, counts), delta, accountant)
    if cfg.noise_multiplier > 0:
        z = cfg.noise_multiplier
    elif cfg.inclusion == "record":  # the paper's accounting: record rate q per silo
        z = calibrate(target, delta, lambda z: [record_event(z, max(rates), cal_steps)], accountant)
    else:
        z = acc.calibrate(target, R, lambda z: releases(rates, z, steps, cfg.sampling), cfg.accounting)
    rel = releases(rates, z, steps, cfg.sampling)
    return SubjectPlan(z, rounds, rates, cal_steps, "subject", acc.epsilon(rel, rounds),
                       acc.s_fold_epsilon(rel, rounds), target)
