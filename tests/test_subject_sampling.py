"""Subject sampling for HiGradAvgDP (``sampling = subjects``): the sampler, its
accounting (every present subject amplified by the silo's subject rate, whatever
its record count), the plan's rates, config errors, and a real run whose owners
sample at the rates the ledger records (issue 4, beyond the paper)."""

from __future__ import annotations

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from torch import nn

from flwr_jdp.config_check import ConfigError
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.horizontal import HorizontalAccountant, SiloRelease
from flwr_jdp.subject.config import SubjectDPConfig, parse_subject_config
from flwr_jdp.subject.plan import accounting_counts, make_plan, silo_rates
from flwr_jdp.training import subject_level
from flwr_jdp.training.subject_level import SiloData, SiloPlan, poisson_subjects, train_silo_round


def _subjects(counts: list[int]) -> torch.Tensor:
    """Records of subject ``a`` repeated ``counts[a]`` times, shuffled."""
    s = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return s[torch.randperm(len(s), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("per_subject", [0, 1, 2, 3])
def test_sampled_subjects_bring_the_right_records(per_subject: int) -> None:
    counts = [1, 2, 5, 9, 3, 7]
    subjects = _subjects(counts)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        rec = poisson_subjects(subjects, 0.5, per_subject, gen)
        got = torch.bincount(subjects[rec], minlength=len(counts))
        for a, k in enumerate(counts):
            if got[a]:  # a sampled subject brings min(k, per_subject) records, or all of them
                assert int(got[a]) == (k if per_subject == 0 else min(k, per_subject))
        assert len(torch.unique(rec)) == len(rec)


def test_every_subject_is_sampled_at_the_rate_whatever_its_count() -> None:
    """Empirical inclusion frequency is q for a subject with 1 record and for one
    with 40 (record sampling would include the latter at 1 - (1-q)^40)."""
    counts = [1, 40, 3]
    subjects = _subjects(counts)
    gen = torch.Generator().manual_seed(2)
    q, trials = 0.3, 4000
    hits = np.zeros(len(counts))
    for _ in range(trials):
        rec = poisson_subjects(subjects, q, 1, gen)
        hits[torch.unique(subjects[rec]).numpy()] += 1
    assert np.abs(hits / trials - q).max() < 0.03  # about 4 standard errors
    # the record drawn for the heavy subject is uniform over its 40 records
    heavy = torch.nonzero(subjects == 1).flatten()
    drawn = torch.cat([poisson_subjects(subjects, 1.0, 1, gen) for _ in range(2000)])
    freq = torch.bincount(drawn, minlength=len(subjects))[heavy].float() / 2000
    assert abs(float(freq.sum()) - 1.0) < 1e-6  # exactly one of its records each time
    assert 0.01 < float(freq.min()) and float(freq.max()) < 0.045  # each near 1/40 (sd 0.0035)


def test_subject_sampling_event_is_the_poisson_gaussian_at_the_subject_rate() -> None:
    rel = SiloRelease(0.2, 3.0, 4, sampling="subjects")
    want = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(3.0)), 4 * 5)
    for k in (1, 2, 50):
        assert rel.subject_event(k, 5) == want
        assert rel.inclusion_rate(k) == 0.2
    assert rel.subject_event(0, 5) == dpa.NoOpDpEvent()
    # record sampling at the same rate amplifies a heavy subject less
    assert SiloRelease(0.2, 3.0, 4).inclusion_rate(5) == pytest.approx(1 - 0.8 ** 5)


def test_horizontal_epsilon_under_subject_sampling_is_the_composition() -> None:
    """Hand-built map: the exact epsilon is dp-accounting's composition of the
    silos holding the worst subject, and depends on presence, not counts."""
    counts = np.array([[1, 0, 30], [5, 5, 0], [0, 1, 1]])
    rel = [SiloRelease(q, 2.0, 3, sampling="subjects") for q in (0.1, 0.3, 0.2)]
    acc = HorizontalAccountant(counts, 1e-5)
    per_subject = [epsilon(dpa.ComposedDpEvent([r.subject_event(int(k), 4) for k, r in zip(row, rel)
                                                if k > 0]), 1e-5) for row in counts]
    assert acc.epsilon(rel, 4) == pytest.approx(max(per_subject), rel=1e-9)
    ones = HorizontalAccountant((counts > 0).astype(int), 1e-5)
    assert ones.epsilon(rel, 4) == pytest.approx(acc.epsilon(rel, 4), rel=1e-9)


def test_plan_samples_subjects_and_needs_less_noise_for_heavy_subjects() -> None:
    """Rates are batch-size / subjects at each silo; with one heavy subject per
    silo, record sampling includes it at nearly every step and needs more noise than
    subject sampling at the same expected number of subjects per batch."""
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 4, size=(60, 3))
    counts[0] = 200  # one subject with many records at every silo
    base = dict(method="higradavg-dp", accounting="exact", budget_rounds=5, local_steps=2, target_epsilon=4.0,
                max_records_per_subject=0)  # reported counts
    subj = SubjectDPConfig(**base, sampling="subjects", batch_size=20)
    assert silo_rates(subj, counts) == pytest.approx([20 / 60] * 3)
    rec = SubjectDPConfig(**base, batch_size=int(20 / 60 * counts.sum(axis=0).mean()))
    p_subj, p_rec = make_plan(subj, counts), make_plan(rec, counts)
    assert p_subj.epsilon <= 4.0 + 1e-6 and p_rec.epsilon <= 4.0 + 1e-6
    assert p_subj.noise_multiplier < 0.8 * p_rec.noise_multiplier


def test_subject_sampling_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="sampling"):
        parse_subject_config({"method": "local-item-dp", "sampling": "subjects"})
    with pytest.raises(ConfigError, match="sampling"):
        parse_subject_config({"sampling": "users"})
    with pytest.raises(ConfigError, match="inclusion"):
        parse_subject_config({"sampling": "subjects", "inclusion": "record", "accounting": "sqrt-rounds"})
    with pytest.raises(ConfigError, match="records-per-subject"):
        parse_subject_config({"sampling": "subjects", "records-per-subject": -1})
    with pytest.raises(ValueError, match="higradavg-dp"):
        SiloPlan("local-item-dp", 0.5, 1, 0.1, sampling="subjects")


def test_silo_round_divides_by_the_expected_number_of_subjects() -> None:
    """Zero data signal, lr 1: the update's noise std is z C / (q u), u = subjects here."""
    subjects = np.repeat(np.arange(10), 7)  # 10 subjects, 70 records
    data = SiloData.from_numpy(np.zeros((70, 4)), np.zeros(70, dtype=int), subjects)
    model = nn.Linear(4, 4000, bias=False)
    nn.init.zeros_(model.weight)
    plan = SiloPlan("higradavg-dp", 0.5, 1, 1.0, 0.5, 3.0, sampling="subjects")
    train_silo_round(model, data, plan, torch.Generator().manual_seed(0))
    assert float(model.weight.std()) == pytest.approx(3.0 * 0.5 / (0.5 * 10), rel=0.05)


def test_run_samples_subjects_at_the_rates_the_ledger_records(tmp_path, femnist_dir, monkeypatch) -> None:
    """Real ServerApp strategy and ClientApp on an in-process grid: every silo step
    samples subjects at the plan's rate for that silo (batch-size / its subjects),
    and the ledger charges PoissonSampled events at exactly those rates."""
    from apps.subject_dp.subject_dp.client_app import client
    from apps.subject_dp.subject_dp.server_app import test_evaluator
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.models.leaf_cnn import build_leaf_cnn
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg

    seen: list[tuple[float, int]] = []
    real = subject_level.poisson_subjects

    def spy(subjects, rate, per_subject, generator):  # noqa: ANN001, ANN202
        seen.append((float(rate), int(torch.unique(subjects).numel())))
        return real(subjects, rate, per_subject, generator)

    monkeypatch.setattr(subject_level, "poisson_subjects", spy)
    rc = {"data-dir": str(femnist_dir), "max-writers": 20, "num-silos": 4, "budget-rounds": 2,
          "method": "higradavg-dp", "accounting": "exact", "sampling": "subjects", "noise-seed": 0,
          "results-dir": str(tmp_path / "run"), "batch-size": 8, "eval-every": 2,
          "max-records-per-subject": 0}  # reported counts: rates batch-size / subjects
    cfg = parse_subject_config(rc)
    strategy = SubjectLevelFedAvg(cfg, build_leaf_cnn(seed=0), test_evaluator(cfg), rc)
    strategy.start(InProcessGrid(client, 2, rc))
    out = strategy.results()
    assert out["status"] == "completed" and not out["dropped"]
    rates = out["plan"]["sample_rates"]
    assert len(seen) == 4 * cfg.local_steps * 2
    assert {round(r, 12) for r, _ in seen} == {round(r, 12) for r in rates}
    assert all(r == pytest.approx(min(1.0, 8 / u)) for r, u in seen)
    assert out["ledger_epsilon"] <= 4.0 * (1 + 1e-6)
    assert out["ledger_epsilon"] == pytest.approx(out["plan"]["epsilon"], rel=1e-6)
    events = strategy.round_events()
    assert events  # one scope per Pareto-maximal subject
    for ev in events.values():
        steps = ev.events if isinstance(ev, dpa.ComposedDpEvent) else [ev]
        for step in steps:
            assert isinstance(step, dpa.SelfComposedDpEvent) and step.count == cfg.local_steps
            assert isinstance(step.event, dpa.PoissonSampledDpEvent)
            assert any(step.event.sampling_probability == pytest.approx(r) for r in rates)


def test_accounting_reduces_counts_to_presence_only_under_subject_sampling() -> None:
    counts = np.array([[0, 3, 1], [7, 0, 2]])
    subj = SubjectDPConfig(sampling="subjects")
    assert (accounting_counts(subj, counts) == (counts > 0)).all()
    assert accounting_counts(SubjectDPConfig(), counts) is counts
