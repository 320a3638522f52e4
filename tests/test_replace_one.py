"""neighbouring = "replace-one": the joint-DP ledger and calibration under the
paper's replace-one definition (issue item 8)."""

import json
from pathlib import Path

import pytest

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule, calibrate_schedule
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.strategies import load_results

from .helpers import run_inprocess


@pytest.mark.parametrize("extra", [{"privacy-unit": "record"}, {"privacy-unit": "user"},
                                   {"privacy-unit": "record", "noise-placement": "central"},
                                   {"privacy-unit": "owner", "noise-placement": "central",
                                    "fraction-train": 0.5}])
def test_rdp_with_replace_one_and_sampling_fails_at_startup_naming_the_keys(extra):
    with pytest.raises(ConfigError) as err:
        parse_config({"accountant": "rdp", "neighbouring": "replace-one", **extra})
    assert "'accountant'" in str(err.value) and "'neighbouring'" in str(err.value)


def test_unsampled_or_pld_replace_one_configs_are_accepted():
    assert parse_config({"accountant": "rdp", "neighbouring": "replace-one",
                         "privacy-unit": "owner"}).neighbouring == "replace-one"
    parse_config({"accountant": "rdp", "neighbouring": "replace-one", "privacy-unit": "owner",
                  "noise-placement": "central"})
    parse_config({"accountant": "pld", "neighbouring": "replace-one"})
    assert parse_config({}).neighbouring == "add-remove"
    with pytest.raises(ConfigError, match="'neighbouring'"):
        parse_config({"neighbouring": "swap"})


@pytest.mark.parametrize("placement", ["local", "central"])
def test_a_replace_one_run_reports_at_least_the_add_remove_epsilon(run_config, placement, tmp_path):
    eps = {}
    for relation in ("add-remove", "replace-one"):
        cfg = dict(run_config, **{"neighbouring": relation, "noise-placement": placement,
                                  "num-rounds": 1, "batch-size": 96,
                                  "results-dir": str(tmp_path / relation)})
        strategy, _, _ = run_inprocess(cfg)
        ledger = json.loads((Path(cfg["results-dir"]) / "ledger.json").read_text())
        assert ledger["neighbouring"] == relation and strategy.ledger.neighbouring == relation
        eps[relation] = load_results(cfg["results-dir"])["final_epsilon"]
    assert eps["add-remove"] > 0
    assert eps["replace-one"] >= eps["add-remove"]


def test_unsampled_replace_one_equals_add_remove_at_half_the_multiplier():
    """The owner unit (local noise) releases unsampled Gaussians; replace-one moves
    the sum by 2C, i.e. add/remove at z / 2."""
    ledger = PrivacyLedger(delta=1e-5, unit="owner", neighbouring="replace-one")
    half = PrivacyLedger(delta=1e-5, unit="owner")
    for _ in range(3):
        ledger.record("owner/0", ev.gaussian(4.0))
        half.record("owner/0", ev.gaussian(2.0))
    assert ledger.epsilon() == pytest.approx(half.epsilon(), rel=1e-9)


@pytest.mark.parametrize("extra", [{}, {"noise-placement": "central"}])
def test_calibration_under_replace_one_meets_the_target(extra):
    sizes = {o: OwnerSize(128, 64) for o in range(3)}
    cfg = parse_config({"target-epsilon": 3.0, "num-rounds": 2, "batch-size": 32, "local-epochs": 1,
                        "neighbouring": "replace-one", **extra})
    schedule = build_schedule(cfg, sizes)
    z = calibrate_schedule(cfg, schedule)
    ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant, neighbouring="replace-one")
    add_remove = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant)
    for rnd in range(1, cfg.num_rounds + 1):
        ledger.record_round(rnd, schedule.round_events(cfg, z, sorted(sizes)))
        add_remove.record_round(rnd, schedule.round_events(cfg, z, sorted(sizes)))
    assert 0.99 * cfg.target_epsilon <= ledger.epsilon() <= cfg.target_epsilon
    # the add/remove epsilon of the same z is below the target: replace-one needs more noise
    assert add_remove.epsilon() < 0.95 * cfg.target_epsilon
