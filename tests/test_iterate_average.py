"""The moving average of the shared model (``ema-decay``): its arithmetic, that the
owners are evaluated with it while training continues from the aggregate, that it
spends no privacy, and that it survives a restart."""

import numpy as np
import pytest

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.iterate_average import SharedParameterEMA
from flwr_jdp.strategies import load_results
from research.reproduce_joint_dp import comparable

from .helpers import Killed, kill_after_trains, run_inprocess


def _weighted_mean(xs, beta):
    t = len(xs)
    w = np.array([beta ** (t - 1 - i) for i in range(t)])
    return sum(wi * x for wi, x in zip(w, xs, strict=True)) / w.sum()


def test_average_is_the_geometrically_weighted_mean_of_the_rounds():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(5)]
    ema = SharedParameterEMA(0.7)
    for t, x in enumerate(xs, start=1):
        got = ema.update({"w": x})["w"]
        np.testing.assert_allclose(got, _weighted_mean(xs[:t], 0.7), rtol=1e-5, atol=1e-6)
        assert got.dtype == np.float32
    # the first average is the first aggregate itself (bias correction; no pull to zero)
    first = SharedParameterEMA(0.9)
    np.testing.assert_allclose(first.update({"w": xs[0]})["w"], xs[0], rtol=1e-6)


def test_decay_zero_is_the_last_aggregate_and_restore_continues_the_same_average():
    rng = np.random.default_rng(1)
    xs = [{"a": rng.normal(size=4), "b": rng.normal(size=2)} for _ in range(4)]
    zero = SharedParameterEMA(0.0)
    for x in xs:
        out = zero.update(x)
    np.testing.assert_allclose(out["a"], xs[-1]["a"])

    full, resumed = SharedParameterEMA(0.8), SharedParameterEMA(0.8)
    for x in xs[:2]:
        full.update(x)
    resumed.restore(full.average(like=xs[0]), full.steps)
    for x in xs[2:]:
        want, got = full.update(x), resumed.update(x)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12)
    with pytest.raises(ValueError, match="keys changed"):
        full.update({"a": xs[0]["a"]})


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_decay_fails_at_start_up_naming_the_key(bad):
    with pytest.raises(ConfigError, match="'ema-decay' must be in \\[0, 1\\)"):
        parse_config({"ema-decay": bad})
    with pytest.raises(ValueError, match="ema-decay"):
        SharedParameterEMA(1.0)


def test_runs_stored_before_the_key_existed_compare_equal_at_its_old_value():
    assert comparable({"seed": 0, "ema-decay": 0.0}) == {"seed": 0}
    assert comparable({"seed": 0, "ema-decay": 0.5}) == {"seed": 0, "ema-decay": 0.5}


def test_owners_are_evaluated_on_the_average_and_it_costs_no_privacy(run_config, tmp_path):
    """Capture every broadcast: a train message carries the previous round's
    aggregate, an evaluate message the average; the average must be the weighted
    mean of the aggregates, and the ledger must equal a run without averaging."""
    beta = 0.6
    run_config.update({"num-rounds": 3, "ema-decay": beta})
    seen = {"train": [], "evaluate": []}

    def capture(instruction, reply):
        kind = instruction.metadata.message_type
        if kind in seen and instruction.metadata.dst_node_id == 1000:
            rec = instruction.content[protocol.SHARED]
            seen[kind].append({k: v.numpy().copy() for k, v in rec.items()})
        return reply

    run_inprocess(run_config, fault=capture)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "completed" and res["rounds_completed"] == 3
    with np.load(f"{run_config['results-dir']}/model.npz") as npz:
        last = {k: np.asarray(npz[k]) for k in npz.files}
    aggregates = seen["train"][1:] + [last]  # round r's aggregate is round r+1's broadcast
    assert len(aggregates) == 3 and len(seen["evaluate"]) == 3
    for r in range(3):
        for k, v in seen["evaluate"][r].items():
            np.testing.assert_allclose(v, _weighted_mean([a[k] for a in aggregates[:r + 1]], beta),
                                       rtol=1e-4, atol=1e-6)
    # the average differs from the aggregate after round 1 (it is really used)
    k0 = next(iter(last))
    assert not np.allclose(seen["evaluate"][2][k0], last[k0])
    with np.load(f"{run_config['results-dir']}/model_ema.npz") as npz:
        assert int(npz["ema-steps"]) == 3
        np.testing.assert_allclose(npz[k0], seen["evaluate"][2][k0], rtol=1e-6)

    plain = dict(run_config, **{"ema-decay": 0.0, "results-dir": str(tmp_path / "plain")})
    run_inprocess(plain)
    assert res["epsilon"] == pytest.approx(load_results(plain["results-dir"])["epsilon"], rel=1e-12)


def test_a_restarted_server_continues_the_average(run_config):
    run_config.update({"num-rounds": 3, "ema-decay": 0.5})
    with pytest.raises(Killed):
        run_inprocess(run_config, fault=kill_after_trains(4))  # killed in round 3
    with np.load(f"{run_config['results-dir']}/model_ema.npz") as npz:
        assert int(npz["ema-steps"]) == 2
    strategy, _, _ = run_inprocess(run_config)
    assert load_results(run_config["results-dir"])["rounds_completed"] == 3
    assert strategy.ema is not None and strategy.ema.steps == 3
