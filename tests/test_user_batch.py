"""``user-batch-size``: under the user unit, the expected users per DP batch set the
sampling rate the owners use and the ledger records."""

import json
from pathlib import Path

import pytest

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule


def _cfg(**over):
    base = {"privacy-unit": "user", "records-per-user": 10, "batch-size": 32, "local-epochs": 2,
            "num-owners": 2}
    base.update(over)
    return parse_config(base)


def test_default_fills_batch_size_records():
    """0 (the default) keeps the earlier rule: batch-size / records-per-user users."""
    sizes = {0: OwnerSize(2500, 250), 1: OwnerSize(1000, 100)}
    s = build_schedule(_cfg(), sizes)
    assert s.owner_rates[0] == pytest.approx(3.2 / 250)
    assert s.owner_rates[1] == pytest.approx(3.2 / 100)
    assert s.owner_steps[0] == round(2 / (3.2 / 250))
    assert s.server_rate == pytest.approx(3.2 * 2 / 350)


def test_user_batch_size_sets_users_per_batch():
    sizes = {0: OwnerSize(2500, 250), 1: OwnerSize(1000, 100)}
    s = build_schedule(_cfg(**{"user-batch-size": 32}), sizes)
    assert s.owner_rates == {0: pytest.approx(32 / 250), 1: pytest.approx(32 / 100)}
    assert s.owner_steps == {0: round(2 / (32 / 250)), 1: round(2 / (32 / 100))}
    assert s.server_rate == pytest.approx(32 * 2 / 350)
    capped = build_schedule(_cfg(**{"user-batch-size": 500}), sizes)
    assert capped.owner_rates == {0: 1.0, 1: 1.0} and capped.owner_steps == {0: 2, 1: 2}


def test_record_unit_ignores_user_batch_size():
    sizes = {0: OwnerSize(2500, 2500)}
    a = build_schedule(_cfg(**{"privacy-unit": "record", "records-per-user": 1}), sizes)
    b = build_schedule(_cfg(**{"privacy-unit": "record", "records-per-user": 1, "user-batch-size": 8}),
                       sizes)
    assert a == b and a.owner_rates[0] == pytest.approx(32 / 2500)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "many"])
def test_bad_user_batch_size_fails_naming_the_key(bad):
    with pytest.raises(ConfigError, match="user-batch-size"):
        _cfg(**{"user-batch-size": bad})


def test_owners_sample_and_ledger_records_the_user_batch(run_config, monkeypatch):
    """In a real run the owners Poisson-sample users at user-batch-size / users and
    the ledger's events carry exactly that rate."""
    from apps.joint_dp.joint_dp.client_app import app
    from apps.joint_dp.joint_dp.server_app import initial_arrays
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.strategies import JointDP
    from flwr_jdp.training import dp_sgd

    rates = []
    original = dp_sgd.poisson_sample

    def spy(unit_of_record, num_units, sample_rate, generator):
        rates.append((num_units, sample_rate))
        return original(unit_of_record, num_units, sample_rate, generator)

    monkeypatch.setattr(dp_sgd, "poisson_sample", spy)
    run_config.update({"privacy-unit": "user", "records-per-user": 3, "user-batch-size": 5.0,
                       "noise-placement": "local"})
    grid = InProcessGrid(app, 2, run_config)
    cfg = parse_config(run_config)
    JointDP(cfg).start(grid=grid, initial_arrays=initial_arrays(cfg))

    assert rates, "no DP-SGD step ran"
    for num_units, q in rates:
        assert q == pytest.approx(min(1.0, 5.0 / num_units))
    ledger = json.loads((Path(run_config["results-dir"]) / "ledger.json").read_text())
    assert ledger["unit"] == "user"
    used = {round(q, 12) for _, q in rates}
    recorded = set()
    for scope, entries in ledger["scopes"].items():
        for event, _rounds in entries:  # SelfComposed(PoissonSampled(q, Gaussian), steps) per round
            q = event["event"]["sampling_probability"]
            assert event["count"] == max(1, round(run_config["local-epochs"] / q)), scope
            recorded.add(round(q, 12))
    assert recorded == used  # the rates the owners sampled at are the rates accounted

