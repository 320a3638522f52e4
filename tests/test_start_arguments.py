"""``JointDP.start`` honours Flower's arguments, or refuses them before any privacy is
spent; a run that cannot make progress ends as failed, never as completed."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord

from apps.joint_dp.joint_dp.client_app import app as client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.strategies import JointDP, load_results


def _start(run_config, fault=None, strategy_kwargs=None, **kwargs):
    cfg = parse_config(run_config)
    grid = InProcessGrid(client_app, 2, run_config, fault=fault)
    strategy = JointDP(cfg, node_settle_s=0.0, **(strategy_kwargs or {}))
    kwargs.setdefault("initial_arrays", initial_arrays(cfg))
    return strategy, strategy.start(grid=grid, **kwargs)


def _nothing_spent(run_config):
    return not (Path(run_config["results-dir"]) / "ledger.json").exists()


def _initial_model(run_config):
    record = initial_arrays(parse_config(run_config))  # the app's seed CNN (digits: 8x8, 10 classes)
    return {n: record[n].numpy() for n in record.keys()}


def test_num_rounds_is_the_calibration_horizon_under_central_noise(run_config):
    run_config.update({"noise-placement": "central", "noise-multiplier": 0.0, "target-epsilon": 3.0,
                       "num-rounds": 2})
    strategy, _ = _start(run_config, num_rounds=3)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "completed" and [r["round"] for r in res["history"]] == [1, 2, 3]
    assert 0.95 * 3.0 <= res["epsilon"] <= 3.0  # calibrated for the 3 rounds it ran
    assert strategy.cfg.num_rounds == 3


def test_num_rounds_other_than_the_owners_horizon_is_refused_under_local_noise(run_config):
    with pytest.raises(ConfigError, match=r"start\(num_rounds=3\) differs from run-config key 'num-rounds'=2"):
        _start(run_config, num_rounds=3)
    assert _nothing_spent(run_config)


def test_evaluate_fn_is_called_on_the_shared_model_before_and_after_every_round(run_config):
    seen = []

    def evaluate_fn(server_round, arrays):
        seen.append((server_round, sorted(arrays.keys())))
        return MetricRecord({"norm": float(sum(np.linalg.norm(a) for a in arrays.to_numpy_ndarrays()))})

    strategy, result = _start(run_config, evaluate_fn=evaluate_fn)
    assert [r for r, _ in seen] == [0, 1, 2]
    # the shared model with the personal parameters at their public initial values
    assert all(keys == sorted(strategy.model_spec) for _, keys in seen)
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    history = load_results(run_config["results-dir"])["history"]
    assert [sorted(r["server_metrics"]) for r in history] == [["norm"], ["norm"]]


def test_train_and_evaluate_config_reach_the_clientapp(run_config):
    seen = {}

    def spy(instruction, reply):
        seen.setdefault(instruction.metadata.message_type, []).append(
            dict(instruction.content[protocol.CONFIG]))
        return reply

    _start(run_config, fault=spy, train_config=ConfigRecord({"my-key": 7}),
           evaluate_config=ConfigRecord({"other": "x"}))
    assert all(c["my-key"] == 7 for c in seen["train"])
    assert all(c["other"] == "x" for c in seen["evaluate"])


def test_initial_arrays_shared_part_is_broadcast(run_config):
    initial = _initial_model(run_config)
    initial["fc2.bias"] = np.full_like(initial["fc2.bias"], 0.25)  # a shared parameter
    broadcast = []

    def spy(instruction, reply):
        if instruction.metadata.message_type == "train":
            broadcast.append(instruction.content[protocol.SHARED]["fc2.bias"].numpy())
        return reply

    _start(run_config, fault=spy, initial_arrays=protocol.to_record(initial))
    assert np.all(broadcast[0] == 0.25)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update({"fc2.weight": np.zeros((3, 3), np.float32)}),
     r"initial_arrays do not match the ClientApp's model \(node \d+\): \['fc2.weight: 3x3 here"),
    (lambda a: a.update({"head.weight": np.zeros(3, np.float32)}),
     r"initial_arrays has \['head.weight'\], which the ClientApp's model \(node \d+\) does not have"),
    (lambda a: a.pop("fc2.weight"), r"initial_arrays lacks \['fc2.weight'\] of the ClientApp's model"),
])
def test_initial_arrays_that_do_not_match_the_clientapp_model_fail_before_spending(run_config, change, message):
    initial = _initial_model(run_config)
    change(initial)
    with pytest.raises(ConfigError, match=message):
        _start(run_config, initial_arrays=protocol.to_record(initial))
    assert _nothing_spent(run_config)


def test_the_personal_values_of_initial_arrays_are_the_owners_public_initial_values(run_config):
    """Personal parameters in ``initial_arrays`` are sent once, at set-up, as the public
    values every owner starts from and computes its releases with; never broadcast."""
    initial = _initial_model(run_config)
    initial["fc1.bias"] = np.full_like(initial["fc1.bias"], 0.5)  # a personal parameter
    seen = {}

    def spy(instruction, reply):
        kind = instruction.metadata.message_type
        seen.setdefault(kind, []).append(instruction)
        return reply

    _start(run_config, fault=spy, initial_arrays=protocol.to_record(initial))
    assert load_results(run_config["results-dir"])["status"] == "completed"
    setup = seen["query"][0].content[protocol.PUBLIC_PERSONAL]
    assert sorted(setup.keys()) == ["fc1.bias", "fc1.weight"] and np.all(setup["fc1.bias"].numpy() == 0.5)
    assert all("fc1.bias" not in m.content[protocol.SHARED] for m in seen["train"] + seen["evaluate"])


def test_a_run_without_valid_replies_ends_failed_with_its_epsilon_saved(run_config):
    run_config.update({"num-rounds": 6, "max-skipped-rounds": 2})

    def corrupt(instruction, reply):
        if instruction.metadata.message_type == "train":
            return None  # every train reply is lost
        return reply

    with pytest.raises(RuntimeError, match=r"2 rounds in a row \(max-skipped-rounds=2\).*no reply"):
        _start(run_config, fault=corrupt)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "failed" and res["rounds_completed"] == 2
    ledger = PrivacyLedger.load(Path(run_config["results-dir"]) / "ledger.json")
    assert [r["round"] for r in ledger.rounds] == [1, 2] and res["epsilon"] == ledger.epsilon() > 0


def test_max_skipped_rounds_is_validated(run_config):
    with pytest.raises(ConfigError, match="max-skipped-rounds"):
        parse_config(dict(run_config, **{"max-skipped-rounds": 0}))


def test_a_start_without_the_model_is_refused_before_spending(run_config):
    with pytest.raises(ConfigError, match=r"start\(\) needs the model: pass start\(initial_arrays="):
        _start(run_config, initial_arrays=None)
    assert _nothing_spent(run_config)


def test_fedavgs_evaluate_metrics_aggr_fn_and_fraction_evaluate_carry_over(run_config):
    """FedAvg's ``evaluate_metrics_aggr_fn`` gets each evaluated owner's reply content and
    the weighting key, as Flower calls it, and its result is in the round's metrics;
    ``fraction_evaluate`` asks that fraction of the 4 owners (2) each round."""
    calls = []

    def aggr(contents, key):
        calls.append((len(contents), key, sorted(contents[0]["metrics"].keys())))
        return MetricRecord({"best": max(c["metrics"]["accuracy"] for c in contents), "accuracy": -1.0})

    asked = []

    def spy(instruction, reply):
        if instruction.metadata.message_type == "evaluate":
            asked.append(list(instruction.content[protocol.CONFIG][protocol.OWNERS]))
        return reply

    _, result = _start(run_config, fault=spy,
                       strategy_kwargs={"fraction_evaluate": 0.5, "evaluate_metrics_aggr_fn": aggr})
    assert len(calls) == 2 and all(n == 2 and key == "num-examples" for n, key, _ in calls)  # one per round
    assert "accuracy" in calls[0][2] and "num-examples" in calls[0][2]
    assert sum(map(len, asked)) == 4  # 2 owners asked in each of the 2 rounds
    metrics = result.evaluate_metrics_clientapp[2]
    assert metrics["owners"] == 2 and 0 <= metrics["best"] <= 1
    assert metrics["accuracy"] == -1.0  # the user's function overrides flwr-jdp's key
    assert "accuracy-std" in metrics  # flwr-jdp's other keys stay


@pytest.mark.parametrize("name,message", [
    ("train_metrics_aggr_fn", "train_metrics_aggr_fn: a train reply carries only 'num-examples'"),
    ("min_available_nodes", "min_available_nodes: JointDP waits at set-up for 'num-owners'"),
    ("fraction_fit", "fraction_fit: JointDP samples owners itself"),
])
def test_fedavg_arguments_not_carried_over_are_refused_with_the_reason(run_config, name, message):
    with pytest.raises(ConfigError, match=rf"JointDP does not take FedAvg's {message}"):
        JointDP(parse_config(run_config), **{name: 2})
    with pytest.raises(ConfigError, match=r"fraction_evaluate=1.5\): must be in \[0, 1\]"):
        JointDP(parse_config(run_config), fraction_evaluate=1.5)
