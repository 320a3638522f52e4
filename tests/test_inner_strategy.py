"""An inner Flower strategy post-processes JointDP's DP aggregate: it changes the
model and never the ledger; Flower's DP wrappers and robust aggregators are refused
with a reason, and a JointDP driven by another strategy's loop fails before spending."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
)

from apps.joint_dp.joint_dp.client_app import app as client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.strategies import JointDP


def _run(run_config, inner=None):
    cfg = parse_config(run_config)
    strategy = JointDP(cfg, node_settle_s=0.0, inner=inner)
    result = strategy.start(grid=InProcessGrid(client_app, 2, run_config), initial_arrays=initial_arrays(cfg))
    return strategy, result


@pytest.mark.parametrize("make", [lambda: FedAdam(eta=0.05), lambda: FedAvgM(server_momentum=0.9)])
def test_inner_optimizer_changes_the_model_not_the_ledger(run_config, tmp_path, make):
    run_config.update({"num-rounds": 2, "noise-seed": 7})
    plain, plain_result = _run(dict(run_config, **{"results-dir": str(tmp_path / "a")}))
    inner, inner_result = _run(dict(run_config, **{"results-dir": str(tmp_path / "b")}), make())
    assert inner.ledger.epsilon() == plain.ledger.epsilon()
    assert [r["round"] for r in inner.ledger.rounds] == [r["round"] for r in plain.ledger.rounds]
    a, b = plain_result.arrays, inner_result.arrays
    assert set(a.keys()) == set(b.keys())
    assert any(not np.allclose(a[k].numpy(), b[k].numpy()) for k in a.keys())


def test_fedavg_inner_is_the_default(run_config, tmp_path):
    run_config.update({"num-rounds": 1, "noise-seed": 7})
    _, r1 = _run(dict(run_config, **{"results-dir": str(tmp_path / "a")}))
    _, r2 = _run(dict(run_config, **{"results-dir": str(tmp_path / "b")}), FedAvg())
    for k in r1.arrays.keys():
        np.testing.assert_array_equal(r1.arrays[k].numpy(), r2.arrays[k].numpy())


def test_dp_wrappers_and_robust_aggregators_are_refused():
    with pytest.raises(ConfigError, match="already DP"):
        JointDP(inner=DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=1.0,
                                                                 clipping_norm=1.0, num_sampled_clients=2))
    with pytest.raises(ConfigError, match="robust aggregators"):
        JointDP(inner=FedMedian())


def test_jointdp_wrapped_by_flowers_dp_wrapper_fails_before_spending(run_config, tmp_path):
    run_config.update({"results-dir": str(tmp_path / "w")})
    wrapped = DifferentialPrivacyServerSideFixedClipping(
        JointDP(parse_config(run_config), node_settle_s=0.0), noise_multiplier=1.0, clipping_norm=1.0,
        num_sampled_clients=2)
    with pytest.raises(ConfigError, match="its own start"):
        wrapped.start(grid=InProcessGrid(client_app, 2, run_config), initial_arrays=ArrayRecord(),
                      num_rounds=1, train_config=ConfigRecord())
    assert not (tmp_path / "w" / "ledger.json").exists()
