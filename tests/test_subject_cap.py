"""Subject-level DP's public-cap mode (``max-records-per-subject = K > 0``, the default):
each silo truncates every subject to at most K records, nothing data-dependent is sent
at set-up, and the server plans and accounts for the worst-case subject (K records at
every silo), an upper bound on every subject whose counts are at most K."""

from __future__ import annotations

import re

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.privacy.horizontal import HorizontalAccountant, SiloRelease
from flwr_jdp.subject.config import SubjectDPConfig, parse_subject_config
from flwr_jdp.subject.plan import make_plan, worst_case_counts
from flwr_jdp.subject.protocol import CONFIG, SETUP, SILOS, silo_key
from flwr_jdp.subject.silos import truncate_per_subject
from flwr_jdp.training.subject_level import SiloData, SiloPlan, train_silo_round


def _apps():
    from apps.subject_dp.subject_dp.client_app import client
    from apps.subject_dp.subject_dp.server_app import test_evaluator
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
    return client, test_evaluator, SubjectLevelFedAvg


def _says(key: str, allowed: str, value) -> str:
    return re.escape(f"run-config key '{key}' must be {allowed}, got {value!r}")


# ---------------------------------------------------------------- truncation


def test_truncation_keeps_at_most_k_records_of_each_subject_and_is_per_subject() -> None:
    rng = np.random.default_rng(0)
    for trial in range(20):
        subjects = rng.integers(0, 12, int(rng.integers(1, 200)))
        k = int(rng.integers(1, 6))
        kept = truncate_per_subject(subjects, k, (trial, 3))
        assert (np.diff(kept) > 0).all()  # ascending, no duplicates
        before = np.bincount(subjects, minlength=12)
        assert (np.bincount(subjects[kept], minlength=12) == np.minimum(before, k)).all()
        # deterministic for a seed
        assert (truncate_per_subject(subjects, k, (trial, 3)) == kept).all()
        # removing one subject changes the kept records of that subject only
        gone = int(subjects[0])
        rest = np.flatnonzero(subjects != gone)
        kept_without = rest[truncate_per_subject(subjects[rest], k, (trial, 3))]
        assert set(kept_without.tolist()) == {int(i) for i in kept if subjects[i] != gone}
    with pytest.raises(ValueError, match="max_records"):
        truncate_per_subject(np.zeros(3, dtype=int), 0)


def test_silos_train_on_at_most_k_records_per_subject(femnist_dir) -> None:
    from flwr_jdp.subject import silo_data as sd

    base = {"data_dir": str(femnist_dir), "max_writers": 20, "num_silos": 4}
    raw = sd.all_counts(SubjectDPConfig(max_records_per_subject=0, **base))
    cfg = SubjectDPConfig(max_records_per_subject=3, **base)
    assert raw.max() > 3
    capped = sd.all_counts(cfg)
    assert (capped == np.minimum(raw, 3)).all()
    for i in range(cfg.num_silos):
        data = sd.silo_data(cfg, i)
        per_subject = np.bincount(data.subject.numpy(), minlength=raw.shape[0])
        assert (per_subject == capped[:, i]).all() and per_subject.max() <= 3


def test_cap_mode_divides_by_the_public_batch_size() -> None:
    """Zero data signal, lr 1: the update's noise std is z C / B with the public B
    (``normaliser``), whatever the silo's size."""
    for n in (40, 400):
        data = SiloData.from_numpy(np.zeros((n, 4)), np.zeros(n, dtype=int), np.arange(n) % 10)
        model = nn.Linear(4, 3000, bias=False)
        nn.init.zeros_(model.weight)
        plan = SiloPlan("higradavg-dp", 0.2, 1, 1.0, 0.5, 3.0, normaliser=25.0)
        train_silo_round(model, data, plan, torch.Generator().manual_seed(n))
        assert float(model.weight.std()) == pytest.approx(3.0 * 0.5 / 25.0, rel=0.05)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("run_config,key,allowed,value", [
    ({"max-records-per-subject": -1}, "max-records-per-subject", "in [0, 100000] (0 = reported counts, not DP)", -1),
    ({"max-records-per-subject": 100_001}, "max-records-per-subject",
     "in [0, 100000] (0 = reported counts, not DP)", 100_001),
    ({"sample-rate": 0.0}, "sample-rate", "in (0, 1]", 0.0),
    ({"sample-rate": 1.5}, "sample-rate", "in (0, 1]", 1.5),
])
def test_out_of_range_cap_keys_fail_at_start_up_naming_the_key(run_config, key, allowed, value) -> None:
    with pytest.raises(ConfigError, match=_says(key, allowed, value)):
        parse_subject_config(run_config)


def test_cap_is_the_default_and_the_reported_counts_mode_is_explicit() -> None:
    cfg = parse_subject_config({})
    assert cfg.public_cap and cfg.max_records_per_subject == 8 and cfg.sample_rate == 0.1
    assert not parse_subject_config({"max-records-per-subject": 0}).public_cap
    # the paper's record-rate accounting and data-dependent LocalGroupDP need reported counts
    with pytest.raises(ConfigError, match="'max-records-per-subject' must be 0 .* inclusion = record"):
        parse_subject_config({"inclusion": "record", "accounting": "sqrt-rounds"})
    with pytest.raises(ConfigError, match="'max-records-per-subject' must be 0 .* local-group-dp"):
        parse_subject_config({"method": "local-group-dp", "accounting": "scaled-steps"})
    parse_subject_config({"inclusion": "record", "accounting": "sqrt-rounds", "max-records-per-subject": 0})
    parse_subject_config({"method": "local-group-dp", "accounting": "scaled-steps", "max-records-per-subject": 0})
    parse_subject_config({"method": "local-group-dp", "accounting": "exact", "group-size": 2})
    with pytest.raises(ValueError, match="reported counts"):
        make_plan(SubjectDPConfig(num_silos=2), np.ones((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="counts"):
        make_plan(SubjectDPConfig(num_silos=2, max_records_per_subject=0))


# ---------------------------------------------------------------- accounting


def _independent_epsilon(rate: float, k: int, silos: int, z: float, steps: int, delta: float) -> float:
    """dp-accounting alone: a subject with k records at each of the silos, Poisson
    record rate ``rate``, is in a batch with probability 1 - (1 - rate)^k."""
    p = 1.0 - (1.0 - rate) ** k
    one = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(p, dpa.GaussianDpEvent(z)), steps)
    return PLDAccountant(value_discretization_interval=1e-4).compose(
        dpa.ComposedDpEvent([one] * silos)).get_epsilon(delta)


@pytest.mark.parametrize("sampling", ["records", "subjects"])
def test_plan_is_the_worst_case_subject_and_bounds_every_capped_map(sampling: str) -> None:
    k, s, q, rounds, steps = 3, 4, 0.2, 3, 2
    cfg = SubjectDPConfig(max_records_per_subject=k, sample_rate=q, num_silos=s, budget_rounds=rounds,
                          local_steps=steps, target_epsilon=2.0, sampling=sampling)
    plan = make_plan(cfg)
    assert plan.sample_rates == (q,) * s and plan.unit == "subject"
    assert plan.epsilon <= 2.0 * (1 + 1e-6)
    assert (worst_case_counts(cfg) == k).all() and worst_case_counts(cfg).shape == (1, s)
    rel = [SiloRelease(q, plan.noise_multiplier, steps, sampling=sampling)] * s
    row = [k] * s if sampling == "records" else [1] * s
    assert plan.epsilon == pytest.approx(HorizontalAccountant(np.array([row]), cfg.delta).epsilon(rel, rounds),
                                         rel=1e-9)
    independent = _independent_epsilon(q, k if sampling == "records" else 1, s, plan.noise_multiplier,
                                       steps * rounds, cfg.delta)
    assert plan.epsilon == pytest.approx(independent, rel=1e-3)
    # every map with at most K records per subject and silo is no worse
    rng = np.random.default_rng(1)
    for _ in range(5):
        counts = rng.integers(0, k + 1, size=(30, s))
        assert HorizontalAccountant(counts, cfg.delta).epsilon(rel, rounds) <= plan.epsilon * (1 + 1e-9)


def test_ledger_charges_the_worst_case_subject() -> None:
    """The strategy's per-round event is the worst-case subject's; R rounds on the
    ledger give the plan's epsilon (computed without any count)."""
    from flwr_jdp.privacy.ledger import PrivacyLedger

    _, _, strategy_cls = _apps()
    cfg = SubjectDPConfig(max_records_per_subject=2, sample_rate=0.3, num_silos=3, budget_rounds=3,
                          local_steps=1, noise_multiplier=2.0, results_dir="")  # given z: no calibration
    strategy = strategy_cls(cfg, nn.Linear(2, 2))
    strategy.counts, strategy.plan = worst_case_counts(cfg), make_plan(cfg)
    events = strategy.round_events()
    assert list(events) == ["subject/worst-case"]
    ledger = PrivacyLedger(delta=cfg.delta, unit="subject")
    for r in range(1, cfg.budget_rounds + 1):
        ledger.record_round(r, events)
    assert ledger.epsilon() == pytest.approx(strategy.plan.epsilon, rel=1e-6)
    assert ledger.epsilon() == pytest.approx(_independent_epsilon(0.3, 2, 3, 2.0, 3, cfg.delta), rel=1e-3)


# ---------------------------------------------------------------- what is sent


def _setup_replies(rc: dict) -> list[Message]:
    client, _, _ = _apps()
    grid = InProcessGrid(client, 2, rc)
    query = [Message(RecordDict({CONFIG: ConfigRecord({"round": 0})}), dst_node_id=n,
                     message_type=MessageType.QUERY) for n in grid.get_node_ids()]
    return list(grid.send_and_receive(query))


def test_cap_mode_setup_reply_carries_no_subject_ids_or_counts() -> None:
    """Cap mode's set-up replies hold the silo indices a node hosts and nothing else
    (no data is even loaded: the data-dir does not exist)."""
    rc = {"data-dir": "/nonexistent", "num-silos": 5}
    replies = _setup_replies(rc)
    assert sorted(i for r in replies for i in r.content[SETUP][SILOS]) == list(range(5))
    for reply in replies:
        assert list(reply.content.keys()) == [SETUP]
        assert not reply.content.array_records and list(reply.content[SETUP].keys()) == [SILOS]


def test_reported_counts_mode_still_sends_counts(femnist_dir) -> None:
    """The contrast: with max-records-per-subject = 0 each silo sends its subjects and counts."""
    rc = {"data-dir": str(femnist_dir), "max-writers": 20, "num-silos": 4, "max-records-per-subject": 0}
    replies = _setup_replies(rc)
    for reply in replies:
        for i in reply.content[SETUP][SILOS]:
            assert set(reply.content.array_records[silo_key(i)]) == {"subjects", "counts"}


def test_cap_mode_run_completes_within_target_and_sends_only_dp_models(tmp_path, femnist_dir) -> None:
    """End to end, in process: the real ServerApp strategy and ClientApp (20 FEMNIST
    writers over 4 silos, 2 rounds). Every reply the server receives is captured: the
    set-up lists silos only, every training reply holds only the silos' models. The
    plan (z, rates) does not depend on the data (a run on other writers plans the
    same), and the ledger's epsilon is the worst-case subject's, within the target."""
    client, test_evaluator, strategy_cls = _apps()
    from flwr_jdp.subject.task import build_subject_model

    received: list[tuple[str, Message]] = []

    def capture(instruction: Message, reply: Message) -> Message:
        received.append((instruction.metadata.message_type, reply))
        return reply

    rc = {"data-dir": str(femnist_dir), "max-writers": 20, "num-silos": 4, "budget-rounds": 2,
          "local-steps": 1, "batch-size": 32, "sample-rate": 0.05, "max-records-per-subject": 4,
          "noise-seed": 0, "eval-every": 2, "results-dir": str(tmp_path / "run")}
    cfg = parse_subject_config(rc)
    strategy = strategy_cls(cfg, build_subject_model(cfg), test_evaluator(cfg), rc)
    strategy.start(InProcessGrid(client, 2, rc, fault=capture))
    out = strategy.results()
    assert out["status"] == "completed" and not out["dropped"]
    assert out["ledger_epsilon"] <= cfg.target_epsilon * (1 + 1e-6)
    assert out["ledger_epsilon"] == pytest.approx(out["plan"]["epsilon"], rel=1e-6)
    assert tuple(out["plan"]["sample_rates"]) == (0.05,) * 4
    independent = _independent_epsilon(0.05, 4, 4, out["plan"]["noise_multiplier"], 2, cfg.delta)
    assert out["ledger_epsilon"] == pytest.approx(independent, rel=1e-3)
    assert out["silo_counts_max"] == [4] * 4 and out["max_records_per_subject"] == 4

    model_keys = set(build_subject_model(cfg).state_dict())
    setups = [r for t, r in received if t == MessageType.QUERY]
    trains = [r for t, r in received if t == MessageType.TRAIN]
    assert len(setups) == 2 and len(trains) == 2 * 2
    for reply in setups:
        assert list(reply.content.keys()) == [SETUP] and not reply.content.array_records
    for reply in trains:
        assert not reply.content.config_records and not reply.content.metric_records
        for name, record in reply.content.array_records.items():
            assert name.startswith("silo.") and set(record) == model_keys

    # the same plan on other data (other writers, another layout): nothing data-dependent entered it
    other = dict(rc, **{"max-writers": 12, "alpha": 4.0, "results-dir": str(tmp_path / "other")})
    cfg2 = parse_subject_config(other)
    strategy2 = strategy_cls(cfg2, build_subject_model(cfg2), None, other)
    strategy2.prepare(InProcessGrid(client, 2, other), None, None, 60.0)
    assert strategy2.plan == strategy.plan
