"""Horizontal composition: subject-level privacy across silos.

Unit: one **data subject** (add/remove all of its records, wherever they sit).
A subject's records may sit at several silos; every silo noises its own releases
(local DP, the server is not trusted: each silo checks the server's instructions and
keeps its own ledger, :mod:`flwr_jdp.subject.silo_guard`), and the server averages the
silos' models.
The releases of *every* silo that holds a subject depend on it, so the subject's
privacy loss is the **sequential** composition of those silos' releases (Marathe
et al., Theorem 4.1), not the parallel composition that applies to records.

Per-step release of one silo
    Records are Poisson-sampled at rate ``q`` (expected batch ``B = q n_i``). The
    step releases ``(sum_a v_a + N(0, (z C)^2 I)) / B`` where ``v_a`` is subject
    ``a``'s contribution in the batch, with ``||v_a|| <= C`` (HiGradAvgDP: clip each
    record, average per subject). :class:`SiloRelease` holds ``(q, z, steps)`` and
    whether sampling amplification is claimed.

Subject sampling amplification (claimed, proved here, tested)
    A subject with ``k`` records at the silo is present in a batch with probability
    ``p_k = 1 - (1 - q)^k`` (it is absent only if none of its records is drawn).
    *Claim:* one step is dominated by ``PoissonSampled(p_k, Gaussian(z))``.
    *Proof.* Let ``N`` be the batch sum without the subject plus noise
    ``N(0, (zC)^2)``. With the subject, the output is ``N`` with probability
    ``1 - p_k`` and ``N + v_J`` otherwise, where ``J`` (the non-empty subset of its
    records drawn) is independent of the other records and ``||v_J|| <= C``. So
    ``P = sum_J w_J [(1 - p_k) Q + p_k Q_{v_J}]`` with ``Q = N(0, (zC)^2)`` (centred
    on the rest of the batch) and ``sum_J w_J = 1``. For each ``J`` the pair
    ``((1-p_k)Q + p_k Q_{v_J}, Q)`` is dominated by the Poisson-subsampled Gaussian
    of rate ``p_k`` (rotation invariance, and the shift ``||v_J|| <= C``; the
    hockey-stick divergence grows with the shift). The hockey-stick divergence is
    jointly convex, so the ``w_J``-mixture against the common ``Q`` (in both
    orders) is dominated too. ``p_k`` grows with ``k``, so a silo that only knows
    an upper bound on ``k`` may use it. Removing the subject does not change ``q``
    or the public denominator ``B`` (both fixed before training). QED.

Subject sampling (``SiloRelease.sampling = "subjects"``, HiGradAvgDP; claimed, proved here, tested)
    The silo Poisson-samples its *subjects* at rate ``q`` and each sampled subject
    brings some of its records here (any rule that depends only on that subject's
    records and on randomness independent of the other subjects); the step
    releases ``(sum_a v_a + N(0, (zC)^2 I)) / B`` with ``B = q u`` fixed before
    training (``u`` subjects at the silo) and ``||v_a|| <= C``.
    *Claim:* for a subject with at least one record here, one step is dominated by
    ``PoissonSampled(q, Gaussian(z))``, whatever its record count.
    *Proof.* Given the other subjects' draws, the output is ``N`` (rest of the
    batch plus noise) with probability ``1 - q`` and ``N + v_J`` with probability
    ``q``, where ``J`` (its drawn records) is independent of ``N``. This is the
    mixture of the record-sampling proof above with ``p_k`` replaced by ``q``; the
    same rotation-invariance and joint-convexity argument applies. QED. Unlike
    record sampling, where a subject with ``k`` records is present at
    ``1 - (1 - q)^k``, every subject is amplified by the same ``q``, so the heaviest
    subjects no longer set the noise for all.

Accounting modes (``ACCOUNTING``)
    - ``exact``: for every subject, compose the events of every silo that holds it
      (heterogeneous rates and steps composed by the PLD accountant); epsilon is the
      maximum over subjects. Needs the subject-to-silo record counts.
    - ``scaled-steps`` (the paper's remedy b): every subject is assumed to sit at
      every silo with that silo's worst count (the *s-fold bound*); sigma is
      calibrated to it. Needs only each silo's largest per-subject count.
    - ``sqrt-rounds`` (the paper's remedy a, Theorem 4.2): sigma is calibrated to
      one silo's releases over ``R`` rounds and training stops after
      ``R / sqrt(s)`` rounds. A heuristic: its exact epsilon is reported beside it
      and may exceed the target.

    Without any reported count (the subject-level system's default public-cap mode,
    :mod:`flwr_jdp.subject.plan`) the accountant runs on the single row ``[K] * s``: every
    silo truncates each subject to at most ``K`` records, so that row dominates every
    subject's, and exact, s-fold and single-row epsilons coincide.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from .accountants import epsilon as event_epsilon
from .accountants import screened_max_epsilon
from .calibration import calibrate
from .events import compose as ev_compose

ACCOUNTING = ("exact", "scaled-steps", "sqrt-rounds")


def subject_inclusion_rate(record_rate: float, records: int) -> float:
    """``1 - (1 - q)^k``: probability that a subject with ``k`` records at a silo has
    at least one record in a Poisson(``q``) batch (see the module docstring)."""
    if records <= 0:
        return 0.0
    if record_rate >= 1.0:
        return 1.0
    return float(-math.expm1(records * math.log1p(-record_rate)))


@dataclass(frozen=True)
class SiloRelease:
    """What one silo releases per round about one subject unit.

    Parameters
    ----------
    sample_rate : float
        Poisson rate ``q`` of records per step (``>= 1``: every record every step).
    noise_multiplier : float
        Noise std over the per-subject sensitivity of one step's sum.
    steps : int
        Noisy steps per round.
    amplified : bool
        Claim amplification by the subject inclusion rate ``1 - (1-q)^k``
        (HiGradAvgDP, and UserLDP: a subject none of whose records is drawn does
        not change the batch gradient); ``False`` claims none (conservative).
    sampling : str
        ``records`` (``sample_rate`` is the record rate, above) or ``subjects``
        (``sample_rate`` is every subject's inclusion rate, whatever its count).
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    amplified: bool = True
    sampling: str = "records"

    def inclusion_rate(self, records: int) -> float:
        """Probability that a subject with ``records`` records here is in a batch."""
        if records <= 0:
            return 0.0
        if self.sampling == "subjects":
            return min(1.0, float(self.sample_rate))
        return subject_inclusion_rate(self.sample_rate, records)

    def subject_event(self, records: int, rounds: int) -> dpa.DpEvent:
        """Event of ``rounds`` rounds for a subject with ``records`` records here."""
        if records <= 0 or rounds <= 0 or self.steps <= 0:
            return dpa.NoOpDpEvent()
        step: dpa.DpEvent = dpa.GaussianDpEvent(float(self.noise_multiplier))
        if self.amplified:
            p = self.inclusion_rate(records)
            if p < 1.0:
                step = dpa.PoissonSampledDpEvent(p, step)
        return dpa.SelfComposedDpEvent(step, int(self.steps * rounds))


def pareto_maximal(rows: np.ndarray) -> np.ndarray:
    """Indices of rows not dominated (component-wise ``<=``, one ``<``) by another row,
    one index per distinct row. Epsilon grows with every count, so only these
    subjects can attain the maximum."""
    unique, first = np.unique(rows, axis=0, return_index=True)
    keep = []
    for i, row in enumerate(unique):
        dominated = np.all(unique >= row, axis=1) & np.any(unique > row, axis=1)
        if not dominated.any():
            keep.append(first[i])
    return np.asarray(sorted(keep), dtype=np.int64)


class HorizontalAccountant:
    """Subject-level epsilon of local-DP releases composed across silos.

    Parameters
    ----------
    counts : array (subjects, silos)
        Records of each subject at each silo (the subject-to-silo map).
    delta : float
        Delta at which epsilon is reported.
    accountant : str
        ``pld`` (default) or ``rdp``.
    """

    def __init__(self, counts: np.ndarray, delta: float, accountant: str = "pld") -> None:
        counts = np.asarray(counts, dtype=np.int64)
        if counts.ndim != 2 or (counts < 0).any():
            raise ValueError("counts must be a (subjects, silos) array of non-negative ints")
        self.counts = counts
        self.delta = float(delta)
        self.accountant = accountant
        self.candidates = pareto_maximal(counts)

    @property
    def num_silos(self) -> int:
        return int(self.counts.shape[1])

    def worst_counts(self) -> np.ndarray:
        """Each silo's largest per-subject count (all a silo must disclose for the
        s-fold bound)."""
        return self.counts.max(axis=0)

    # ---------------------------------------------------------------- events
    @staticmethod
    def subject_event(row: Sequence[int], releases: Sequence[SiloRelease], rounds: int) -> dpa.DpEvent:
        """Composed event of one subject with ``row[i]`` records at silo ``i``."""
        return ev_compose([rel.subject_event(int(k), rounds) for k, rel in zip(row, releases)])

    def s_fold_event(self, releases: Sequence[SiloRelease], rounds: int) -> dpa.DpEvent:
        """The worst-case bound without the map: a subject at every silo with that
        silo's largest count."""
        return self.subject_event(self.worst_counts(), releases, rounds)

    # --------------------------------------------------------------- epsilon
    def _eps(self, event: dpa.DpEvent) -> float:
        return event_epsilon(event, self.delta, self.accountant)

    def subject_epsilons(self, releases: Sequence[SiloRelease], rounds: int) -> np.ndarray:
        """Epsilon of every subject (identical rows are computed once)."""
        unique, inverse = np.unique(self.counts, axis=0, return_inverse=True)
        eps = np.array([self._eps(self.subject_event(r, releases, rounds)) for r in unique])
        return eps[np.asarray(inverse).ravel()]

    def epsilon(self, releases: Sequence[SiloRelease], rounds: int) -> float:
        """Exact subject-level epsilon: the maximum over subjects.

        Only Pareto-maximal count rows can attain it; with PLD they are screened
        by cheaper upper bounds (:func:`~.accountants.screened_max_epsilon`), so
        the result is a valid bound for every subject, and it equals the maximum
        of the subjects' PLD epsilons whenever those bounds lie above them (as
        they did in every check, e.g. ``tests/test_ledger.py``)."""
        if len(self.candidates) == 0:
            return 0.0
        return self.worst_subject(releases, rounds)[1]

    def s_fold_epsilon(self, releases: Sequence[SiloRelease], rounds: int) -> float:
        """Epsilon of the s-fold worst-case bound."""
        return self._eps(self.s_fold_event(releases, rounds))

    def single_silo_epsilon(self, releases: Sequence[SiloRelease], rounds: int) -> float:
        """Largest epsilon of one silo alone (what a silo computes without
        horizontal composition)."""
        worst = self.worst_counts()
        return max(self._eps(rel.subject_event(int(k), rounds)) for k, rel in zip(worst, releases))

    # ------------------------------------------------------------ calibration
    def calibrate(self, target_epsilon: float, rounds: int, releases_of: callable,
                  accounting: str = "exact") -> float:
        """Smallest noise multiplier ``z`` whose epsilon meets ``target_epsilon``
        after ``rounds`` rounds; ``releases_of(z)`` builds the silos' releases.

        ``exact``: max over subjects; ``scaled-steps``: the s-fold bound;
        ``sqrt-rounds``: one silo alone (the paper's per-silo sigma; train
        ``sqrt_rounds(rounds, s)`` rounds)."""
        if accounting not in ACCOUNTING:
            raise ValueError(f"accounting must be one of {ACCOUNTING}, got {accounting!r}")
        if accounting == "exact":
            return self._calibrate_exact(target_epsilon, rounds, releases_of)
        if accounting == "scaled-steps":
            def events(z: float) -> list[dpa.DpEvent]:
                return [self.s_fold_event(releases_of(z), rounds)]
        else:
            def events(z: float) -> list[dpa.DpEvent]:
                rel = releases_of(z)
                return [r.subject_event(int(k), rounds) for k, r in zip(self.worst_counts(), rel)]
        return calibrate(target_epsilon, self.delta, events, self.accountant)

    def worst_subject(self, releases: Sequence[SiloRelease], rounds: int) -> tuple[int, float]:
        """``(subject index, epsilon)`` of a subject attaining :meth:`epsilon`."""
        events = [self.subject_event(self.counts[i], releases, rounds) for i in self.candidates]
        if self.accountant == "rdp":
            eps = [self._eps(e) for e in events]
            j = int(np.argmax(eps))
            return int(self.candidates[j]), float(eps[j])
        best, j, _ = screened_max_epsilon(events, self.delta)
        return int(self.candidates[max(j, 0)]), float(best)

    def _calibrate_exact(self, target_epsilon: float, rounds: int, releases_of: callable) -> float:
        """Calibrate to the worst subject, then verify against every subject.

        The ``z`` calibrated to one subject is a lower bound on the ``z`` every
        subject needs; if the exact maximum over subjects meets the target at it,
        it is the answer, otherwise the subject that violates it is calibrated to
        next (at most one pass per Pareto candidate; in practice one or two)."""
        subject, _ = self.worst_subject(releases_of(1.0), rounds)
        z, seen = 0.0, set()
        while True:
            if subject in seen:  # numerical corner: feasible for it by calibration
                z *= 1.001
            else:
                seen.add(subject)
                row = self.counts[subject]
                z = max(z, calibrate(target_epsilon, self.delta,
                                     lambda s, row=row: [self.subject_event(row, releases_of(s), rounds)],
                                     self.accountant))
            subject, eps = self.worst_subject(releases_of(z), rounds)
            if eps <= target_epsilon:
                return z

    def max_rounds(self, target_epsilon: float, releases: Sequence[SiloRelease],
                   limit: int = 10_000, bound: str = "exact") -> int:
        """Most rounds at these releases whose epsilon (``exact`` or ``s-fold``) stays
        within ``target_epsilon`` (0 if even one round exceeds it)."""
        eps = self.epsilon if bound == "exact" else self.s_fold_epsilon
        lo, hi = 0, 1
        while hi <= limit and eps(releases, hi) <= target_epsilon:
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if eps(releases, mid) <= target_epsilon:
                lo = mid
            else:
                hi = mid
        return lo


@functools.lru_cache(maxsize=64)
def sqrt_rounds(rounds: int, silos: int) -> int:
    """The paper's Theorem 4.2 rule: ``floor(R / sqrt(s))`` rounds (at least 1)."""
    return max(1, int(math.floor(rounds / math.sqrt(silos))))
