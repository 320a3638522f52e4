"""Subject-level mechanisms: HiGradAvgDP sensitivity, LocalGroupDP's group size and
noise, silo assignment, and every method's local round (issue 4)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn

from flwr_jdp.config_check import ConfigError
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.group_privacy import (
    group_noise_multiplier,
    group_to_record_budget,
    noise_per_subject_sensitivity,
    record_to_group_budget,
)
from flwr_jdp.subject.silos import assign_records, subject_silo_counts
from flwr_jdp.training.dp_sgd import clipped_unit_sum
from flwr_jdp.training.subject_level import (
    METHODS,
    BatchStats,
    SiloData,
    SiloPlan,
    cap_per_subject,
    group_size,
    record_batch,
    subject_batch,
    train_silo_round,
)


def _batch_sum(model: nn.Module, x, y, records, subjects, c: float) -> torch.Tensor:
    gsm = GradSampleModule(model, loss_reduction="sum")
    params = list(gsm.parameters())
    for p in params:
        p.grad, p.grad_sample = None, None
    F.cross_entropy(gsm(x[records]), y[records], reduction="sum").backward()
    sums = clipped_unit_sum(params, subject_batch(records, subjects), c)
    gsm._close()  # noqa: SLF001
    return torch.cat([s.flatten() for s in sums])


@pytest.mark.parametrize("seed", range(6))
def test_higradavg_subject_contribution_is_at_most_c(seed: int) -> None:
    """Removing all of one subject's records from any batch moves the clipped
    per-subject-averaged sum by at most C (property test over random batches)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    n = int(rng.integers(5, 40))
    x = torch.randn(n, 5) * float(rng.uniform(0.5, 20))
    y = torch.from_numpy(rng.integers(0, 3, n))
    subjects = torch.from_numpy(rng.integers(0, int(rng.integers(1, 6)), n))
    c = float(rng.uniform(0.01, 2.0))
    records = torch.arange(n)
    full = _batch_sum(model, x, y, records, subjects, c)
    for a in torch.unique(subjects):
        keep = records[subjects != a]
        without = _batch_sum(model, x, y, keep, subjects, c) if len(keep) else torch.zeros_like(full)
        assert float(torch.linalg.norm(full - without)) <= c * (1 + 1e-5)


def test_group_size_is_the_true_maximum() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        subjects = torch.from_numpy(rng.integers(0, 8, 60))
        records = torch.from_numpy(np.flatnonzero(rng.random(60) < 0.5))
        batch = subject_batch(records, subjects)
        expected = int(np.bincount(subjects[records].numpy()).max()) if len(records) else 0
        assert group_size(batch) == expected
        assert batch.num_units == len(np.unique(subjects[records].numpy()))


def test_sigma_z_matches_the_group_privacy_conversion() -> None:
    big_e, big_d, q, steps = 4.0, 1e-5, 0.05, 200
    for z in (1, 2, 3, 5):
        eps_z, delta_z = group_to_record_budget(big_e, big_d, z)
        assert eps_z == pytest.approx(big_e / z)
        assert delta_z == pytest.approx(big_d / (z * math.exp((z - 1) * big_e / z)))
        assert record_to_group_budget(eps_z, delta_z, z) == pytest.approx((big_e, big_d))
        sigma = group_noise_multiplier(z, big_e, big_d, q, steps)
        event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
        assert epsilon(event, delta_z) <= eps_z * (1 + 1e-9)
        # calibrated, not merely feasible: 3% less noise misses the budget
        smaller = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(0.97 * sigma)), steps)
        assert epsilon(smaller, delta_z) > eps_z
    sigmas = [group_noise_multiplier(z, big_e, big_d, q, steps) for z in (1, 2, 3, 5)]
    assert sigmas == sorted(sigmas)


@pytest.mark.parametrize("seed", range(4))
def test_local_group_dp_subject_moves_the_sum_by_at_most_z_c(seed: int) -> None:
    """LocalGroupDP sums clipped *records*: removing one subject moves the sum by at
    most Z C, Z the batch's group size, so sigma_Z / Z is its noise per unit of
    subject sensitivity (what ``noise_per_subject_sensitivity`` reports)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    gsm = GradSampleModule(model, loss_reduction="sum")
    params = list(gsm.parameters())
    n = int(rng.integers(10, 40))
    x, y = torch.randn(n, 4) * 10, torch.from_numpy(rng.integers(0, 3, n))
    subjects = torch.from_numpy(rng.integers(0, 4, n))
    c = float(rng.uniform(0.1, 2.0))

    def record_sum(records: torch.Tensor) -> torch.Tensor:
        for p in params:
            p.grad, p.grad_sample = None, None
        F.cross_entropy(gsm(x[records]), y[records], reduction="sum").backward()
        return torch.cat([s.flatten() for s in clipped_unit_sum(params, record_batch(records), c)])

    records = torch.arange(n)
    z = group_size(subject_batch(records, subjects))
    full = record_sum(records)
    moves = [float(torch.linalg.norm(full - record_sum(records[subjects != a]))) for a in torch.unique(subjects)]
    assert max(moves) <= z * c * (1 + 1e-5)
    assert max(moves) > c  # a subject with several aligned-enough records moves it by more than C
    # a fixed group size G: at most G records of a subject stay, so it moves the sum by <= G C
    capped = cap_per_subject(records, subjects, 2, torch.Generator().manual_seed(seed))
    full = record_sum(capped)
    for a in torch.unique(subjects):
        without = capped[subjects[capped] != a]
        assert float(torch.linalg.norm(full - record_sum(without))) <= 2 * c * (1 + 1e-5)
    gsm._close()  # noqa: SLF001
    rows = noise_per_subject_sensitivity(4.0, 1e-5, 0.05, 200, 3)
    assert [g for g, _, _ in rows] == [1, 2, 3]
    for g, sigma, ratio in rows:
        assert sigma == group_noise_multiplier(g, 4.0, 1e-5, 0.05, 200)
        assert ratio == pytest.approx(sigma / g)


def test_power_assignment_concentrates_subjects() -> None:
    subjects = np.repeat(np.arange(100), 160)
    spread = {}
    for alpha in (1.0, 4.0, 16.0):
        silo = assign_records(subjects, 16, alpha, seed=1)
        counts = subject_silo_counts(subjects, silo, 100, 16)
        assert counts.sum() == len(subjects) and (counts.sum(1) == 160).all()
        spread[alpha] = (counts > 0).sum(1).mean()
    assert spread[1.0] > 15.5 and spread[1.0] > spread[4.0] > spread[16.0]
    with pytest.raises(ValueError, match="alpha"):
        assign_records(subjects, 16, 0.5)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_a_silo(method: str) -> None:
    rng = np.random.default_rng(0)
    data = SiloData.from_numpy(rng.normal(size=(80, 6)), rng.integers(0, 3, 80), rng.integers(0, 10, 80))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    before = [p.detach().clone() for p in model.parameters()]
    stats = BatchStats()
    plan = SiloPlan(method, 0.25, 3, 0.1, 1.0, 2.0, (lambda z: 2.0 * z) if method == "local-group-dp" else None)
    loss = train_silo_round(model, data, plan, torch.Generator().manual_seed(1), stats)
    assert math.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(stats.group_sizes) == 3 and all(z >= 1 for z in stats.group_sizes)
    if method == "local-group-dp":
        assert stats.noise_multipliers == [2.0 * z for z in stats.group_sizes]


def test_cap_per_subject_keeps_at_most_g_records_of_each_subject() -> None:
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        subjects = torch.from_numpy(rng.integers(0, 6, 50))
        records = torch.from_numpy(np.flatnonzero(rng.random(50) < 0.6))
        g = int(rng.integers(1, 4))
        kept = cap_per_subject(records, subjects, g, gen)
        assert set(kept.tolist()) <= set(records.tolist())
        before = np.bincount(subjects[records].numpy(), minlength=6)
        after = np.bincount(subjects[kept].numpy(), minlength=6)
        assert (after == np.minimum(before, g)).all()
    # every record of a subject is kept with the same probability (uniform choice)
    subjects = torch.zeros(4, dtype=torch.long)
    hits = np.zeros(4)
    for _ in range(4000):
        hits[cap_per_subject(torch.arange(4), subjects, 1, gen).numpy()] += 1
    assert np.all(np.abs(hits / 4000 - 0.25) < 0.03)


def test_fixed_group_size_noise_is_scaled_to_g_c() -> None:
    """LocalGroupDP with a fixed group size G adds noise z G C to the record sum
    (divided by the expected batch), lr 1, no data signal."""
    data = SiloData.from_numpy(np.zeros((50, 4)), np.zeros(50, dtype=int), np.arange(50) % 10)
    model = nn.Linear(4, 2000, bias=False)
    nn.init.zeros_(model.weight)
    plan = SiloPlan("local-group-dp", 0.5, 1, 1.0, 0.5, 3.0, group_size=3)
    stats = BatchStats()
    train_silo_round(model, data, plan, torch.Generator().manual_seed(0), stats)
    assert float(model.weight.std()) == pytest.approx(3.0 * 3 * 0.5 / 25, rel=0.05)
    assert stats.group_sizes[0] <= 3 and stats.noise_multipliers == [3.0]
    with pytest.raises(ValueError, match="group_size"):
        SiloPlan("higradavg-dp", 0.5, 1, 1.0, 0.5, 3.0, group_size=2)


def test_fixed_group_size_is_accounted_as_higradavg() -> None:
    """A fixed group size G gives the same releases as HiGradAvgDP at sensitivity G C, so
    the plan (noise multiplier, exact subject-level epsilon) is HiGradAvgDP's."""
    from flwr_jdp.subject.config import SubjectDPConfig
    from flwr_jdp.subject.plan import make_plan

    counts = np.array([[3, 0, 1], [1, 2, 0], [0, 0, 4], [2, 2, 2]])
    common = {"budget_rounds": 3, "batch_size": 4, "target_epsilon": 2.0, "delta": 1e-5,
              "max_records_per_subject": 0}  # reported counts
    group = make_plan(SubjectDPConfig(method="local-group-dp", accounting="exact", group_size=2, **common), counts)
    hi = make_plan(SubjectDPConfig(method="higradavg-dp", accounting="exact", **common), counts)
    assert group.unit == hi.unit == "subject"
    assert group.noise_multiplier == hi.noise_multiplier > 0
    assert group.epsilon == pytest.approx(hi.epsilon) and group.epsilon <= 2.0 * (1 + 1e-6)


def test_user_ldp_noise_is_scaled_to_twice_c() -> None:
    """UserLDP's released gradient has noise std 2 z C (sensitivity 2C), lr 1, no data signal."""
    data = SiloData.from_numpy(np.zeros((50, 4)), np.zeros(50, dtype=int), np.arange(50))
    model = nn.Linear(4, 2000, bias=False)
    nn.init.zeros_(model.weight)
    plan = SiloPlan("user-ldp", 0.5, 1, 1.0, 0.5, 3.0)
    train_silo_round(model, data, plan, torch.Generator().manual_seed(0))
    assert float(model.weight.std()) == pytest.approx(2 * 3.0 * 0.5, rel=0.05)


def test_subject_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="accounting"):
        parse_subject_config({"method": "local-group-dp", "accounting": "exact"})
    assert parse_subject_config({"method": "local-group-dp", "accounting": "exact", "group-size": 2}).group_size == 2
    with pytest.raises(ConfigError, match="group-size"):
        parse_subject_config({"method": "higradavg-dp", "group-size": 2})
    with pytest.raises(ConfigError, match="group-size"):
        parse_subject_config({"method": "local-group-dp", "group-size": -1})
    with pytest.raises(ConfigError, match="alpha"):
        parse_subject_config({"alpha": 0.5})
    with pytest.raises(ConfigError, match="method"):
        parse_subject_config({"method": "nope"})
    with pytest.raises(ConfigError, match="evaluate-on"):
        parse_subject_config({"evaluate-on": "train"})
    with pytest.raises(ConfigError, match="validation-fraction"):
        parse_subject_config({"evaluate-on": "validation", "validation-fraction": 0.0})


def test_subject_dp_apps_run_and_account_exactly(tmp_path, femnist_dir) -> None:
    """The real ServerApp strategy and ClientApp on an in-process grid: 20 FEMNIST
    writers over 4 silos, HiGradAvgDP calibrated by exact horizontal accounting; the
    ledger's epsilon (max over Pareto subjects) meets the target and equals the plan's."""
    from apps.subject_dp.subject_dp.client_app import client
    from apps.subject_dp.subject_dp.server_app import test_evaluator
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.models.leaf_cnn import build_leaf_cnn
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg

    rc = {"data-dir": str(femnist_dir), "max-writers": 20, "num-silos": 4, "budget-rounds": 2,
          "method": "higradavg-dp", "accounting": "exact", "noise-seed": 0,
          "results-dir": str(tmp_path / "run"), "batch-size": 32}
    cfg = parse_subject_config(rc)
    strategy = SubjectLevelFedAvg(cfg, build_leaf_cnn(seed=0), test_evaluator(cfg), rc)
    strategy.start(InProcessGrid(client, 2, rc))
    out = strategy.results()
    assert out["status"] == "completed" and not out["dropped"]
    assert out["ledger_epsilon"] <= 4.0 * (1 + 1e-6)
    assert out["ledger_epsilon"] == pytest.approx(out["plan"]["epsilon"], rel=1e-6)
    assert out["plan"]["epsilon_sfold"] >= out["plan"]["epsilon"]
    assert (tmp_path / "run" / "ledger.json").is_file()
