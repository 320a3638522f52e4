"""Unit tests of each system's release and aggregation code (DP-MTL's noisy mean,
subject-level plan, silo map and silo training, Priv-AltMin's releases, the winsorized
mean): each checks one value or rule that a mutant would change (docs/mutation.md)."""

from __future__ import annotations

import copy
import json
import logging
import math
import re

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.exception import PrivacyBudgetExhausted
from torch import nn

from flwr_jdp.altmin.algorithm import AltMinConfig
from flwr_jdp.altmin.plan import NoisePlan
from flwr_jdp.altmin.problem import ProblemSpec
from flwr_jdp.altmin.release import GaussianRelease
from flwr_jdp.altmin.solver import newton_update
from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.mtl import noise as mtl_noise
from flwr_jdp.mtl.algorithm import MeanServer, MTLConfig
from flwr_jdp.mtl.noise import (
    MeanRelease,
    paper_alpha,
    paper_sigma,
    plan_release,
    theorem1_rdp,
    theorem2_epsilon,
    tight_sigma,
)
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon as ref_epsilon
from flwr_jdp.privacy.horizontal import HorizontalAccountant, SiloRelease
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, LaplaceSumMechanism
from flwr_jdp.strategies.dp_mtl import DPMeanRegularizedMTL
from flwr_jdp.strategies.priv_altmin import PrivAltMin
from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
from flwr_jdp.strategies.winsorized import DifferentialPrivacyWinsorizedMean
from flwr_jdp.subject import plan as plan_mod
from flwr_jdp.subject.config import SubjectDPConfig
from flwr_jdp.subject.plan import (
    SubjectPlan,
    accounting_counts,
    make_plan,
    planning_counts,
    releases,
    sample_rates,
    silo_rates,
    worst_case_counts,
)
from flwr_jdp.subject.silos import assign_records, subject_silo_counts, truncate_per_subject
from flwr_jdp.training import subject_level as sl
from flwr_jdp.training.subject_level import (
    BatchStats,
    SiloData,
    SiloPlan,
    cap_per_subject,
    clipped_batch_gradient,
    group_size,
    poisson_records,
    poisson_subjects,
    rank_within_subject,
    record_batch,
    subject_batch,
    train_silo_round,
)
from flwr_jdp.winsorized.estimator import (
    RandomRotation,
    WinsorizedMean,
    clipped_average,
    clipped_gaussian_mean,
    clipped_sum,
    hadamard,
    histogram,
    rotated_radius,
)


# -------------------- Priv-AltMin releases
def test_altmin_release_noise_std_event_and_arguments():
    with pytest.raises(ValueError, match="noise multiplier must be >= 0"):
        GaussianRelease(-0.1, 1.0)
    for s in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="sensitivity must be a positive finite number"):
            GaussianRelease(1.0, s)
    GaussianRelease(0.0, 1.0)
    r = GaussianRelease(2.0, 0.5)
    assert r.std == pytest.approx(1.0) and r.event() == dpa.GaussianDpEvent(2.0)
    assert r.mechanism.unit == "user"
    total = np.arange(6.0).reshape(2, 3)
    out = GaussianRelease(0.0, 1.0).release(total, np.random.default_rng(0))
    assert out.dtype == np.float64 and np.array_equal(out, total) and out is not total
    draws = np.stack([r.release(np.zeros(4000), np.random.default_rng(k)) for k in range(3)])
    assert draws.std() == pytest.approx(1.0, rel=0.03) and abs(draws.mean()) < 0.03
    noise = r.noise((300, 300), np.random.default_rng(1))
    assert noise.shape == (300, 300) and noise.std() == pytest.approx(1.0, rel=0.02)
    sym = GaussianRelease(2.0, 0.5, symmetric=True)
    m = sym.release(np.zeros((200, 200)), np.random.default_rng(2))
    assert np.array_equal(m, m.T) and m[np.triu_indices(200)].std() == pytest.approx(1.0, rel=0.03)
    assert sym.event() == dpa.GaussianDpEvent(2.0)
    assert not np.array_equal(m, np.zeros((200, 200)) + m[0, 0])


# -------------------- subject-level DP: plan, silo map and cap, silo round, strategy
NAN = float("nan")


def _exact_error(exc_type, message: str):
    return pytest.raises(exc_type, match="^" + re.escape(message) + "$")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sampled(p: float, z: float, steps: int) -> dpa.DpEvent:
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(z)), steps)


def _same_event(a: dpa.DpEvent, b: dpa.DpEvent) -> bool:
    """Structural equality of dp-accounting events, sampling probabilities to 1e-12."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dpa.ComposedDpEvent):
        return len(a.events) == len(b.events) and all(_same_event(x, y) for x, y in zip(a.events, b.events))
    if isinstance(a, dpa.SelfComposedDpEvent):
        return a.count == b.count and _same_event(a.event, b.event)
    if isinstance(a, dpa.PoissonSampledDpEvent):
        return abs(a.sampling_probability - b.sampling_probability) < 1e-12 and _same_event(a.event, b.event)
    return a == b


# =============================================================================== plan.py


def test_plan_to_dict_lists_every_field():
    p = SubjectPlan(1.5, 7, (0.1, 0.2), 14, "subject", 2.5, 3.5, 4.0)
    assert p.to_dict() == {"noise_multiplier": 1.5, "rounds": 7, "sample_rates": (0.1, 0.2),
                           "calibration_steps": 14, "unit": "subject", "epsilon": 2.5,
                           "epsilon_sfold": 3.5, "epsilon_claimed": 4.0}


def test_sample_rates_are_batch_over_size_capped_at_one_and_empty_silos_count_as_one():
    assert sample_rates(np.array([0, 1, 4, 10]), 1) == (1.0, 1.0, 0.25, 0.1)
    assert sample_rates(np.array([0, 1, 2, 5, 8]), 3) == (1.0, 1.0, 1.0, 0.6, 0.375)
    assert isinstance(sample_rates(np.array([4]), 2), tuple)


def test_releases_default_to_record_sampling_and_carry_each_rate():
    assert releases((0.1, 0.5), 1.5, 3) == [SiloRelease(0.1, 1.5, 3, sampling="records"),
                                            SiloRelease(0.5, 1.5, 3, sampling="records")]
    assert releases((0.2,), 2.0, 4, "subjects") == [SiloRelease(0.2, 2.0, 4, sampling="subjects")]


def test_worst_case_counts_is_one_row_of_k_at_every_silo():
    w = worst_case_counts(SubjectDPConfig(max_records_per_subject=5, num_silos=3))
    assert w.shape == (1, 3) and w.dtype == np.int64 and (w == 5).all()
    with _exact_error(ValueError, "worst_case_counts needs max-records-per-subject > 0"):
        worst_case_counts(SubjectDPConfig(max_records_per_subject=0))


def test_silo_rates_public_cap_subjects_and_records():
    assert silo_rates(SubjectDPConfig(sample_rate=0.3, num_silos=3)) == (0.3, 0.3, 0.3)
    counts = np.array([[3, 0, 1], [1, 0, 0], [2, 5, 0]])
    subj = SubjectDPConfig(max_records_per_subject=0, num_silos=3, sampling="subjects", batch_size=2)
    assert silo_rates(subj, counts) == pytest.approx((2 / 3, 1.0, 1.0))  # 3, 1, 1 subjects
    subj1 = SubjectDPConfig(max_records_per_subject=0, num_silos=3, sampling="subjects", batch_size=1)
    assert silo_rates(subj1, counts) == pytest.approx((1 / 3, 1.0, 1.0))
    rec = SubjectDPConfig(max_records_per_subject=0, num_silos=3, batch_size=2)
    assert silo_rates(rec, counts) == pytest.approx((2 / 6, 2 / 5, 1.0))  # 6, 5, 1 records


def test_accounting_counts_are_presence_under_subject_sampling_else_unchanged():
    counts = np.array([[0, 3, 1], [7, 0, 2]])
    got = accounting_counts(SubjectDPConfig(sampling="subjects"), counts)
    assert got.dtype == np.int64 and got.tolist() == [[0, 1, 1], [1, 0, 1]]
    assert accounting_counts(SubjectDPConfig(), counts) is counts


def test_planning_counts_in_each_mode_and_their_errors():
    cap = SubjectDPConfig(max_records_per_subject=4, num_silos=2)
    assert planning_counts(cap, None).tolist() == [[4, 4]]
    with _exact_error(ValueError, "max-records-per-subject > 0 plans for the worst-case subject; reported "
                                  "counts are for max-records-per-subject = 0"):
        planning_counts(cap, np.ones((2, 2), dtype=np.int64))
    rep = SubjectDPConfig(max_records_per_subject=0, num_silos=2)
    out = planning_counts(rep, [[1, 2], [3, 0]])
    assert isinstance(out, np.ndarray) and out.tolist() == [[1, 2], [3, 0]]
    with _exact_error(ValueError, "max-records-per-subject = 0 (reported counts) needs the subject-to-silo "
                                  "counts"):
        planning_counts(rep, None)


def _assert_plan(p: SubjectPlan, z, rounds, rates, cal_steps, unit, eps, sfold, claimed):
    assert p.noise_multiplier == z and p.rounds == rounds and p.sample_rates == pytest.approx(rates)
    assert p.calibration_steps == cal_steps and p.unit == unit and p.epsilon_claimed == claimed
    for got, want in ((p.epsilon, eps), (p.epsilon_sfold, sfold)):
        assert (math.isnan(got) and math.isnan(want)) or got == want


def test_fedavg_plan_has_no_noise_and_infinite_epsilon():
    cap = SubjectDPConfig(method="fedavg", num_silos=3, sample_rate=0.4, budget_rounds=6)
    _assert_plan(make_plan(cap), 0.0, 6, (0.4,) * 3, 0, "none", math.inf, math.inf, math.inf)
    rep = SubjectDPConfig(method="fedavg", num_silos=2, batch_size=2, budget_rounds=5, max_records_per_subject=0)
    _assert_plan(make_plan(rep, np.array([[3, 1], [1, 1]])), 0.0, 5, (0.5, 1.0), 0, "none",
                 math.inf, math.inf, math.inf)


@pytest.fixture
def spies(monkeypatch):
    """Replace every epsilon computation and calibration ``make_plan`` calls by a spy
    that records its arguments (fast; the wiring is what is checked)."""
    calls: dict[str, list] = {"event_epsilon": [], "calibrate": [], "acc_calibrate": [], "epsilon": [],
                              "s_fold": []}

    def event_epsilon(event, delta, accountant):
        calls["event_epsilon"].append((event, delta, accountant))
        return 1.25

    def calibrate(target, delta, fn, accountant):
        calls["calibrate"].append((target, delta, fn, accountant))
        return 1.7

    def acc_calibrate(self, target, rounds, releases_of, accounting="exact"):
        calls["acc_calibrate"].append((self.counts.copy(), target, rounds, releases_of, accounting))
        return 1.9

    def acc_epsilon(self, rel, rounds):
        calls["epsilon"].append((self.counts.copy(), self.delta, self.accountant, list(rel), rounds))
        return 2.25

    def acc_s_fold(self, rel, rounds):
        calls["s_fold"].append((self.counts.copy(), self.delta, self.accountant, list(rel), rounds))
        return 3.25

    monkeypatch.setattr(plan_mod, "event_epsilon", event_epsilon)
    monkeypatch.setattr(plan_mod, "calibrate", calibrate)
    monkeypatch.setattr(HorizontalAccountant, "calibrate", acc_calibrate)
    monkeypatch.setattr(HorizontalAccountant, "epsilon", acc_epsilon)
    monkeypatch.setattr(HorizontalAccountant, "s_fold_epsilon", acc_s_fold)
    return calls


def test_local_item_dp_plan_with_given_z_is_record_dp_sgd_at_the_largest_rate(spies):
    counts = np.array([[2, 4, 1], [2, 4, 1]])  # 4, 8, 2 records: rates 0.25, 0.125, 0.5
    cfg = SubjectDPConfig(method="local-item-dp", max_records_per_subject=0, num_silos=3, batch_size=1,
                          budget_rounds=5, local_steps=2, noise_multiplier=0.8, accounting="sqrt-rounds",
                          delta=1e-6, target_epsilon=3.0)
    p = make_plan(cfg, counts, accountant="rdp")
    _assert_plan(p, 0.8, 5, (0.25, 0.125, 0.5), 10, "record", 1.25, NAN, 3.0)
    ((event, delta, accountant),) = spies["event_epsilon"]
    assert event == _sampled(0.5, 0.8, 10) and delta == 1e-6 and accountant == "rdp"
    assert spies["calibrate"] == [] and spies["epsilon"] == []


def test_local_item_dp_plan_calibrates_when_z_is_zero(spies):
    cfg = SubjectDPConfig(method="local-item-dp", num_silos=2, sample_rate=0.2, budget_rounds=3, local_steps=2,
                          delta=1e-6, target_epsilon=2.5)
    p = make_plan(cfg)
    _assert_plan(p, 1.7, 3, (0.2, 0.2), 6, "record", 1.25, NAN, 2.5)
    ((target, delta, fn, accountant),) = spies["calibrate"]
    assert (target, delta, accountant) == (2.5, 1e-6, "pld")
    assert fn(2.0) == [_sampled(0.2, 2.0, 6)]
    assert spies["event_epsilon"][0] == (_sampled(0.2, 1.7, 6), 1e-6, "pld")
    make_plan(cfg, accountant="rdp")
    assert spies["calibrate"][1][3] == "rdp" and spies["event_epsilon"][1][2] == "rdp"


def test_local_group_dp_plan_claims_the_target_with_scaled_steps_or_sqrt_rounds(spies):
    counts = np.array([[1, 2, 0, 1], [1, 1, 1, 1]])  # 4 silos, sizes 2, 3, 1, 2
    base = dict(method="local-group-dp", max_records_per_subject=0, num_silos=4, batch_size=1, budget_rounds=10,
                local_steps=3, target_epsilon=6.0)
    sq = make_plan(SubjectDPConfig(accounting="sqrt-rounds", **base), counts)
    _assert_plan(sq, 0.0, 5, (0.5, 1 / 3, 1.0, 0.5), 30, "subject (group DP, claimed)", NAN, NAN, 6.0)
    sc = make_plan(SubjectDPConfig(accounting="scaled-steps", **base), counts)
    _assert_plan(sc, 0.0, 10, (0.5, 1 / 3, 1.0, 0.5), 120, "subject (group DP, claimed)", NAN, NAN, 6.0)
    assert all(not v for v in spies.values())


@pytest.mark.parametrize("sampling", ["records", "subjects"])
def test_public_cap_plan_with_given_z_accounts_the_worst_case_row(spies, sampling):
    cfg = SubjectDPConfig(max_records_per_subject=3, num_silos=4, sample_rate=0.2, budget_rounds=9, local_steps=2,
                          noise_multiplier=0.9, sampling=sampling, accounting="sqrt-rounds", delta=1e-6,
                          target_epsilon=5.0)
    p = make_plan(cfg, accountant="rdp")
    _assert_plan(p, 0.9, 4, (0.2,) * 4, 18, "subject", 2.25, 3.25, 5.0)  # floor(9 / sqrt 4) = 4 rounds
    rel = [SiloRelease(0.2, 0.9, 2, sampling=sampling)] * 4
    row = [3] * 4 if sampling == "records" else [1] * 4
    for key in ("epsilon", "s_fold"):
        ((counts, delta, accountant, got_rel, rounds),) = spies[key]
        assert counts.tolist() == [row] and delta == 1e-6 and accountant == "rdp"
        assert got_rel == rel and rounds == 4
    assert spies["calibrate"] == spies["acc_calibrate"] == []


def test_reported_counts_plan_with_given_z_below_one_and_scaled_steps(spies):
    counts = np.array([[3, 0], [1, 2], [0, 1]])  # sizes 4, 3
    cfg = SubjectDPConfig(max_records_per_subject=0, num_silos=2, batch_size=2, budget_rounds=4, local_steps=3,
                          noise_multiplier=0.5, accounting="scaled-steps", target_epsilon=7.0)
    p = make_plan(cfg, counts)
    _assert_plan(p, 0.5, 4, (0.5, 2 / 3), 24, "subject", 2.25, 3.25, 7.0)  # 3 * 4 * 2 calibration steps
    (c, delta, accountant, rel, rounds), = spies["epsilon"]
    assert c.tolist() == counts.tolist() and delta == 1e-5 and accountant == "pld" and rounds == 4
    assert rel == [SiloRelease(0.5, 0.5, 3), SiloRelease(2 / 3, 0.5, 3)]
    subj = SubjectDPConfig(max_records_per_subject=0, num_silos=2, batch_size=2, budget_rounds=4, local_steps=3,
                           noise_multiplier=0.5, sampling="subjects")
    p = make_plan(subj, counts)  # 2 subjects at each silo
    assert p.sample_rates == (1.0, 1.0) and p.calibration_steps == 12 and p.rounds == 4
    assert spies["epsilon"][1][0].tolist() == [[1, 0], [1, 1], [0, 1]]
    assert spies["epsilon"][1][3] == [SiloRelease(1.0, 0.5, 3, sampling="subjects")] * 2


def test_subject_inclusion_plan_calibrates_with_the_horizontal_accountant(spies):
    counts = np.array([[2, 1], [0, 3]])
    cfg = SubjectDPConfig(max_records_per_subject=0, num_silos=2, batch_size=1, budget_rounds=6, local_steps=2,
                          accounting="exact", target_epsilon=3.5, delta=1e-6)
    p = make_plan(cfg, counts, accountant="rdp")
    _assert_plan(p, 1.9, 6, (0.5, 0.25), 12, "subject", 2.25, 3.25, 3.5)
    ((c, target, rounds, releases_of, accounting),) = spies["acc_calibrate"]
    assert c.tolist() == counts.tolist() and (target, rounds, accounting) == (3.5, 6, "exact")
    assert releases_of(1.3) == [SiloRelease(0.5, 1.3, 2), SiloRelease(0.25, 1.3, 2)]
    assert spies["epsilon"][0][3] == [SiloRelease(0.5, 1.9, 2), SiloRelease(0.25, 1.9, 2)]
    assert spies["epsilon"][0][2] == "rdp" and spies["calibrate"] == []
    cap = SubjectDPConfig(max_records_per_subject=2, num_silos=3, sample_rate=0.4, sampling="subjects",
                          budget_rounds=2, local_steps=1, accounting="scaled-steps")
    make_plan(cap)
    c, _, rounds, releases_of, accounting = spies["acc_calibrate"][1]
    assert c.tolist() == [[1, 1, 1]] and rounds == 2 and accounting == "scaled-steps"
    assert releases_of(2.0) == [SiloRelease(0.4, 2.0, 1, sampling="subjects")] * 3


def test_record_inclusion_plan_calibrates_record_dp_sgd_over_the_calibration_steps(spies):
    counts = np.array([[3, 1], [1, 0]])  # sizes 4, 1: rates 0.5, 1.0
    cfg = SubjectDPConfig(max_records_per_subject=0, num_silos=2, batch_size=2, budget_rounds=3, local_steps=2,
                          inclusion="record", accounting="scaled-steps", target_epsilon=4.5, delta=1e-6)
    p = make_plan(cfg, counts, accountant="rdp")
    _assert_plan(p, 1.7, 3, (0.5, 1.0), 12, "subject", 2.25, 3.25, 4.5)
    ((target, delta, fn, accountant),) = spies["calibrate"]
    assert (target, delta, accountant) == (4.5, 1e-6, "rdp")
    assert fn(2.0) == [dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 12)]  # largest rate 1: unsampled
    assert spies["acc_calibrate"] == [] and spies["epsilon"][0][3] == [SiloRelease(0.5, 1.7, 2),
                                                                       SiloRelease(1.0, 1.7, 2)]


def test_fixed_group_size_plan_is_the_higradavg_plan(spies):
    cfg = SubjectDPConfig(method="local-group-dp", group_size=2, max_records_per_subject=2, num_silos=2,
                          sample_rate=0.3, budget_rounds=2, local_steps=1, noise_multiplier=1.1)
    _assert_plan(make_plan(cfg), 1.1, 2, (0.3, 0.3), 2, "subject", 2.25, 3.25, 4.0)
    assert spies["epsilon"][0][0].tolist() == [[2, 2]]


def test_public_cap_plan_epsilon_is_the_composition_of_the_worst_case_subject():
    """No spy: the plan's exact and s-fold epsilons are dp-accounting's epsilon of the
    subject with K records at both silos (default PLD accountant)."""
    cfg = SubjectDPConfig(max_records_per_subject=2, num_silos=2, sample_rate=0.3, budget_rounds=2, local_steps=1,
                          noise_multiplier=10.0, target_epsilon=1.0)
    p = make_plan(cfg)
    one = _sampled(1 - 0.7 ** 2, 10.0, 2)
    want = ref_epsilon(dpa.ComposedDpEvent([one, one]), 1e-5, "pld")
    assert p.epsilon == pytest.approx(want, rel=1e-6) and p.epsilon_sfold == pytest.approx(want, rel=1e-6)
    assert 0.05 < want < 1.0


# ============================================================================== silos.py


def _assign_ref(subjects, s, alpha, seed):
    rng = np.random.default_rng(seed)
    orders = np.argsort(rng.random((int(subjects.max()) + 1, s)), axis=1)
    x = rng.random(len(subjects)) ** (1.0 / alpha)
    return orders[subjects, np.floor(x * s).astype(np.int64)]


def test_assign_records_is_the_power_law_slot_of_a_per_subject_silo_order():
    subjects = np.array([2, 0, 1, 2, 2, 0, 3, 1, 0, 2] * 5)
    assert (assign_records(subjects, 4) == _assign_ref(subjects, 4, 1.0, 0)).all()
    assert (assign_records(subjects.tolist(), 5, 3.0, seed=7) == _assign_ref(subjects, 5, 3.0, 7)).all()
    assert (assign_records(subjects, 3, 1.5, seed=2) == _assign_ref(subjects, 3, 1.5, 2)).all()
    assert (assign_records(subjects, 1, 2.0) == 0).all()
    empty = assign_records(np.array([], dtype=np.int64), 3)
    assert empty.shape == (0,)
    as_floats = assign_records(subjects.astype(np.float64), 4)  # integral float ids are ids too
    assert (as_floats == _assign_ref(subjects, 4, 1.0, 0)).all()


def test_assign_records_alpha_concentrates_each_subject_on_its_own_silos():
    """Slot j of a subject's silo order gets a record with probability
    ((j+1)/s)^alpha - (j/s)^alpha: its sorted per-silo shares, averaged over subjects."""
    s, subjects = 4, np.repeat(np.arange(40), 400)
    for alpha in (2.0, 8.0):
        counts = subject_silo_counts(subjects, assign_records(subjects, s, alpha, seed=3), 40, s)
        shares = np.sort(counts, axis=1).mean(axis=0) / 400
        want = [((j + 1) / s) ** alpha - (j / s) ** alpha for j in range(s)]
        np.testing.assert_allclose(shares, want, atol=0.02)
    counts = subject_silo_counts(subjects, assign_records(subjects, s, 1.0, seed=3), 40, s)
    np.testing.assert_allclose(counts.sum(axis=0) / len(subjects), [0.25] * 4, atol=0.01)
    assert (counts > 60).all() and (counts < 140).all()


def test_assign_records_argument_errors():
    with _exact_error(ValueError, "num-silos must be >= 1, got 0"):
        assign_records(np.array([0, 1]), 0)
    with _exact_error(ValueError, "alpha must be >= 1 (1 = uniform), got 0.99"):
        assign_records(np.array([0, 1]), 2, 0.99)


def test_subject_silo_counts_counts_every_record():
    counts = subject_silo_counts([0, 2, 2, 1, 2, 0], [1, 0, 0, 1, 2, 1], 4, 3)
    assert counts.dtype == np.int64
    assert counts.tolist() == [[0, 2, 0], [0, 1, 0], [2, 0, 1], [0, 0, 0]]


def _truncate_ref(subjects, k, seed):
    keep = np.ones(len(subjects), dtype=bool)
    for a in np.unique(subjects):
        rows = np.flatnonzero(subjects == a)
        if len(rows) > k:
            rng = np.random.default_rng([int(v) % 2**64 for v in (*seed, a)])
            keep[rows[rng.permutation(len(rows))[k:]]] = False
    return np.flatnonzero(keep)


def test_truncate_per_subject_is_a_seeded_uniform_choice_per_subject():
    rng = np.random.default_rng(0)
    subjects = np.concatenate([rng.integers(0, 3, 300), [7, 7, 9]])
    rng.shuffle(subjects)
    for k, seed in ((5, (0,)), (1, (4, 11)), (40, (-1,)), (2, (2**64 + 3, -5))):
        got = truncate_per_subject(subjects, k, seed)
        assert (got == _truncate_ref(subjects, k, seed)).all()
    assert (truncate_per_subject(subjects, 5) == _truncate_ref(subjects, 5, (0,))).all()
    got = truncate_per_subject(subjects, 2, (3,))
    assert (np.diff(got) > 0).all()
    per = np.bincount(subjects[got])
    assert per[:3].tolist() == [2, 2, 2] and per[7] == 2 and per[9] == 1


def test_truncate_per_subject_choice_depends_only_on_the_subjects_own_records():
    subjects = np.array([0, 1, 0, 2, 1, 0, 0, 1, 1, 1, 2, 0, 1])
    full = truncate_per_subject(subjects, 2, (9,))
    rest = np.flatnonzero(subjects != 2)
    without = rest[truncate_per_subject(subjects[rest], 2, (9,))]
    assert set(full.tolist()) - set(np.flatnonzero(subjects == 2).tolist()) == set(without.tolist())
    assert len({tuple(truncate_per_subject(subjects, 1, (s,))) for s in range(8)}) > 1  # the seed decides
    with _exact_error(ValueError, "max_records must be >= 1, got 0"):
        truncate_per_subject(subjects, 0)


# ================================================================ training/subject_level.py


def test_silo_data_from_numpy_keeps_integer_features_and_casts_floats():
    ints = SiloData.from_numpy(np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int32), [1.0, 0.0, 2.0],
                               np.array([4, 4, 1], dtype=np.int32))
    assert ints.x.dtype == torch.int64 and ints.y.dtype == torch.int64 and ints.subject.dtype == torch.int64
    assert ints.x.tolist() == [[1, 2], [3, 4], [5, 6]] and ints.y.tolist() == [1, 0, 2]
    assert ints.subject.tolist() == [4, 4, 1] and len(ints) == 3
    floats = SiloData.from_numpy(np.array([[0.5, 1.5]]), np.array([1]), np.array([0]))
    assert floats.x.dtype == torch.float32 and floats.x.tolist() == [[0.5, 1.5]] and len(floats) == 1


def test_silo_plan_defaults():
    p = SiloPlan("fedavg", 0.5, 2, 0.1)
    assert (p.clipping_norm, p.noise_multiplier, p.group_noise, p.sampling) == (1.0, 0.0, None, "records")
    assert (p.records_per_subject, p.group_size, p.normaliser) == (1, 0, 0.0)
    stats, other = BatchStats(), BatchStats()
    assert stats.group_sizes == stats.distinct_subjects == stats.noise_multipliers == []
    stats.group_sizes.append(1)
    assert other.group_sizes == []


@pytest.mark.parametrize("kwargs,message", [
    (dict(method="nope"), "method must be one of ('fedavg', 'local-item-dp', 'higradavg-dp', 'local-group-dp', "
                          "'user-ldp'), got 'nope'"),
    (dict(sample_rate=0.0), "sample rate must be in (0, 1], got 0.0"),
    (dict(sample_rate=1.0000001), "sample rate must be in (0, 1], got 1.0000001"),
    (dict(method="local-group-dp", group_noise=abs, group_size=-1),
     "group_size must be 0, or > 0 for local-group-dp; got -1"),
    (dict(group_size=1), "group_size must be 0, or > 0 for local-group-dp; got 1"),
    (dict(method="local-group-dp"), "local-group-dp needs group_noise (or a fixed group_size)"),
    (dict(sampling="users"), "sampling must be one of ('records', 'subjects'), got 'users'"),
    (dict(method="local-item-dp", sampling="subjects"), "sampling = subjects is for higradavg-dp only"),
    (dict(records_per_subject=-1), "records_per_subject must be >= 0, got -1"),
    (dict(normaliser=-0.5), "normaliser must be >= 0 and finite, got -0.5"),
    (dict(normaliser=math.inf), "normaliser must be >= 0 and finite, got inf"),
    (dict(normaliser=NAN), "normaliser must be >= 0 and finite, got nan"),
], ids=["method", "rate-zero", "rate-above-one", "group-negative", "group-not-lgd", "lgd-no-noise", "sampling",
        "subjects-not-higradavg", "records-per-subject", "normaliser-negative", "normaliser-inf", "normaliser-nan"])
def test_silo_plan_rejects_each_bad_field_with_its_message(kwargs, message):
    args = dict(method="higradavg-dp", sample_rate=0.5, steps=1, lr=0.1)
    args.update(kwargs)
    with _exact_error(ValueError, message):
        SiloPlan(**args)


def test_silo_plan_accepts_the_boundaries():
    SiloPlan("higradavg-dp", 1.0, 1, 0.1, sampling="subjects", records_per_subject=0, normaliser=0.0)
    SiloPlan("higradavg-dp", 1e-9, 1, 0.1, normaliser=1e-9)
    SiloPlan("local-group-dp", 0.5, 1, 0.1, group_size=1)
    SiloPlan("local-group-dp", 0.5, 1, 0.1, group_noise=abs)


def _rank_ref(subjects: torch.Tensor, perm: torch.Tensor) -> list[int]:
    """Rank of each record among its subject's records, in the order of ``perm``."""
    pos = {int(r): i for i, r in enumerate(perm)}
    s = subjects.tolist()
    return [sum(1 for j in range(len(s)) if s[j] == s[r] and pos[j] < pos[r]) for r in range(len(s))]


def test_poisson_records_keeps_the_records_whose_uniform_is_below_the_rate():
    u = torch.rand(30, generator=_gen(5))
    rate = float(u[7])  # a draw equal to the rate is not kept (strict <)
    got = poisson_records(30, rate, _gen(5))
    assert got.dtype == torch.int64 and got.tolist() == torch.nonzero(u < rate).flatten().tolist()
    assert 7 not in got.tolist() and 0 < len(got) < 30
    assert poisson_records(5, 1.0, _gen(0)).tolist() == [0, 1, 2, 3, 4]


def test_rank_within_subject_is_the_position_among_the_subjects_records_in_one_permutation():
    subjects = torch.tensor([3, 1, 3, 3, 0, 1, 3, 0, 5, 3, 1])
    for seed in range(3):
        perm = torch.randperm(len(subjects), generator=_gen(seed))
        got = rank_within_subject(subjects, _gen(seed))
        assert got.dtype == torch.int64 and got.tolist() == _rank_ref(subjects, perm)


def test_rank_within_subject_is_uniform():
    subjects = torch.tensor([0, 1, 0, 0])
    gen, firsts = _gen(1), np.zeros(4)
    for _ in range(1000):
        firsts[(rank_within_subject(subjects, gen) == 0).numpy()] += 1
    assert firsts[1] == 1000
    np.testing.assert_allclose(firsts[[0, 2, 3]] / 1000, [1 / 3] * 3, atol=0.06)


def test_cap_per_subject_keeps_the_records_ranked_below_the_cap():
    subjects = torch.tensor([2, 2, 0, 2, 1, 2, 0, 0, 2, 1])
    records = torch.tensor([0, 1, 3, 4, 5, 6, 7, 8])
    for cap in (1, 2, 3):
        perm = torch.randperm(len(records), generator=_gen(cap))
        rank = _rank_ref(subjects[records], perm)
        want = [int(r) for r, k in zip(records, rank) if k < cap]
        assert cap_per_subject(records, subjects, cap, _gen(cap)).tolist() == want
    empty = torch.zeros(0, dtype=torch.long)
    out = cap_per_subject(empty, subjects, 2, _gen(0))
    assert out.dtype == torch.long and len(out) == 0


def test_poisson_subjects_samples_subjects_then_their_first_records():
    subjects = torch.tensor([4, 2, 4, 9, 2, 4, 9, 4, 7])  # units: 2 -> 0, 4 -> 1, 7 -> 2, 9 -> 3
    unit = torch.tensor([1, 0, 1, 3, 0, 1, 3, 1, 2])
    for seed in range(4):
        g = _gen(seed)
        chosen = torch.rand(4, generator=g) < 0.6
        perm = torch.randperm(len(subjects), generator=g)
        rank = _rank_ref(subjects, perm)
        for per in (1, 2):
            want = [r for r in range(len(subjects)) if chosen[unit[r]] and rank[r] < per]
            assert poisson_subjects(subjects, 0.6, per, _gen(seed)).tolist() == want
        want_all = [r for r in range(len(subjects)) if chosen[unit[r]]]
        assert poisson_subjects(subjects, 0.6, 0, _gen(seed)).tolist() == want_all
    empty = poisson_subjects(torch.zeros(0, dtype=torch.long), 0.5, 1, _gen(0))
    assert empty.dtype == torch.long and empty.shape == (0,)
    assert poisson_subjects(torch.tensor([6]), 1.0, 1, _gen(0)).tolist() == [0]


def test_subject_batch_record_batch_and_group_size():
    batch = subject_batch(torch.tensor([4, 0, 2, 1]), torch.tensor([7, 7, 3, 3, 9]))
    assert batch.records.tolist() == [4, 0, 2, 1] and batch.units.tolist() == [2, 1, 0, 1] and batch.num_units == 3
    assert group_size(batch) == 2
    rb = record_batch(torch.tensor([5, 2, 8]))
    assert rb.records.tolist() == [5, 2, 8] and rb.units.tolist() == [0, 1, 2] and rb.num_units == 3
    assert group_size(rb) == 1
    assert group_size(subject_batch(torch.tensor([3]), torch.arange(5))) == 1
    assert group_size(subject_batch(torch.zeros(0, dtype=torch.long), torch.arange(5))) == 0
    assert group_size(subject_batch(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 0, 1, 2, 1]))) == 3


def test_clipped_batch_gradient_scales_all_parameters_jointly():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    out = clipped_batch_gradient(grads, 1.0)
    f = 1.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(out[0].numpy(), [3 * f, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[1].numpy(), [[4 * f]], rtol=1e-6)
    small = clipped_batch_gradient([torch.tensor([0.3, -0.4])], 2.0)
    np.testing.assert_allclose(small[0].numpy(), [0.3, -0.4], rtol=1e-7)


def test_step_moves_each_parameter_by_minus_lr_times_its_update():
    params = [nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([[-1.0]]))]
    sl._step(params, [torch.tensor([0.5, -1.0]), torch.tensor([[2.0]])], 0.1)
    np.testing.assert_allclose(params[0].detach().numpy(), [0.95, 2.1], rtol=1e-6)
    np.testing.assert_allclose(params[1].detach().numpy(), [[-1.2]], rtol=1e-6)


# --------------------------------------------------------------- train_silo_round, noiseless

D, K = 3, 4


def _case(n: int = 12, seed: int = 0):
    """A linear model and data whose per-record gradients straddle C = 1."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)) * 1.5
    y = rng.integers(0, K, n)
    subjects = np.array([0, 1, 0, 2, 0, 1, 3, 0, 2, 1, 0, 3][:n]) if n <= 12 else rng.integers(0, 4, n)
    w, b = rng.normal(size=(K, D)) * 0.5, rng.normal(size=K) * 0.5
    return x, y, subjects, w, b


def _model(w: np.ndarray, b: np.ndarray) -> nn.Linear:
    m = nn.Linear(D, K)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w))
        m.bias.copy_(torch.from_numpy(b))
    return m


def _flat(m: nn.Linear) -> np.ndarray:
    return np.concatenate([m.weight.detach().numpy().ravel(), m.bias.detach().numpy()]).astype(np.float64)


def _per_record(w, b, x, y):
    """(per-record gradients [weight, bias] flattened, per-record cross-entropy), numpy float64."""
    logits = x @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    losses = -np.log(p[np.arange(len(y)), y])
    p[np.arange(len(y)), y] -= 1.0
    grads = np.concatenate([(p[:, :, None] * x[:, None, :]).reshape(len(y), -1), p], axis=1)
    return grads, losses


def _clip(g: np.ndarray, c: float) -> np.ndarray:
    return g * np.minimum(1.0, c / (np.linalg.norm(g, axis=-1, keepdims=True) + 1e-6))


def _expected_update(method, grads, records, subjects, c, expected):
    g = grads[records]
    if method == "fedavg":
        return g.mean(0)
    if method == "user-ldp":
        return _clip(g.mean(0), c)
    clipped = _clip(g, c)
    if method == "higradavg-dp":
        subs = subjects[records]
        return sum(clipped[subs == a].mean(0) for a in np.unique(subs)) / expected
    return clipped.sum(0) / expected


@pytest.mark.parametrize("method,extra", [
    ("fedavg", {}),
    ("local-item-dp", {}),
    ("higradavg-dp", {}),
    ("user-ldp", {}),
    ("local-group-dp", {"group_size": 2}),
    ("local-group-dp", {"group_noise": "spy"}),
], ids=["fedavg", "item", "higradavg", "user-ldp", "fixed-group", "group-noise"])
def test_noiseless_step_is_the_methods_clipped_sum_over_the_public_normaliser(method, extra):
    x, y, subjects, w, b = _case()
    grads, losses = _per_record(w, b, x, y)
    norms = np.linalg.norm(grads, axis=1)
    assert norms.min() < 1.0 < norms.max()  # both sides of the clipping norm
    seen: list[int] = []
    if extra.get("group_noise") == "spy":
        extra = {"group_noise": lambda z: seen.append(z) or 0.0}
    model, stats = _model(w, b), BatchStats()
    plan = SiloPlan(method, 1.0, 1, 0.7, 1.0, 0.0, normaliser=0.5, **extra)
    loss = train_silo_round(model, SiloData.from_numpy(x, y, subjects), plan, _gen(3), stats)
    records = np.arange(12)
    if extra.get("group_size"):  # at most 2 records of a subject, the ones ranked first
        g = _gen(3)
        torch.rand(12, generator=g)
        rank = _rank_ref(torch.from_numpy(subjects), torch.randperm(12, generator=g))
        records = np.array([r for r in range(12) if rank[r] < 2])
    want = np.concatenate([w.ravel(), b]) - 0.7 * _expected_update(method, grads, records, subjects, 1.0, 0.5)
    np.testing.assert_allclose(_flat(model), want, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(losses[records].mean(), rel=1e-5)
    assert stats.group_sizes == [int(np.bincount(subjects[records]).max())]
    assert stats.distinct_subjects == [len(np.unique(subjects[records]))]
    assert stats.noise_multipliers == ([] if method == "fedavg" else [0.0])
    if seen:
        assert seen == [5]  # Z: subject 0 has 5 records
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())
    assert not model._forward_hooks and not model._backward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("method,sampling,rate,per_subject", [
    ("higradavg-dp", "records", 0.5, 1),
    ("local-item-dp", "records", 0.5, 1),
    ("higradavg-dp", "subjects", 1.0, 0),
])
def test_noiseless_step_without_normaliser_divides_by_the_silos_expected_batch(method, sampling, rate, per_subject):
    x, y, subjects, w, b = _case()
    grads, _ = _per_record(w, b, x, y)
    model = _model(w, b)
    plan = SiloPlan(method, rate, 1, 1.0, 1.0, 0.0, sampling=sampling, records_per_subject=per_subject)
    train_silo_round(model, SiloData.from_numpy(x, y, subjects), plan, _gen(4))
    if sampling == "records":
        records = torch.nonzero(torch.rand(12, generator=_gen(4)) < rate).flatten().numpy()
        expected = rate * 12
    else:
        records, expected = np.arange(12), 4.0  # every subject, all its records; 4 subjects
    assert 0 < len(records) < 12 or sampling == "subjects"
    want = np.concatenate([w.ravel(), b]) - _expected_update(method, grads, records, subjects, 1.0, expected)
    np.testing.assert_allclose(_flat(model), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["fedavg", "higradavg-dp"])
def test_two_steps_start_from_fresh_gradients_and_the_loss_is_their_mean(method):
    x, y, subjects, w, b = _case()
    model = _model(w, b)
    plan = SiloPlan(method, 1.0, 2, 0.5, 1.0, 0.0, normaliser=6.0)
    loss = train_silo_round(model, SiloData.from_numpy(x, y, subjects), plan, _gen(0))
    theta, step_losses = np.concatenate([w.ravel(), b]), []
    for _ in range(2):
        grads, losses = _per_record(theta[:K * D].reshape(K, D), theta[K * D:], x, y)
        step_losses.append(losses.mean())
        theta = theta - 0.5 * _expected_update(method, grads, np.arange(12), subjects, 1.0, 6.0)
    np.testing.assert_allclose(_flat(model), theta, rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(np.mean(step_losses), rel=1e-5)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", ["fedavg", "higradavg-dp"])
def test_frozen_parameters_are_neither_updated_nor_clipped_with(method):
    x, y, subjects, w, b = _case()
    grads, _ = _per_record(w, b, x, y)
    model = _model(w, b)
    model.bias.requires_grad_(False)
    plan = SiloPlan(method, 1.0, 1, 1.0, 1.0, 0.0, normaliser=3.0)
    train_silo_round(model, SiloData.from_numpy(x, y, subjects), plan, _gen(0))
    want = w.ravel() - _expected_update(method, grads[:, :K * D], np.arange(12), subjects, 1.0, 3.0)
    np.testing.assert_allclose(model.weight.detach().numpy().ravel(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.bias.detach().numpy(), b.astype(np.float32))


@pytest.mark.parametrize("method", ["fedavg", "higradavg-dp", "local-group-dp"])
def test_an_empty_batch_moves_nothing_without_noise_and_the_loss_is_nan(method):
    x, y, subjects, w, b = _case()
    model, stats, seen = _model(w, b), BatchStats(), []
    plan = SiloPlan(method, 1e-9, 2, 1.0, 1.0, 0.0, normaliser=2.0,
                    group_noise=(lambda z: seen.append(z) or 0.0) if method == "local-group-dp" else None)
    loss = train_silo_round(model, SiloData.from_numpy(x, y, subjects), plan, _gen(0), stats)
    assert math.isnan(loss)
    np.testing.assert_array_equal(_flat(model), np.concatenate([w.ravel(), b]).astype(np.float32))
    assert stats.group_sizes == [0, 0] and stats.distinct_subjects == [0, 0]
    if method == "local-group-dp":
        assert seen == [1, 1]  # max(1, Z) for an empty batch


def test_group_noise_is_read_at_the_batchs_group_size():
    seen: list[int] = []
    data = SiloData.from_numpy(np.ones((1, 2)), [0], [5])
    plan = SiloPlan("local-group-dp", 1.0, 2, 0.1, 1.0, group_noise=lambda z: seen.append(z) or 0.0)
    stats = BatchStats()
    train_silo_round(nn.Linear(2, 2), data, plan, _gen(0), stats)
    assert seen == [1, 1] and stats.group_sizes == [1, 1] and stats.distinct_subjects == [1, 1]


# ------------------------------------------------------------------ train_silo_round, noise


def _zero_signal(n: int, subjects: np.ndarray) -> tuple[nn.Linear, SiloData]:
    model = nn.Linear(4, 2000, bias=False)
    nn.init.zeros_(model.weight)
    return model, SiloData.from_numpy(np.zeros((n, 4)), np.zeros(n, dtype=int), subjects)


C = 0.7  # 2 C != 1: user-ldp's sensitivity is not the default denominator


@pytest.mark.parametrize("kwargs,std", [
    (dict(method="local-item-dp", sample_rate=0.5), 3.0 * C / (0.5 * 50)),
    (dict(method="higradavg-dp", sample_rate=0.4), 3.0 * C / (0.4 * 50)),
    (dict(method="higradavg-dp", sample_rate=0.5, sampling="subjects"), 3.0 * C / (0.5 * 10)),
    (dict(method="local-group-dp", sample_rate=0.5, group_size=3, normaliser=25.0), 3.0 * 3 * C / 25.0),
    (dict(method="user-ldp", sample_rate=0.5, normaliser=25.0), 2 * 3.0 * C),
    (dict(method="higradavg-dp", sample_rate=1e-9, normaliser=4.0), 3.0 * C / 4.0),
    (dict(method="user-ldp", sample_rate=1e-9), 2 * 3.0 * C),
], ids=["item", "higradavg-records", "higradavg-subjects", "fixed-group", "user-ldp", "empty-higradavg",
        "empty-user-ldp"])
def test_noise_std_is_z_times_the_sensitivity_over_the_divisor(kwargs, std):
    model, data = _zero_signal(50, np.arange(50) % 10)
    stats = BatchStats()
    train_silo_round(model, data, SiloPlan(steps=1, lr=1.0, clipping_norm=C, noise_multiplier=3.0, **kwargs),
                     _gen(11), stats)
    values = model.weight.detach().numpy()
    assert float(values.std()) == pytest.approx(std, rel=0.05)
    assert abs(float(values.mean())) < 5 * std / math.sqrt(values.size)
    assert stats.noise_multipliers == [3.0]


@pytest.mark.parametrize("kwargs", [
    dict(method="user-ldp", sample_rate=0.5),
    dict(method="higradavg-dp", sample_rate=0.5, sampling="subjects"),
    dict(method="local-item-dp", sample_rate=0.5),
])
def test_sampling_and_noise_come_from_the_given_generator_only(kwargs):
    runs = []
    for seed, global_seed in ((5, 1), (5, 2), (6, 1)):
        torch.manual_seed(global_seed)
        model, data = _zero_signal(50, np.arange(50) % 10)
        stats = BatchStats()
        train_silo_round(model, data, SiloPlan(steps=2, lr=1.0, clipping_norm=C, noise_multiplier=1.0, **kwargs),
                         _gen(seed), stats)
        runs.append((model.weight.detach().clone(), stats.distinct_subjects))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert not torch.equal(runs[0][0], runs[2][0])


def test_data_dependent_group_noise_is_sigma_z_times_c_over_the_expected_batch():
    model, data = _zero_signal(50, np.arange(50) % 10)
    stats = BatchStats()
    plan = SiloPlan("local-group-dp", 0.5, 1, 1.0, 0.5, 99.0, group_noise=lambda z: 1.5 * z)
    train_silo_round(model, data, plan, _gen(2), stats)
    (z,) = stats.group_sizes
    assert z >= 2 and stats.noise_multipliers == [1.5 * z]
    assert float(model.weight.std()) == pytest.approx(1.5 * z * 0.5 / 25.0, rel=0.05)


# =================================================================== subject/strategy.py


def _strategy(method: str = "higradavg-dp", accountant: str = "rdp", **cfg) -> SubjectLevelFedAvg:
    InProcessGrid(None, 0, {})  # sets the task identity Messages are stamped with
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        model.bias.copy_(torch.tensor([0.5, -0.5]))
    return SubjectLevelFedAvg(SubjectDPConfig(method=method, results_dir="", **cfg), model, accountant=accountant)


def _plan(z: float, rates: tuple[float, ...], epsilon: float = 1.0, cal_steps: int = 4) -> SubjectPlan:
    return SubjectPlan(z, 3, rates, cal_steps, "subject", epsilon, 2.0 * epsilon, 4.0)


def test_round_events_are_empty_without_an_account():
    st = _strategy("fedavg")
    st.plan, st.counts = _plan(0.0, (0.1, 0.1)), np.ones((1, 2), dtype=np.int64)
    assert st.round_events() == {}
    st = _strategy("local-group-dp", max_records_per_subject=0, accounting="sqrt-rounds", num_silos=2)
    st.plan, st.counts = _plan(0.0, (0.1, 0.1)), np.ones((3, 2), dtype=np.int64)
    assert st.round_events() == {}


def test_local_item_dp_round_events_are_one_dp_sgd_per_silo():
    st = _strategy("local-item-dp", num_silos=2, local_steps=2)
    st.plan, st.counts = _plan(1.5, (0.25, 1.0)), worst_case_counts(st.cfg)
    assert st.round_events() == {"silo/0": _sampled(0.25, 1.5, 2),
                                 "silo/1": dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5), 2)}


@pytest.mark.parametrize("method,sampling,p", [
    ("higradavg-dp", "records", 1 - 0.7 ** 2),
    ("higradavg-dp", "subjects", 0.3),
    ("local-group-dp", "records", 1 - 0.7 ** 2),
    ("user-ldp", "records", 1 - 0.7 ** 2),
])
def test_public_cap_round_event_is_the_worst_case_subject_at_every_silo(method, sampling, p):
    extra = {"group_size": 2} if method == "local-group-dp" else {}
    st = _strategy(method, num_silos=3, local_steps=2, max_records_per_subject=2, sample_rate=0.3,
                   sampling=sampling, **extra)
    st.plan, st.counts = _plan(2.0, (0.3,) * 3), worst_case_counts(st.cfg)
    events = st.round_events()
    assert list(events) == ["subject/worst-case"]
    assert _same_event(events["subject/worst-case"], dpa.ComposedDpEvent([_sampled(p, 2.0, 2)] * 3))


def test_reported_counts_round_events_are_one_per_pareto_maximal_subject():
    counts = np.array([[2, 0], [0, 1], [1, 1]])
    st = _strategy(max_records_per_subject=0, num_silos=2, local_steps=1)
    st.plan, st.counts = _plan(1.0, (0.5, 0.25)), counts
    events = st.round_events()
    assert sorted(events) == ["subject/0", "subject/2"]
    assert _same_event(events["subject/0"], _sampled(0.75, 1.0, 1))
    assert _same_event(events["subject/2"], dpa.ComposedDpEvent([_sampled(0.5, 1.0, 1), _sampled(0.25, 1.0, 1)]))
    st = _strategy(max_records_per_subject=0, num_silos=2, local_steps=1, sampling="subjects")
    st.plan, st.counts = _plan(1.0, (0.5, 0.25)), counts
    events = st.round_events()  # presence only: subject 2 dominates both others
    assert list(events) == ["subject/2"]
    assert _same_event(events["subject/2"], dpa.ComposedDpEvent([_sampled(0.5, 1.0, 1), _sampled(0.25, 1.0, 1)]))


def test_train_messages_carry_the_model_and_each_nodes_silo_plan():
    st = _strategy(num_silos=3)
    st.plan = _plan(2, (0.1, 0.2, 0.3), cal_steps=12)
    st.node_silos = {7: [0, 2], 9: [1]}
    messages = st._train_messages(5)
    assert [m.metadata.dst_node_id for m in messages] == [7, 9]
    assert all(m.metadata.message_type == MessageType.TRAIN for m in messages)
    for m, silos, rates in zip(messages, ([0, 2], [1]), ([0.1, 0.3], [0.2])):
        assert set(m.content.keys()) == {"model", "config"}
        conf = m.content["config"]
        assert set(conf.keys()) == {"round", "silos", "sample-rates", "noise-multiplier", "calibration-steps"}
        assert conf["round"] == 5 and list(conf["silos"]) == silos and list(conf["sample-rates"]) == rates
        assert conf["noise-multiplier"] == 2.0 and isinstance(conf["noise-multiplier"], float)
        assert conf["calibration-steps"] == 12 and isinstance(conf["calibration-steps"], int)
        arrays = m.content["model"]
        assert set(arrays.keys()) == {"weight", "bias"}
        np.testing.assert_array_equal(arrays["weight"].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_array_equal(arrays["bias"].numpy(), [0.5, -0.5])


def _arrays(value: float, **override) -> ArrayRecord:
    arrays = {"weight": np.full((2, 3), value, np.float32), "bias": np.full(2, value, np.float32), **override}
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def _reply_to(node: int, content: RecordDict) -> Message:
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN))


def test_collect_keeps_valid_silo_models_drops_the_rest_and_extends_the_batch_stats():
    st = _strategy(num_silos=9)
    st.node_silos = {7: [1, 2, 3, 4, 5, 0, 6, 8], 11: [7]}
    reference = {"weight": np.zeros((2, 3), np.float32), "bias": np.zeros(2, np.float32)}
    nan_w, inf_b = np.zeros((2, 3), np.float32), np.zeros(2, np.float32)
    nan_w[1, 2], inf_b[0] = np.nan, np.inf
    content = RecordDict({
        "silo.0": _arrays(1.0),
        "silo.2": ArrayRecord({"weight": Array(np.zeros((2, 3), np.float32))}),  # a key missing
        "silo.3": _arrays(0.0, bias=np.zeros(3, np.float32)),  # wrong shape
        "silo.4": _arrays(0.0, weight=nan_w),
        "silo.5": _arrays(0.0, bias=inf_b),
        "silo.6": _arrays(3.0),
        "silo.8": _arrays(0.0, extra=np.zeros(1, np.float32)),  # a key too many
        "stats": ArrayRecord({"group_sizes": Array(np.array([3, 1])),
                              "distinct_subjects": Array(np.array([[2, 5]])), "other": Array(np.array([9]))}),
    })
    replies = [
        _reply_to(7, content),
        Message(Error(code=3, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=11,
                                                               message_type=MessageType.TRAIN)),
        _reply_to(13, RecordDict({"silo.0": _arrays(5.0)})),  # a node that hosts no silo: ignored
        _reply_to(7, RecordDict({"stats": ArrayRecord({"group_sizes": Array(np.array([4]))})})),
    ]
    models = st._collect(replies, reference)
    assert len(models) == 2
    assert models[0]["weight"].tolist() == [[1.0] * 3] * 2 and models[1]["bias"].tolist() == [3.0, 3.0]
    assert st.dropped == [
        "node 7: no model for silo 1",
        "node 7: silo 2: arrays do not match the model",
        "node 7: silo 3: arrays do not match the model",
        "node 7: silo 4: non-finite values",
        "node 7: silo 5: non-finite values",
        "node 7: silo 8: arrays do not match the model",
        "node 11: error 3: boom",
        *[f"node 7: no model for silo {i}" for i in (1, 2, 3, 4, 5, 0, 6, 8)],
    ]
    assert st.batch_stats == {"group_sizes": [3, 1, 4], "distinct_subjects": [2, 5]}
    assert all(type(v) is int for v in st.batch_stats["group_sizes"])


def test_aggregate_train_averages_the_valid_silo_models():
    st = _strategy(num_silos=3)
    st.node_silos = {7: [0, 1], 9: [2]}
    st._reference = {"weight": np.zeros((2, 3), np.float32), "bias": np.zeros(2, np.float32)}
    replies = [_reply_to(7, RecordDict({"silo.0": _arrays(1.0), "silo.1": _arrays(2.0)})),
               _reply_to(9, RecordDict({"silo.2": _arrays(np.nan)}))]
    arrays, metrics = st.aggregate_train(1, replies)
    assert dict(metrics) == {"silos": 2} and st._silos == 2
    np.testing.assert_allclose(arrays["weight"].numpy(), np.full((2, 3), 1.5))
    np.testing.assert_allclose(st.model.bias.detach().numpy(), [1.5, 1.5])
    arrays, metrics = st.aggregate_train(2, replies[1:])
    assert arrays is None and dict(metrics) == {"silos": 0} and st._silos == 0
    np.testing.assert_allclose(st.model.weight.detach().numpy(), np.full((2, 3), 1.5))


GAUSS = {"subject/worst-case": dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(2.0), 2)}


def _charged(target: float = 4.0, plan_epsilon: float = 1.0, rounds=(), method: str = "higradavg-dp"):
    """A strategy as ``prepare`` leaves it (RDP ledger, unsampled events: fast), rounds already charged."""
    st = _strategy(method, target_epsilon=target, num_silos=2)
    st.plan, st.node_silos = _plan(2.0, (1.0, 1.0), epsilon=plan_epsilon), {7: [0, 1]}
    st._events = GAUSS if method != "fedavg" else {}
    st.ledger = PrivacyLedger(delta=st.cfg.delta, accountant="rdp", unit="subject")
    for r in rounds:
        st.ledger.record_round(r, st._events)
    return st


def test_configure_train_charges_the_round_before_the_messages_exist(monkeypatch):
    st = _charged()
    seen = []
    monkeypatch.setattr(st, "_train_messages", lambda r: seen.append((r, len(st.ledger.rounds))) or ["msg"])
    assert st.configure_train(3, None, None, None) == ["msg"]
    assert seen == [(3, 1)]
    (row,) = st.ledger.rounds
    assert (row["round"], row["scopes"], row["note"]) == (3, 1, "higradavg-dp")
    assert list(st.ledger.scopes) == ["subject/worst-case"]
    assert row["epsilon"] == pytest.approx(ref_epsilon(GAUSS["subject/worst-case"], 1e-5, "rdp"))
    assert set(st._reference) == {"weight", "bias"}
    np.testing.assert_array_equal(st._reference["bias"], [0.5, -0.5])


def test_configure_train_never_refuses_a_first_charge():
    st = _charged(target=1e-3, plan_epsilon=1e-3, rounds=(1,))
    st.configure_train(2, None, None, None)  # beyond the budget, but not a re-run
    assert [r["round"] for r in st.ledger.rounds] == [1, 2]
    st = _charged(method="fedavg", rounds=(1, 2))
    st.plan = SubjectPlan(0.0, 3, (1.0, 1.0), 0, "none", math.inf, math.inf, math.inf)
    st.configure_train(2, None, None, None)
    assert [(r["round"], r["scopes"], r["note"]) for r in st.ledger.rounds][-1] == (2, 0, "fedavg")


def _after_rerun_epsilon() -> float:
    return copy.deepcopy(_charged(rounds=(1, 2)).ledger).epsilon(GAUSS)


@pytest.mark.parametrize("rerun", [1, 2])
def test_configure_train_refuses_a_rerun_beyond_the_budget(rerun):
    """The budget lies between the epsilon already spent and the one the re-run would reach."""
    eps, spent = _after_rerun_epsilon(), _charged(rounds=(1, 2)).ledger.epsilon()
    budget = (eps + spent) / 2
    assert spent < budget < eps / (1 + 1e-3)
    st = _charged(target=budget / 2, plan_epsilon=budget, rounds=(1, 2))
    with _exact_error(PrivacyBudgetExhausted, f"re-running round {rerun} after a restart would take epsilon "
                                              f"{eps:.4g} beyond {budget:.4g}"):
        st.configure_train(rerun, None, None, None)
    assert [r["round"] for r in st.ledger.rounds] == [1, 2]


@pytest.mark.parametrize("target_share,plan_share", [(0.5, 1.0), (1.0, 0.5)])
def test_configure_train_charges_a_rerun_within_the_larger_of_target_and_plan(target_share, plan_share):
    eps = _after_rerun_epsilon()
    st = _charged(target=eps * target_share, plan_epsilon=eps * plan_share, rounds=(1, 2))
    st.configure_train(2, None, None, None)
    assert [r["round"] for r in st.ledger.rounds] == [1, 2, 2]
    assert st.ledger.epsilon() == pytest.approx(eps)


# -------------------- DP-MTL, Priv-AltMin strategy, winsorized mean
InProcessGrid(None, 0, {})  # stamps the task identity Messages need

E2 = math.exp(-2.0)  # delta with log(1/delta) = 2


def _pld_eps(z: float, count: int, delta: float) -> float:
    """dp-accounting's own add/remove PLD epsilon of ``count`` Gaussian(z) releases."""
    acc = PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=1e-3)
    acc.compose(dpa.GaussianDpEvent(z), count)
    return acc.get_epsilon(delta)


def _fresh_draw_unchanged(rng: np.random.Generator, seed: int) -> bool:
    """True if ``rng`` (seeded ``seed``) has drawn nothing yet."""
    return rng.random() == np.random.default_rng(seed).random()


def _sylvester(p: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h


def _instruction(node: int) -> Message:
    return Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)


def _error_reply(instr: Message, reason: str = "boom") -> Message:
    return Message(Error(code=0, reason=reason), reply_to=instr)


def _logged(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flwr" and r.levelno == level]


# =========================================================== DP-MTL: noise.py
def test_paper_alpha_sigma_and_theorems_hand_values():
    assert paper_alpha(4.0, E2) == pytest.approx(2.0, rel=1e-12)
    assert paper_alpha(0.5, math.exp(-3.0)) == pytest.approx(24.0, rel=1e-12)
    # 8 B sqrt(T log(1/delta)) / (eps m) = 8 * 3 * sqrt(8 * 2) / (2 * 4)
    assert paper_sigma(2.0, E2, 3.0, 8, 4) == pytest.approx(12.0, rel=1e-12)
    assert paper_sigma(1.0, math.exp(-1.0), 0.5, 1, 2) == pytest.approx(2.0, rel=1e-12)
    # 2 alpha T (2B)^2 / (m sigma)^2 = 2 * 3 * 4 * 9 / 1
    assert theorem1_rdp(3.0, 1.5, 2, 0.5, 4) == pytest.approx(216.0, rel=1e-12)
    assert theorem1_rdp(1.0, 1.0, 4, 2.0, 1) == pytest.approx(0.125, rel=1e-12)
    # alpha = 2: rdp 2*2*1*4/16 = 1, plus log(1/delta)/(alpha-1) = 2
    assert theorem2_epsilon(4.0, E2, 1.0, 1, 4, 1.0) == pytest.approx(3.0, rel=1e-12)
    # alpha = 3: rdp 2*3*2*16/(4*0.5)^2 = 48, plus 2/2 = 1
    assert theorem2_epsilon(8.0 / 3.0, E2, 2.0, 2, 4, 0.5) == pytest.approx(49.0, rel=1e-12)


def test_mean_release_properties_and_defaults():
    r = MeanRelease(3.0, 8, 0.25, 0.75)
    assert r.relation == "replace-one" and r.mode == "tight"
    assert r.denominator == 2.0
    assert r.sum_sensitivity == 6.0
    assert r.sensitivity == 3.0
    assert r.noise_multiplier == pytest.approx(0.5, rel=1e-12)
    a = MeanRelease(3.0, 8, 0.25, 0.75, "add-remove")
    assert a.sum_sensitivity == 3.0 and a.sensitivity == 1.5


def test_mean_release_mechanism_is_the_task_level_gaussian_sum():
    r = MeanRelease(3.0, 8, 0.25, 0.75)
    m = r.mechanism()
    assert type(m) is GaussianSumMechanism
    assert m.noise_multiplier == pytest.approx(0.5, rel=1e-12)
    assert (m.sensitivity, m.denominator, m.secure, m.unit) == (3.0, 2.0, False, "task")
    assert m.noise_std == pytest.approx(0.75, rel=1e-12)  # the noise std on the mean is sigma
    assert r.mechanism(True).secure is True and r.mechanism(secure=False).secure is False


def test_mean_release_events_exact_and_as_recorded():
    sampled = MeanRelease(3.0, 8, 0.25, 0.75)  # z = 0.5
    assert sampled.exact_event() == dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(0.5))
    assert sampled.event() == sampled.exact_event()
    full = MeanRelease(3.0, 8, 1.0, 0.75)  # D = 8, z = 2
    assert full.exact_event() == dpa.GaussianDpEvent(2.0)
    assert full.event() == dpa.GaussianDpEvent(2.0)
    paper = MeanRelease(3.0, 8, 1.0, 0.75, mode="paper")
    assert paper.event() == dpa.GaussianDpEvent(1.0)  # half the multiplier (Theorem 1's RDP)
    assert paper.exact_event() == dpa.GaussianDpEvent(2.0)
    assert MeanRelease(3.0, 8, 0.25, 0.75, mode="paper").event() == dpa.GaussianDpEvent(0.25)


def test_mean_release_epsilon_against_dp_accounting():
    delta = 1e-5
    full = MeanRelease(1.0, 16, 1.0, 1.0)  # z = 16, replace-one: add/remove Gaussian(8)
    assert full.epsilon(2, delta) == pytest.approx(_pld_eps(8.0, 2, delta), rel=1e-3)
    assert full.epsilon(3, delta, "pld", exact=True) == pytest.approx(_pld_eps(8.0, 3, delta), rel=1e-3)
    assert full.epsilon(1, delta) == pytest.approx(_pld_eps(8.0, 1, delta), rel=1e-3)
    paper = MeanRelease(1.0, 16, 1.0, 1.0, mode="paper")  # recorded: Gaussian(8), i.e. add/remove 4
    assert paper.epsilon(2, delta) == pytest.approx(_pld_eps(4.0, 2, delta), rel=1e-3)
    assert paper.epsilon(2, delta, exact=True) == pytest.approx(_pld_eps(8.0, 2, delta), rel=1e-3)
    addrm = MeanRelease(1.0, 16, 1.0, 1.0, "add-remove")
    assert addrm.epsilon(2, delta) == pytest.approx(_pld_eps(16.0, 2, delta), rel=1e-3)
    assert full.epsilon(2, delta, "rdp") > full.epsilon(2, delta)  # the accountant is passed on
    for exact in (False, True):
        assert MeanRelease(1.0, 16, 1.0, 0.0).epsilon(2, delta, exact=exact) == math.inf


def test_tight_sigma_reaches_the_target_by_dp_accounting():
    sigma = tight_sigma(1.0, 1e-5, 2.0, 2, 10)
    z = sigma * 10 / 2.0  # noise multiplier of the sum (add/remove sensitivity B)
    eps = _pld_eps(z / 2.0, 2, 1e-5)  # replace-one: sensitivity 2B
    assert 0.99 <= eps <= 1.0 + 1e-9


def test_tight_sigma_calibrates_the_exact_events(monkeypatch):
    calls = []

    def fake(eps, delta, events, accountant="pld", relation="add-remove"):
        calls.append((eps, delta, events, accountant, relation))
        return 1.5

    monkeypatch.setattr(mtl_noise, "calibrate", fake)
    assert tight_sigma(0.7, 1e-4, 2.0, 3, 10, 0.5, "add-remove", "rdp") == pytest.approx(0.6, rel=1e-12)
    ((eps, delta, events, accountant, relation),) = calls
    assert (eps, delta, accountant, relation) == (0.7, 1e-4, "rdp", "add-remove")
    e = events(1.5)
    assert isinstance(e, dpa.SelfComposedDpEvent) and e.count == 3
    assert isinstance(e.event, dpa.PoissonSampledDpEvent) and e.event.sampling_probability == 0.5
    assert e.event.event.noise_multiplier == pytest.approx(1.5, rel=1e-12)
    assert events(0.8).event.event.noise_multiplier == pytest.approx(0.8, rel=1e-12)
    calls.clear()
    assert tight_sigma(1.0, 1e-5, 2.0, 1, 10) == pytest.approx(0.3, rel=1e-12)  # defaults
    ((eps, delta, events, accountant, relation),) = calls
    assert (accountant, relation) == ("pld", "replace-one")
    one = events(2.0)
    assert isinstance(one, dpa.GaussianDpEvent) and one.noise_multiplier == pytest.approx(2.0, rel=1e-12)
    calls.clear()
    tight_sigma(1.0, 1e-5, 2.0, 2, 10)
    two = calls[0][2](2.0)
    assert isinstance(two, dpa.SelfComposedDpEvent) and two.count == 2
    assert two.event.noise_multiplier == pytest.approx(2.0, rel=1e-12)


def test_plan_release_modes_errors_and_defaults(monkeypatch):
    with pytest.raises(ValueError) as bad:
        plan_release(1.0, 1e-5, 2.0, 3, 10, mode="loose")
    assert str(bad.value) == "calibration must be one of ('paper', 'tight'), got 'loose'"
    assert plan_release(math.inf, 1e-5, 2.0, 3, 10, 0.5, "add-remove", "paper") == MeanRelease(
        2.0, 10, 0.5, 0.0, "add-remove", "paper")
    msg = ("calibration 'paper' is Theorem 2: every task every round (fraction-train = 1) "
           "under replace-one")
    for kwargs in ({"sample_rate": 0.5}, {"relation": "add-remove"}):
        with pytest.raises(ValueError) as refused:
            plan_release(1.0, 1e-5, 2.0, 3, 10, mode="paper", **kwargs)
        assert str(refused.value) == msg
    paper = plan_release(2.0, E2, 3.0, 8, 4, mode="paper")
    assert (paper.radius, paper.num_tasks, paper.sample_rate, paper.relation, paper.mode) == (
        3.0, 4, 1.0, "replace-one", "paper")
    assert paper.sigma == pytest.approx(12.0, rel=1e-12)

    calls = []
    monkeypatch.setattr(mtl_noise, "tight_sigma", lambda *a: calls.append(a) or 0.37)
    assert plan_release(1.0, 1e-5, 2.0, 3, 10) == MeanRelease(2.0, 10, 1.0, 0.37, "replace-one", "tight")
    assert calls[-1] == (1.0, 1e-5, 2.0, 3, 10, 1.0, "replace-one", "pld")
    got = plan_release(0.5, 1e-6, 1.5, 4, 7, 0.25, "add-remove", "tight", "rdp")
    assert got == MeanRelease(1.5, 7, 0.25, 0.37, "add-remove", "tight")
    assert calls[-1] == (0.5, 1e-6, 1.5, 4, 7, 0.25, "add-remove", "rdp")


# =========================================================== DP-MTL: MeanServer
def test_mean_server_q1_returns_every_id_in_order_without_drawing():
    rng = np.random.default_rng(3)
    server = MeanServer(MeanRelease(2.0, 3, 1.0, 0.5), rng)
    ids = [5, 2, 9]
    out = server.sample(ids)
    assert out == [5, 2, 9] and out is not ids
    assert _fresh_draw_unchanged(rng, 3)


def test_mean_server_poisson_sampling_matches_the_seeded_draw_and_rate():
    server = MeanServer(MeanRelease(2.0, 40, 0.3, 0.5), np.random.default_rng(4))
    ids = list(range(100, 140))
    keep = np.random.default_rng(4).random(40) < 0.3
    assert server.sample(ids) == [k for k, kept in zip(ids, keep) if kept]
    n = 20000
    big = MeanServer(MeanRelease(2.0, n, 0.3, 0.5), np.random.default_rng(5))
    frac = len(big.sample(list(range(n)))) / n
    assert abs(frac - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)


def test_mean_server_noisy_mean_is_total_over_d_plus_sigma_noise():
    release = MeanRelease(3.0, 8, 0.25, 0.75)  # D = 2, z B = 1.5, sigma = 0.75
    server = MeanServer(release, np.random.default_rng(4))
    assert server.release is release and server.mechanism.secure is False
    assert server.mechanism.unit == "task"
    total = np.arange(5)  # ints: summed in float64
    got = server.noisy_mean(total)
    expected = total / 2.0 + 0.75 * np.random.default_rng(4).standard_normal(5)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    draws = MeanServer(release, np.random.default_rng(8)).noisy_mean(np.zeros(20000))
    assert draws.std() == pytest.approx(0.75, rel=5 / math.sqrt(2 * 20000))
    assert MeanServer(release, np.random.default_rng(4), secure=True).mechanism.secure is True


def test_mean_server_without_noise_returns_total_over_d_exactly_and_draws_nothing():
    rng = np.random.default_rng(6)
    server = MeanServer(MeanRelease(2.0, 4, 1.0, 0.0), rng)
    got = server.noisy_mean(np.array([1.0, 2.0, 3.0]))
    assert np.array_equal(got, np.array([0.25, 0.5, 0.75]))
    assert _fresh_draw_unchanged(rng, 6)


# =========================================================== DP-MTL: strategy
PAPER = dict(calibration="paper", target_epsilon=1.0, delta=1e-5, radius=1.0, rounds=2)
SIG = 8 * 1.0 * math.sqrt(2 * math.log(1e5)) / (1.0 * 4)  # Theorem 2's sigma for m = 4 tasks
Z = SIG * 4 / 1.0  # noise multiplier of the sum; the paper mode records Gaussian(Z / 2)


def _mtl(num_tasks=4, num_params=4, seed=5, **cfg):
    base = dict(radius=2.0, rounds=2, target_epsilon=math.inf)
    base.update(cfg)
    return DPMeanRegularizedMTL(num_tasks, num_params, MTLConfig(**base), noise_seed=seed)


def _models(instr: Message, models: dict[str, np.ndarray]) -> Message:
    rec = ArrayRecord({k: Array(np.asarray(v)) for k, v in models.items()})
    return Message(RecordDict({"models": rec, "metrics": MetricRecord({"tasks": len(models)})}), reply_to=instr)


def test_mtl_plan_private_paper_release_and_server():
    s = _mtl(**PAPER)
    r = s.release
    assert (r.radius, r.num_tasks, r.sample_rate, r.relation, r.mode) == (1.0, 4, 1.0, "replace-one", "paper")
    assert r.sigma == pytest.approx(SIG, rel=1e-12)
    assert s.num_tasks == 4 and s.server.release is r and s.server.rng is s._rng
    assert s.server.mechanism.noise_multiplier == pytest.approx(Z, rel=1e-12)


def test_mtl_plan_nonprivate_is_a_noiseless_tight_release():
    s = _mtl(calibration="paper")
    assert s.release == MeanRelease(2.0, 4, 1.0, 0.0, "replace-one", "tight")
    s = _mtl(fraction_train=0.5, neighbouring="add-remove")
    assert s.release == MeanRelease(2.0, 4, 0.5, 0.0, "add-remove", "tight")
    later = _mtl(num_tasks=0)
    assert later.release is None and later.server is None
    later._plan(6)
    assert later.num_tasks == 6 and later.release.num_tasks == 6 and later.server.release is later.release
    later._report = {"stale": 1.0}
    later._plan(6)
    assert later.calibration_report() == {}


def test_mtl_configure_train_charges_each_round_once_and_sends_ids_and_config():
    s = _mtl(**PAPER)
    s.node_tasks = {11: [0, 1], 12: [2, 3], 13: []}
    arrays = ArrayRecord({"mean": Array(np.arange(4.0))})
    config = ConfigRecord({"lr": 0.1})
    msgs = list(s.configure_train(1, arrays, config, None))
    eps1 = _pld_eps(Z / 4, 1, 1e-5)  # paper: Gaussian(Z / 2), replace-one: add/remove Gaussian(Z / 4)
    assert [(r["round"], r["scopes"], r["note"]) for r in s.ledger.rounds] == [(1, 1, "noisy mean")]
    assert s.ledger.rounds[0]["epsilon"] == pytest.approx(eps1, rel=1e-3)
    ((data, count),) = s.ledger.scopes[SERVER_SCOPE]
    assert count == 1 and ev.from_dict(data).noise_multiplier == pytest.approx(Z / 2, rel=1e-12)
    assert s._charged == {1}
    assert [m.metadata.dst_node_id for m in msgs] == [11, 12]
    for m, ids in zip(msgs, ([0, 1], [2, 3])):
        assert m.metadata.message_type == MessageType.TRAIN
        assert dict(m.content["config"]) == {"lr": 0.1, "round": 1, "tasks": ids}
        assert np.array_equal(m.content["mean"]["mean"].numpy(), np.arange(4.0))
    assert s._asked == {11: {0, 1}, 12: {2, 3}}
    again = list(s.configure_train(1, arrays, config, None))  # the same round: not charged twice
    assert len(again) == 2 and len(s.ledger.rounds) == 1 and s.ledger.scopes[SERVER_SCOPE][0][1] == 1
    list(s.configure_train(2, arrays, ConfigRecord(), None))
    assert [r["round"] for r in s.ledger.rounds] == [1, 2] and s.ledger.scopes[SERVER_SCOPE][0][1] == 2
    assert s.ledger.rounds[1]["epsilon"] == pytest.approx(_pld_eps(Z / 4, 2, 1e-5), rel=1e-3)
    assert s._charged == {1, 2}


def test_mtl_configure_train_config_clash_fails_before_the_charge():
    s = _mtl(**PAPER)
    s.node_tasks = {11: [0, 1, 2, 3]}
    arrays = ArrayRecord({"mean": Array(np.zeros(4))})
    with pytest.raises(ConfigError) as both:
        s.configure_train(1, arrays, ConfigRecord({"tasks": 1, "lr": 0.1, "round": 2}), None)
    assert str(both.value) == ("train_config / evaluate_config keys ['round', 'tasks'] are DP-MTL's own; "
                               "rename them")
    with pytest.raises(ConfigError, match=r"keys \['round'\] are"):
        s.configure_train(1, arrays, ConfigRecord({"round": 2}), None)
    with pytest.raises(ConfigError, match=r"keys \['tasks'\] are"):
        s.configure_train(1, arrays, ConfigRecord({"tasks": 2}), None)
    assert s.ledger.rounds == [] and s.ledger.scopes == {} and s._charged == set()


def test_mtl_configure_train_over_budget_raises_before_anything():
    s = _mtl(**PAPER)
    s.node_tasks = {11: [0, 1, 2, 3]}
    s.ledger.budget = 1e-3
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        s.configure_train(3, ArrayRecord({"mean": Array(np.zeros(4))}), ConfigRecord(), None)
    assert str(refused.value) == "round 3 would exceed epsilon 1.0"
    assert s.ledger.rounds == [] and s.ledger.scopes == {} and s._charged == set() and s._asked == {}


def test_mtl_configure_train_nonprivate_charges_nothing_and_samples_per_node():
    s = _mtl(fraction_train=0.5, seed=5)
    s.node_tasks = {11: list(range(6)), 12: [6, 7, 8], 13: [9], 14: []}
    msgs = list(s.configure_train(1, ArrayRecord({"mean": Array(np.zeros(4))}), ConfigRecord(), None))
    assert s.ledger.rounds == [] and s.ledger.scopes == {} and s._charged == set()
    rng = np.random.default_rng(5)
    expected = {}
    for node, ids in s.node_tasks.items():
        keep = rng.random(len(ids)) < 0.5
        chosen = [k for k, kept in zip(ids, keep) if kept]
        if chosen:
            expected[node] = chosen
    assert expected and {m.metadata.dst_node_id: list(m.content["config"]["tasks"]) for m in msgs} == expected
    assert [m.metadata.dst_node_id for m in msgs] == list(expected)
    assert s._asked == {n: set(ids) for n, ids in expected.items()}


def test_mtl_aggregate_train_drops_every_bad_model_and_sums_the_rest(caplog):
    s = _mtl()
    s.node_tasks = {11: [0, 1], 12: [2, 3]}
    instr = {m.metadata.dst_node_id: m for m in
             s.configure_train(1, ArrayRecord({"mean": Array(np.zeros(4))}), ConfigRecord(), None)}
    w0 = np.array([0.5, -1.0, 0.25, 1.0])
    w1 = np.array([-0.5, 0.5, 0.5, -0.5])
    w2 = np.array([0.1, 0.2, 0.3, 0.4])
    w3 = np.array([2.0 * (1 + 1e-6), 0.0, 0.0, 0.0])  # on the ball's slack: kept
    nan = np.array([0.0, np.nan, 0.0, 0.0])
    replies = [
        _error_reply(instr[11]),
        Message(RecordDict({"metrics": MetricRecord({"tasks": 1})}), reply_to=instr[12]),
        _models(instr[11], {"task.2": w2, "junk": w2, "task.0": w0, "task.1": nan}),
        _models(instr[12], {"task.2": np.zeros(3), "task.3": np.array([3.0, 4.0, 0.0, 0.0])}),
        _models(instr[12], {"task.3": w3, "task.2": w2}),
        _models(instr[11], {"task.0": w0}),
        _models(_instruction(99), {"task.1": w1, "task.3": w3}),  # a node never asked: any new task
    ]
    new, metrics = s.aggregate_train(1, replies)
    assert s.dropped == [
        "node 11: error reply: boom",
        "node 12: missing 'models' record",
        "node 11: model 'task.2' was not asked for (or sent twice)",
        "node 11: model 'junk' was not asked for (or sent twice)",
        "node 11: model 'task.1' has shape (4,) (expected (4,)) or non-finite values",
        "node 12: model 'task.2' has shape (3,) (expected (4,)) or non-finite values",
        "node 12: model 'task.3' has norm 5 > radius 2.0",
        "node 11: model 'task.0' was not asked for (or sent twice)",
        "node 99: model 'task.3' was not asked for (or sent twice)",
    ]
    assert _logged(caplog, logging.WARNING) == ["Dropped reply from " + d for d in s.dropped]
    total = np.zeros(4) + w0 + w3 + w2 + w1
    np.testing.assert_allclose(new["mean"].numpy(), total / 4.0, rtol=1e-15, atol=0)
    assert new["mean"].numpy().dtype == np.float64 and np.array_equal(s.mean, new["mean"].numpy())
    assert dict(metrics) == {"tasks": 4}
    assert s.history == [{"round": 1, "tasks": 4, "epsilon": math.inf}]


def test_mtl_aggregate_train_ball_slack_and_explicit_asked():
    s = _mtl()
    s._asked = {11: {0}}
    over = np.array([2.0 * (1 + 2e-6), 0.0, 0.0, 0.0])
    edge = np.array([0.0, -2.0 * (1 + 1e-6), 0.0, 0.0])
    inside = np.array([0.0, 0.0, 2.0 * (1 - 1e-6), 0.0])
    replies = [_models(_instruction(11), {"task.0": over, "task.1": edge, "task.2": inside})]
    new, metrics = s.aggregate_train(2, replies, asked={11: {0, 1, 2}})
    assert s.dropped == ["node 11: model 'task.0' has norm 2 > radius 2.0"]
    np.testing.assert_allclose(new["mean"].numpy(), (edge + inside) / 4.0, rtol=1e-15, atol=0)
    assert dict(metrics) == {"tasks": 2} and s.history[-1] == {"round": 2, "tasks": 2, "epsilon": math.inf}
    s2 = _mtl()
    s2._asked = {11: {0}}
    s2.aggregate_train(1, [_models(_instruction(11), {"task.1": edge})])  # the strategy's own _asked
    assert s2.dropped == ["node 11: model 'task.1' was not asked for (or sent twice)"]


def test_mtl_aggregate_train_private_mean_is_sum_over_d_plus_sigma_noise():
    s = _mtl(seed=9, **PAPER)
    s.node_tasks = {11: [0, 1, 2, 3]}
    (instr,) = s.configure_train(1, ArrayRecord({"mean": Array(np.zeros(4))}), ConfigRecord(), None)
    rng = np.random.default_rng(0)
    ws = [v / (2 * np.linalg.norm(v)) for v in rng.standard_normal((4, 4))]
    new, metrics = s.aggregate_train(1, [_models(instr, {f"task.{k}": ws[k] for k in range(4)})])
    expected = sum(ws) / 4.0 + SIG * np.random.default_rng(9).standard_normal(4)
    np.testing.assert_allclose(new["mean"].numpy(), expected, rtol=1e-9, atol=1e-12)
    assert dict(metrics) == {"tasks": 4}
    (row,) = s.history
    assert row["round"] == 1 and row["tasks"] == 4
    assert row["epsilon"] == pytest.approx(_pld_eps(Z / 4, 1, 1e-5), rel=1e-3)


# =========================================================== PrivAltMin strategy
SPEC = ProblemSpec(num_users=10, samples_per_user=6, dim=3, rank=2)


class _Grid:
    def __init__(self, ids):
        self.ids = ids

    def get_node_ids(self):
        return list(self.ids)


def _altmin(monkeypatch, seed=3, **cfg):
    monkeypatch.setattr(AltMinConfig, "noise_plan",
                        lambda self: NoisePlan(self.budget_split(), 2.0 if self.private else 0.0))
    base = dict(epochs=2, epoch_weights="linear", clip_a=3.0, clip_g=2.0, clip_decay=0.5, target_epsilon=2.0)
    base.update(cfg)
    return PrivAltMin(SPEC, AltMinConfig(**base), noise_seed=seed)


def _stats(instr: Message, arrays: dict[str, np.ndarray], metrics: dict | None = None) -> Message:
    content = RecordDict({"stats": ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})})
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)
    return Message(content, reply_to=instr)


def _recorded(ledger: PrivacyLedger, scope: str) -> list[tuple[float, int]]:
    return [(ev.from_dict(d).noise_multiplier, c) for d, c in ledger.scopes[scope]]


def test_altmin_round_releases_and_release_events(monkeypatch):
    s = _altmin(monkeypatch)
    zs = s.plan.multipliers()
    assert len(set(zs)) == 5
    assert s.round_releases(0) == (GaussianRelease(zs[0], 27.0, symmetric=True),)  # (6 // 2) * 3^2
    assert s.round_releases(1) == (GaussianRelease(zs[1], 3.0, symmetric=True), GaussianRelease(zs[2], 2.0))
    assert s.round_releases(2) == (GaussianRelease(zs[3], 3.0, symmetric=True), GaussianRelease(zs[4], 1.0))
    assert s.release_events() == [dpa.GaussianDpEvent(z) for z in zs]
    g = _altmin(monkeypatch, epochs=2, groups=2)
    gz = g.plan.multipliers()
    assert len(gz) == 3 and g.release_events() == [dpa.GaussianDpEvent(z) for z in gz]


def test_altmin_configure_train_charges_then_asks_every_node(monkeypatch):
    s = _altmin(monkeypatch)
    zs = s.plan.multipliers()
    grid = _Grid([4, 9])
    arrays = ArrayRecord([np.zeros((3, 2))])
    msgs = list(s.configure_train(0, arrays, ConfigRecord(), grid))
    assert _recorded(s.ledger, SERVER_SCOPE) == [(zs[0], 1)]
    assert [m.metadata.dst_node_id for m in msgs] == [4, 9]
    for m in msgs:
        assert m.metadata.message_type == "train.init"
        assert set(m.content.keys()) == {"config"} and dict(m.content["config"]) == {"epoch": 0}
    msgs = list(s.configure_train(1, arrays, ConfigRecord(), grid))
    assert _recorded(s.ledger, SERVER_SCOPE) == [(z, 1) for z in zs[:3]]
    for m in msgs:
        assert m.metadata.message_type == MessageType.TRAIN
        assert set(m.content.keys()) == {"config", "embedding"} and dict(m.content["config"]) == {"epoch": 1}
        assert np.array_equal(m.content["embedding"].to_numpy_ndarrays()[0], np.zeros((3, 2)))
    s.configure_train(2, arrays, ConfigRecord(), grid)
    assert _recorded(s.ledger, SERVER_SCOPE) == [(z, 1) for z in zs]


def test_altmin_configure_train_uses_the_events_it_already_has(monkeypatch):
    s = _altmin(monkeypatch)
    s._events = [dpa.GaussianDpEvent(float(i)) for i in range(1, 6)]
    s.configure_train(1, ArrayRecord([np.zeros((3, 2))]), ConfigRecord(), _Grid([1]))
    assert _recorded(s.ledger, SERVER_SCOPE) == [(2.0, 1), (3.0, 1)]
    quiet = _altmin(monkeypatch, target_epsilon=math.inf)
    msgs = list(quiet.configure_train(0, ArrayRecord([np.zeros((3, 2))]), ConfigRecord(), _Grid([1, 2])))
    assert quiet.ledger.scopes == {} and len(msgs) == 2 and quiet._events == []


def test_altmin_charge_full_batch_and_disjoint_groups(monkeypatch):
    events = [dpa.GaussianDpEvent(float(i)) for i in range(1, 6)]
    s = _altmin(monkeypatch, target_epsilon=math.inf)
    for rnd in range(3):
        s._charge(rnd, events)
    assert list(s.ledger.scopes) == [SERVER_SCOPE]
    assert _recorded(s.ledger, SERVER_SCOPE) == [(float(i), 1) for i in range(1, 6)]
    g = _altmin(monkeypatch, target_epsilon=math.inf, groups=2)
    g._charge(0, events)
    assert sorted(g.ledger.scopes) == ["group/0", "group/1"]
    assert _recorded(g.ledger, "group/0") == [(1.0, 1)] and _recorded(g.ledger, "group/1") == [(1.0, 1)]
    g._charge(1, events)  # init and one epoch's pair per group: events[1:3] only
    assert _recorded(g.ledger, "group/0") == [(1.0, 1), (2.0, 1), (3.0, 1)]
    assert _recorded(g.ledger, "group/1") == [(1.0, 1)]
    g._charge(2, events)
    assert _recorded(g.ledger, "group/1") == [(1.0, 1), (2.0, 1), (3.0, 1)]
    assert sorted(g.ledger.scopes) == ["group/0", "group/1"]


def test_altmin_aggregate_init_round_drops_bad_replies_and_releases_wigner_noise(monkeypatch, caplog):
    s = _altmin(monkeypatch, seed=7)
    zs = s.plan.multipliers()
    rng = np.random.default_rng(1)
    ms = [(lambda a: a + a.T)(rng.standard_normal((3, 3))) for _ in range(3)]
    bad = np.array(ms[0])
    bad[1, 1] = np.nan
    i4 = _instruction(4)
    replies = [
        _error_reply(i4, "oom"),
        _stats(i4, {"m": ms[0]}),  # no metrics
        Message(RecordDict({"metrics": MetricRecord({"num-users": 1})}), reply_to=i4),  # no stats
        _stats(i4, {"m": ms[0], "x": ms[0]}, {"num-users": 1}),
        _stats(i4, {"m": np.zeros((2, 2))}, {"num-users": 1}),
        _stats(i4, {"m": bad}, {"num-users": 1}),
        _stats(_instruction(5), {"m": ms[0]}, {"num-users": 3}),
        _stats(_instruction(6), {"m": ms[1]}, {"other": 1}),  # no count: 0 users, still valid
        _stats(_instruction(7), {"m": ms[2]}, {"num-users": 4}),
    ]
    arrays, metrics = s.aggregate_train(0, replies)
    assert s.dropped == [
        "node 4: error reply: oom",
        "node 4: missing 'stats' or 'metrics' record",
        "node 4: missing 'stats' or 'metrics' record",
        "node 4: arrays ['m', 'x'] != expected ['m']",
        "node 4: array 'm' has shape (2, 2) (expected (3, 3)) or non-finite values",
        "node 4: array 'm' has shape (3, 3) (expected (3, 3)) or non-finite values",
    ]
    assert _logged(caplog, logging.WARNING) == ["Dropped reply from " + d for d in s.dropped]
    assert dict(metrics) == {"num-users": 7, "valid-nodes": 3}
    total = np.zeros((3, 3)) + ms[0] + ms[1] + ms[2]
    draws = np.random.default_rng(7).normal(0.0, zs[0] * 27.0, size=(3, 3))
    upper = np.triu(draws)
    released = total + (upper + np.triu(upper, 1).T)
    vals, vecs = np.linalg.eigh(0.5 * (released + released.T))
    u = vecs[:, np.argsort(vals)[::-1][:2]]
    emb = s.embedding
    assert emb.shape == (3, 2)
    np.testing.assert_allclose(emb @ emb.T, u @ u.T, atol=1e-10)
    assert np.array_equal(arrays.to_numpy_ndarrays()[0], emb)


@pytest.mark.parametrize("rnd", [1, 2])
def test_altmin_aggregate_epoch_round_noises_a_and_gradient_then_steps(monkeypatch, rnd):
    s = _altmin(monkeypatch, seed=11)
    zs = s.plan.multipliers()
    u0 = np.linalg.qr(np.random.default_rng(2).standard_normal((3, 2)))[0]
    s.embedding = u0
    rng = np.random.default_rng(3)
    parts = []
    for _ in range(2):
        a = rng.standard_normal((6, 6))
        parts.append((a @ a.T, rng.standard_normal(6)))
    i4 = _instruction(4)
    replies = [_stats(i4, {"a": parts[0][0], "b": parts[0][1]}, {"num-users": 2}),
               _stats(i4, {"a": parts[0][0]}, {"num-users": 2}),
               _stats(i4, {"a": parts[1][0], "b": parts[1][1][:5]}, {"num-users": 2}),
               _stats(_instruction(5), {"a": parts[1][0], "b": parts[1][1]}, {"num-users": 5})]
    arrays, metrics = s.aggregate_train(rnd, replies)
    assert s.dropped == ["node 4: arrays ['a'] != expected ['a', 'b']",
                         "node 4: array 'b' has shape (5,) (expected (6,)) or non-finite values"]
    assert dict(metrics) == {"num-users": 7, "valid-nodes": 2}
    za, zb = zs[2 * rnd - 1], zs[2 * rnd]
    sb = 2.0 * 0.5 ** (rnd - 1)
    a = np.zeros((6, 6)) + parts[0][0] + parts[1][0]
    b = np.zeros(6) + parts[0][1] + parts[1][1]
    noise = np.random.default_rng(11)
    upper = np.triu(noise.normal(0.0, za * 3.0, size=(6, 6)))
    a_rel = a + (upper + np.triu(upper, 1).T)
    b_rel = b + noise.normal(0.0, zb * sb, size=6)
    expected = newton_update(u0, a_rel, b_rel, za * 3.0, 1.0)
    np.testing.assert_allclose(s.embedding, expected, rtol=1e-9, atol=1e-10)
    assert np.array_equal(arrays.to_numpy_ndarrays()[0], s.embedding)


# =========================================================== winsorized: estimator
def test_hadamard_matches_sylvester_matrices_and_leaves_its_input():
    rng = np.random.default_rng(0)
    for p in (1, 2, 4, 8):
        x = rng.standard_normal((3, p))
        keep = x.copy()
        np.testing.assert_allclose(hadamard(x), x @ _sylvester(p).T, atol=1e-12)
        assert np.array_equal(x, keep)
    out = hadamard(np.array([1, 2, 3, 4]))
    assert out.dtype == np.float64 and np.array_equal(out, np.array([10.0, -2.0, -4.0, 0.0]))
    for p in (3, 6, 12):
        with pytest.raises(ValueError) as bad:
            hadamard(np.zeros(p))
        assert str(bad.value) == f"length must be a power of two, got {p}"


def test_random_rotation_create_apply_invert_against_the_matrix():
    for dim, padded in ((1, 1), (2, 2), (5, 8), (8, 8), (9, 16)):
        rot = RandomRotation.create(dim, np.random.default_rng(4))
        assert rot.dim == dim and rot.padded == padded
        assert np.array_equal(rot.signs, np.random.default_rng(4).choice(np.array([-1.0, 1.0]), size=padded))
    rot = RandomRotation.create(5, np.random.default_rng(1))
    assert set(rot.signs) == {-1.0, 1.0}
    h = _sylvester(8)
    x = np.random.default_rng(2).standard_normal((3, 5))
    pad = np.zeros((3, 8))
    pad[:, :5] = x
    np.testing.assert_allclose(rot.apply(x), (pad * rot.signs) @ h.T / math.sqrt(8), atol=1e-12)
    assert rot.apply(x[0]).shape == (1, 8)
    y = np.random.default_rng(3).standard_normal((2, 8))
    np.testing.assert_allclose(rot.invert(y), (y @ h.T / math.sqrt(8) * rot.signs)[:, :5], atol=1e-12)
    assert rot.invert(y[0]).shape == (1, 5)


def test_rotated_radius_values():
    assert rotated_radius(0.3, 100, 64, 0.01) == pytest.approx(0.1988728674642595, rel=1e-12)
    assert rotated_radius(1.0, 1, 2, 2.0) == pytest.approx(0.8325546111576977, rel=1e-12)  # sqrt(log 2)
    assert rotated_radius(0.5, 10, 4, 0.01) == 0.5  # the formula exceeds tau
    assert rotated_radius(1.0, 1, 1, 10.0) == 1.0  # no rotation: tau (the formula would fail)
    assert rotated_radius(0.7, 5, 0, 0.01) == 0.7


def test_winsorized_mean_validation_and_defaults():
    w = WinsorizedMean(1.0, 0.1, 2.0, 3.0)
    assert (w.kind, w.rotate, w.beta, w.secure) == ("gaussian", True, 0.01, False)
    WinsorizedMean(1.0, 0.1, 2.0, 3.0, kind="laplace")
    with pytest.raises(ValueError) as bad:
        WinsorizedMean(1.0, 0.1, 2.0, 3.0, kind="cauchy")
    assert str(bad.value) == "kind must be 'gaussian' or 'laplace', got 'cauchy'"
    good = dict(bound=1.0, tau=0.1, range_noise=2.0, mean_noise=3.0)
    for name in good:
        for value in (0.0, -1.0):
            with pytest.raises(ValueError) as bad:
                WinsorizedMean(**{**good, name: value})
            assert str(bad.value) == f"{name} must be > 0, got {value}"


def test_winsorized_mechanisms_sensitivities_and_events():
    g = WinsorizedMean(1.0, 0.1, 2.0, 3.0)
    r = g.range_mechanism(8)
    assert type(r) is GaussianSumMechanism
    assert (r.noise_multiplier, r.sensitivity, r.denominator, r.secure, r.unit) == (2.0, 4.0, 1.0, False, "user")
    m = g.mean_mechanism(0.5, 4, 10)
    assert type(m) is GaussianSumMechanism
    assert (m.noise_multiplier, m.sensitivity, m.denominator, m.unit) == (3.0, 2.0, 10.0, "user")
    lap = WinsorizedMean(1.0, 0.1, 2.0, 3.0, kind="laplace", secure=True)
    r = lap.range_mechanism(8)
    assert type(r) is LaplaceSumMechanism
    assert (r.noise_multiplier, r.sensitivity, r.denominator, r.secure, r.unit) == (2.0, 16.0, 1.0, True, "user")
    m = lap.mean_mechanism(0.5, 4, 10)
    assert type(m) is LaplaceSumMechanism and (m.sensitivity, m.denominator, m.secure) == (4.0, 10.0, True)
    safe = WinsorizedMean(1.0, 0.1, 2.0, 3.0, secure=True)
    assert safe.range_mechanism(2).secure is True and safe.mean_mechanism(0.5, 1, 2).secure is True
    assert g.events() == [dpa.GaussianDpEvent(2.0), dpa.GaussianDpEvent(3.0)]
    assert g.event() == dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0), dpa.GaussianDpEvent(3.0)])
    assert lap.events() == [dpa.LaplaceDpEvent(2.0), dpa.LaplaceDpEvent(3.0)]
    assert lap.event() == dpa.ComposedDpEvent([dpa.LaplaceDpEvent(2.0), dpa.LaplaceDpEvent(3.0)])


def test_histogram_bins_edges_and_fallback():
    x = np.array([[-1.0, 0.0], [0.1, 1.0], [5.0, -0.3], [0.99, -2.0]])
    edges, counts = histogram(x, 1.0, 0.5)
    assert np.array_equal(edges, np.array([-1.0, -0.5, 0.0, 0.5, 1.0]))
    assert np.array_equal(counts, np.array([[1.0, 0.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]]))
    edges, counts = histogram(np.array([0.2, -0.7, 0.3]), 1.0, 0.5)
    assert counts.shape == (1, 4) and np.array_equal(counts, np.array([[1.0, 0.0, 2.0, 0.0]]))
    edges, counts = histogram(np.array([0.9, -0.9]), 1.0, 3.0)  # one bin wider than the range
    assert np.array_equal(edges, np.array([-1.0, 2.0])) and np.array_equal(counts, np.array([[2.0]]))


def test_clipped_sum_and_average_per_coordinate():
    x = np.array([[0.0, 5.0], [2.0, -5.0], [0.4, 0.3]])
    centre = np.array([0.5, 0.0])
    assert np.allclose(clipped_sum(x, centre, 1.0), [0.0 + 1.5 + 0.4, 1.0 - 1.0 + 0.3], rtol=0, atol=1e-15)
    assert np.allclose(clipped_average(x, centre, 1.0), [1.9 / 3, 0.3 / 3], rtol=0, atol=1e-15)
    assert np.allclose(clipped_sum(np.array([3.0, -3.0, 0.2]), np.array([0.0]), 0.5), [0.2], atol=1e-15)


def test_clipped_gaussian_mean_exact_stream_and_small_norm_rows_untouched():
    x = np.array([[3.0, 4.0], [0.03, 0.04], [0.0, 0.0]])  # norms 5, 0.05, 0
    got = clipped_gaussian_mean(x, 0.5, 1.3, np.random.default_rng(2))
    clipped = np.array([[0.3, 0.4], [0.03, 0.04], [0.0, 0.0]])
    expected = (clipped.sum(axis=0) + np.random.default_rng(2).normal(0.0, 1.3 * 2 * 0.5, 2)) / 3
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    scalar = clipped_gaussian_mean(np.array([2.0, -0.2]), 0.5, 0.0, np.random.default_rng(0))
    assert np.ndim(scalar) == 0 and scalar == pytest.approx((0.5 - 0.2) / 2, rel=1e-12)


def _expected_estimate(x, bound, tau, zr, zm, rng, kind="gaussian"):
    """The estimator's two releases on (already rotated) ``x`` (n, d), computed by hand."""
    n, d = x.shape
    edges = -bound + tau * np.arange(int(round(2 * bound / tau)) + 1)
    idx = np.clip(np.floor((np.clip(x, -bound, bound) + bound) / tau).astype(int), 0, len(edges) - 2)
    counts = np.zeros((d, len(edges) - 1))
    for j in range(d):
        for i in range(n):
            counts[j, idx[i, j]] += 1
    if kind == "gaussian":
        noisy = counts + rng.normal(0.0, zr * math.sqrt(2 * d), counts.shape)
    else:
        noisy = counts + rng.laplace(0.0, zr * 2 * d, counts.shape)
    best = noisy.argmax(axis=1)
    centre = edges[best] + tau / 2
    r = 2.5 * tau
    total = np.clip(x, centre - r, centre + r).sum(axis=0)
    if kind == "gaussian":
        return (total + rng.normal(0.0, zm * 2 * r * math.sqrt(d), d)) / n
    return (total + rng.laplace(0.0, zm * 2 * r * d, d)) / n


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
def test_winsorized_estimate_without_rotation_is_the_two_releases(kind):
    x = np.random.default_rng(0).uniform(-0.6, 0.6, size=(30, 64))
    zr = 0.2 if kind == "gaussian" else 0.02
    est = WinsorizedMean(bound=1.0, tau=0.25, range_noise=zr, mean_noise=0.7, kind=kind, rotate=False)
    got = est.estimate(x, np.random.default_rng(7))
    expected = _expected_estimate(x, 1.0, 0.25, zr, 0.7, np.random.default_rng(7), kind)
    assert got.shape == (64,)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


def test_winsorized_scalar_estimate_is_a_scalar_and_never_rotated():
    x = np.random.default_rng(1).uniform(-0.5, 0.7, size=40)
    est = WinsorizedMean(bound=1.0, tau=0.25, range_noise=0.3, mean_noise=0.9)
    got = est.estimate(x, np.random.default_rng(5))
    expected = _expected_estimate(x[:, None], 1.0, 0.25, 0.3, 0.9, np.random.default_rng(5))
    assert np.ndim(got) == 0
    assert got == pytest.approx(expected[0], rel=1e-12)
    one = est.estimate(np.array([0.3]), np.random.default_rng(5))  # a single user
    assert one == pytest.approx(_expected_estimate(np.array([[0.3]]), 1.0, 0.25, 0.3, 0.9,
                                                   np.random.default_rng(5))[0], rel=1e-12)


@pytest.mark.parametrize("dim,padded", [(2, 2), (100, 128)])
def test_winsorized_vector_estimate_rotates_with_the_rotated_radius(dim, padded):
    n, tau = 30, 0.3
    x = np.random.default_rng(2).uniform(-0.05, 0.05, size=(n, dim)) + 0.01
    est = WinsorizedMean(bound=1.0, tau=tau, range_noise=0.5, mean_noise=0.8)
    got = est.estimate(x, np.random.default_rng(9))
    rng = np.random.default_rng(9)
    signs = rng.choice(np.array([-1.0, 1.0]), size=padded)
    h = _sylvester(padded)
    pad = np.zeros((n, padded))
    pad[:, :dim] = x
    rotated = (pad * signs) @ h.T / math.sqrt(padded)
    tau_inf = min(tau, tau * math.sqrt(2 * math.log(2 * n * padded / 0.01) / padded))
    if padded == 128:
        assert tau_inf < 0.5 * tau
    edges = np.arange(-1.0, 1.0 + tau_inf, tau_inf)
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, np.clip(rotated, -1, 1), side="right") - 1, 0, bins - 1)
    counts = np.zeros((padded, bins))
    for j in range(padded):
        np.add.at(counts[j], idx[:, j], 1.0)
    noisy = counts + rng.normal(0.0, 0.5 * math.sqrt(2 * padded), counts.shape)
    best = noisy.argmax(axis=1)
    centre = 0.5 * (edges[best] + edges[best + 1])
    r = 2.5 * tau_inf
    total = np.clip(rotated, centre - r, centre + r).sum(axis=0)
    mean = (total + rng.normal(0.0, 0.8 * 2 * r * math.sqrt(padded), padded)) / n
    expected = (mean @ h.T / math.sqrt(padded) * signs)[:dim]
    assert got.shape == (dim,)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


# =========================================================== winsorized: strategy
class _Inner:
    def __init__(self, messages):
        self.messages = messages
        self.configured = None
        self.aggregated = None

    def configure_train(self, server_round, arrays, config, grid):
        self.configured = (server_round, arrays, config, grid)
        return iter(self.messages)

    def aggregate_train(self, server_round, replies):
        self.aggregated = (server_round, list(replies))
        return None, MetricRecord({"inner": 1})

    def summary(self):
        pass


class _Estimator:
    tau = 0.1

    def __init__(self, out):
        self.out = out
        self.calls = []

    def event(self):
        return dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0), dpa.GaussianDpEvent(1.5)])

    def estimate(self, values, rng):
        self.calls.append((np.array(values), rng))
        return self.out


def test_winsorized_configure_train_charges_both_releases_and_saves(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, unit="user")
    path = tmp_path / "ledger.json"
    msgs = [_instruction(1), _instruction(2)]
    inner = _Inner(msgs)
    est = WinsorizedMean(1.0, 0.1, 5.0, 4.0)
    w = DifferentialPrivacyWinsorizedMean(inner, est, 2, ledger=ledger, ledger_path=path, noise_seed=0)
    arrays, config, grid = ArrayRecord({"w": Array(np.zeros(2))}), ConfigRecord({"lr": 1.0}), object()
    out = w.configure_train(2, arrays, config, grid)
    assert out == msgs and isinstance(out, list)
    assert inner.configured == (2, arrays, config, grid) and w.current_arrays is arrays
    assert [(r["round"], r["scopes"], r["note"]) for r in ledger.rounds] == [
        (2, 1, "winsorized mean (range + mean)")]
    composed = dpa.ComposedDpEvent([dpa.GaussianDpEvent(5.0), dpa.GaussianDpEvent(4.0)])
    assert ledger.scopes == {SERVER_SCOPE: [[ev.to_dict(composed), 1]]}
    assert [r["round"] for r in json.loads(path.read_text())["rounds"]] == [2]


def test_winsorized_configure_train_without_messages_or_ledger_charges_nothing(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, unit="user")
    path = tmp_path / "ledger.json"
    w = DifferentialPrivacyWinsorizedMean(_Inner([]), WinsorizedMean(1.0, 0.1, 2.0, 1.5), 2,
                                          ledger=ledger, ledger_path=path)
    assert w.configure_train(1, ArrayRecord(), ConfigRecord(), None) == []
    assert ledger.rounds == [] and ledger.scopes == {} and not path.exists()
    msgs = [_instruction(1)]
    free = DifferentialPrivacyWinsorizedMean(_Inner(msgs), WinsorizedMean(1.0, 0.1, 2.0, 1.5), 1)
    assert free.configure_train(1, ArrayRecord(), ConfigRecord(), None) == msgs
    kept = DifferentialPrivacyWinsorizedMean(_Inner(msgs), WinsorizedMean(1.0, 0.1, 2.0, 1.5), 1,
                                             ledger=PrivacyLedger(delta=1e-5, unit="user"))
    kept.configure_train(1, ArrayRecord(), ConfigRecord(), None)
    assert [r["round"] for r in kept.ledger.rounds] == [1]


def test_winsorized_configure_train_over_budget_is_refused_before_the_charge(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, unit="user", budget=0.5)
    path = tmp_path / "ledger.json"
    est = WinsorizedMean(1.0, 0.1, 5.0, 5.0)
    w = DifferentialPrivacyWinsorizedMean(_Inner([_instruction(1)]), est, 1, ledger=ledger, ledger_path=path)
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        w.configure_train(1, ArrayRecord(), ConfigRecord(), None)
    assert str(refused.value) == "round 1 would exceed epsilon 0.5 (spent 0.0000 at delta 1e-05)"
    assert ledger.rounds == [] and not path.exists()
    ledger.budget = None
    w.configure_train(1, ArrayRecord(), ConfigRecord(), None)
    spent = ledger.epsilon()
    ledger.budget = 1.2 * spent
    with pytest.raises(PrivacyBudgetExhausted) as refused:
        w.configure_train(2, ArrayRecord(), ConfigRecord(), None)
    assert str(refused.value) == f"round 2 would exceed epsilon {1.2 * spent} (spent {spent:.4f} at delta 1e-05)"
    assert [r["round"] for r in ledger.rounds] == [1]
    assert [r["round"] for r in json.loads(path.read_text())["rounds"]] == [1]


def _winsorized_reply(instr, arrays):
    return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=instr)


def test_winsorized_aggregate_train_drops_bad_replies_and_adds_the_private_mean(caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    rng = np.random.default_rng(0)
    cur = {"w": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(4),
           "c": rng.standard_normal(1).astype(np.float32)}
    current = ArrayRecord({k: Array(v) for k, v in cur.items()})
    ups = [{k: (v + rng.standard_normal(v.shape)).astype(v.dtype) for k, v in cur.items()} for _ in range(2)]
    mean = np.arange(11) * 0.125 - 0.5
    est = _Estimator(mean)
    inner = _Inner([_instruction(7)])
    w = DifferentialPrivacyWinsorizedMean(inner, est, 2, noise_seed=0)
    w.configure_train(3, current, ConfigRecord(), None)
    i7 = _instruction(7)
    two = RecordDict({"a": ArrayRecord({k: Array(v) for k, v in cur.items()}),
                      "b": ArrayRecord({k: Array(v) for k, v in cur.items()})})
    valid = [_winsorized_reply(_instruction(8), ups[0]), _winsorized_reply(_instruction(9), ups[1])]
    replies = [
        _error_reply(i7, "gone"),
        Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=i7),
        Message(two, reply_to=i7),
        _winsorized_reply(i7, {"b": cur["b"], "w": cur["w"], "c": cur["c"]}),
        _winsorized_reply(i7, {"w": cur["w"].reshape(3, 2), "b": cur["b"], "c": cur["c"]}),
        _winsorized_reply(i7, {"w": cur["w"], "b": np.array([0.0, np.inf, 0.0, 0.0]), "c": cur["c"]}),
        valid[0],
        _winsorized_reply(i7, {"w": cur["w"], "b": cur["b"]}),
        valid[1],
    ]
    new, metrics = w.aggregate_train(3, replies)
    assert w.dropped == [
        "node 7: error reply: gone",
        "node 7: expected one ArrayRecord, got 0",
        "node 7: expected one ArrayRecord, got 2",
        "node 7: array names differ from the broadcast model",
        "node 7: array 'w' has shape (3, 2) (expected (2, 3)) or non-finite values",
        "node 7: array 'b' has shape (4,) (expected (4,)) or non-finite values",
        "node 7: array names differ from the broadcast model",
    ]
    assert _logged(caplog, logging.WARNING) == ["Dropped reply from " + d for d in w.dropped]
    assert _logged(caplog, logging.INFO) == ["aggregate_train: winsorized private mean of 2 updates (tau 0.1)"]
    assert w._valid == 2
    ((values, used_rng),) = est.calls
    assert used_rng is w.rng
    expected_stack = np.stack([np.concatenate([(u[k].astype(np.float64) - cur[k].astype(np.float64)).ravel()
                                               for k in ("w", "b", "c")]) for u in ups])
    np.testing.assert_allclose(values, expected_stack, rtol=0, atol=1e-15)
    assert list(new.keys()) == ["w", "b", "c"]
    for key, part in (("w", slice(0, 6)), ("b", slice(6, 10)), ("c", slice(10, 11))):
        got = new[key].numpy()
        assert got.dtype == cur[key].dtype and got.shape == cur[key].shape
        want = (cur[key].astype(np.float64) + mean[part].reshape(cur[key].shape)).astype(cur[key].dtype)
        assert np.array_equal(got, want)
    assert inner.aggregated[0] == 3 and [id(r) for r in inner.aggregated[1]] == [id(r) for r in valid]
    assert dict(metrics) == {"inner": 1}


def test_winsorized_aggregate_train_skips_a_round_with_other_than_n_valid_updates(caplog):
    cur = {"w": np.zeros(3)}
    current = ArrayRecord({k: Array(v) for k, v in cur.items()})
    replies = [_winsorized_reply(_instruction(n), {"w": np.full(3, float(n))}) for n in (1, 2)]
    for expected_n in (3, 1):
        est, inner = _Estimator(np.zeros(3)), _Inner([_instruction(1)])
        w = DifferentialPrivacyWinsorizedMean(inner, est, expected_n, noise_seed=0)
        w.configure_train(1, current, ConfigRecord(), None)
        caplog.clear()
        assert w.aggregate_train(1, replies) == (None, None)
        assert w._valid == 2 and est.calls == [] and inner.aggregated is None
        assert _logged(caplog, logging.WARNING) == [
            f"Round 1: 2 valid updates, {expected_n} expected (n is public): round skipped"]
    est = _Estimator(np.array([0.5, -0.5, 0.25]))
    w = DifferentialPrivacyWinsorizedMean(_Inner([]), est, 2, noise_seed=0)
    w.configure_train(1, current, ConfigRecord(), None)
    new, _ = w.aggregate_train(1, iter(replies))
    assert np.array_equal(new["w"].numpy(), np.array([0.5, -0.5, 0.25]))
    assert np.array_equal(est.calls[0][0], np.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]))


def test_altmin_release_details_a_survivor_check_found():
    with pytest.raises(ValueError, match=r"^noise multiplier must be >= 0$"):
        GaussianRelease(-1.0, 1.0)
    with pytest.raises(ValueError, match=r"^sensitivity must be a positive finite number$"):
        GaussianRelease(1.0, 0.0)
    out = GaussianRelease(0.0, 1.0).release(np.arange(3), np.random.default_rng(0))
    assert out.dtype == np.float64 and out.tolist() == [0.0, 1.0, 2.0]
    noisy = GaussianRelease(1.0, 2.0).release(np.zeros(20000), np.random.default_rng(1))  # z = 1 is noised
    assert noisy.std() == pytest.approx(2.0, rel=0.03)


def test_winsorized_mean_of_no_users_says_so():
    from flwr_jdp.winsorized.estimator import WinsorizedMean

    est = WinsorizedMean(bound=1.0, tau=0.5, range_noise=1.0, mean_noise=1.0)
    for empty in (np.zeros(0), np.zeros((0, 3))):
        with pytest.raises(ValueError, match=r"^no users$"):
            est.estimate(empty, np.random.default_rng(0))
