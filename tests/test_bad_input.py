"""Bad configurations fail at start-up; bad replies are dropped, never aggregated."""

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.strategies import load_results

from .helpers import run_inprocess


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("target-epsilon", 0.0, "'target-epsilon' must be > 0"),
        ("target-epsilon", -1.0, "'target-epsilon' must be > 0"),
        ("delta", 0.0, "'delta' must be in (0, 1)"),
        ("delta", 1.0, "'delta' must be in (0, 1)"),
        ("clipping-norm", 0.0, "'clipping-norm' must be > 0"),
        ("clipping-norm", -2.0, "'clipping-norm' must be > 0"),
        ("privacy-unit", "subject", "'privacy-unit' must be one of"),
        ("noise-placement", "nowhere", "'noise-placement' must be one of"),
        ("accountant", "moments", "'accountant' must be one of"),
        ("num-owners", -1, "'num-owners' must be >= 0"),
        ("batch-size", "many", "'batch-size' must be of type int"),
        ("personal-layers", "(", "'personal-layers' must be a valid regular expression"),
        ("fraction-train", 0.5, "'fraction-train' must be 1.0 unless privacy-unit='owner'"),
    ],
)
def test_bad_config_names_key_and_range(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config({key: value})
    assert fragment in str(err.value)


@pytest.mark.parametrize("rule,fragment", [("^nothing$", "matches no parameter"),
                                           (".*", "matches every parameter")])
def test_personal_rule_matching_none_or_all_fails_at_startup(run_config, rule, fragment):
    run_config["personal-layers"] = rule
    with pytest.raises(ConfigError) as err:
        run_inprocess(run_config)
    assert "personal-layers" in str(err.value) and fragment in str(err.value)


def test_more_owners_than_records_fails_at_startup(run_config):
    run_config.update({"num-owners": 5000})
    with pytest.raises(Exception) as err:
        run_inprocess(run_config)
    assert "num-owners=5000" in str(err.value)


def _corrupt(kind):
    """A fault that corrupts owner 0's reply in one way."""

    def fault(instruction, reply):
        if instruction.metadata.message_type != "train":
            return reply
        key = protocol.owner_key(0)
        if key not in reply.content:
            return reply
        rec = reply.content[key]
        names = list(rec.keys())
        first = rec[names[0]].numpy()
        if kind == "nan":
            bad = first.copy()
            bad.flat[0] = np.nan
            rec[names[0]] = Array(bad)
        elif kind == "inf":
            bad = first.copy()
            bad.flat[0] = np.inf
            rec[names[0]] = Array(bad)
        elif kind == "shape":
            rec[names[0]] = Array(np.zeros((3, 3), dtype=np.float32))
        elif kind == "dtype":
            rec[names[0]] = Array(first.astype(np.float64))
        elif kind == "missing":
            del rec[names[0]]
        elif kind == "extra-personal":
            rec["fc1.weight"] = Array(np.zeros((10, 128), dtype=np.float32))
        elif kind == "extra-record":
            reply.content["personal.0"] = ArrayRecord({"fc1.bias": Array(np.zeros(10, np.float32))})
        elif kind == "metric-type":
            reply.content[protocol.metrics_key(0)] = ConfigRecord({protocol.NUM_EXAMPLES: "many"})
        elif kind == "metric-nan":
            reply.content[protocol.metrics_key(0)] = MetricRecord({protocol.NUM_EXAMPLES: math.nan})
        elif kind == "error":
            return Message(Error(code=1, reason="client crashed"), reply_to=instruction)
        elif kind == "drop":
            return None
        return reply

    return fault


@pytest.mark.parametrize("kind", ["nan", "inf", "shape", "dtype", "missing", "extra-personal",
                                  "extra-record", "metric-type", "metric-nan", "error", "drop"])
def test_malformed_reply_is_dropped_with_reason(run_config, kind, caplog):
    run_config["num-rounds"] = 1
    strategy, grid, _ = run_inprocess(run_config, fault=_corrupt(kind))
    res = load_results(run_config["results-dir"])
    row = res["history"][0]
    assert row["dropped_owners"] >= 1
    assert row["valid_owners"] <= 3
    assert not row["skipped"]
    with np.load(f"{run_config['results-dir']}/model.npz") as npz:
        assert all(np.all(np.isfinite(npz[k])) for k in npz.files)
    assert "dropped reply" in caplog.text


def test_round_with_too_few_valid_replies_is_skipped_but_charged(run_config):
    run_config.update({"num-rounds": 2, "min-valid-fraction": 1.0})
    _, _, _ = run_inprocess(run_config, fault=_corrupt("nan"))
    res = load_results(run_config["results-dir"])
    assert all(r["skipped"] for r in res["history"])
    eps = [r["epsilon"] for r in res["history"]]
    assert eps[0] > 0 and eps[1] > eps[0]  # charged although nothing was released
