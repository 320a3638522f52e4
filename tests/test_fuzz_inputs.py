"""Fuzzing: random malformed replies are each dropped with a reason (valid ones kept),
and random invalid run-configs fail at start-up with a ConfigError naming the key."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, JobConfig, parse_config
from flwr_jdp.joint_dp.validation import spec_of, validate_replies

SHAPES = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc2.weight": (10, 8)}


def _arrays(rng):
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _mutate(kind, arrays, metrics, rng):
    """Return (arrays dict or raw record, metrics record) broken in one way."""
    name = rng.choice(sorted(arrays))
    if kind == "nan":
        arrays[name].flat[rng.integers(arrays[name].size)] = np.nan
    elif kind == "inf":
        arrays[name].flat[rng.integers(arrays[name].size)] = -np.inf
    elif kind == "shape":
        arrays[name] = np.append(arrays[name].ravel(), np.float32(0.0))  # one value too many
    elif kind == "dtype":
        arrays[name] = arrays[name].astype(np.float64)
    elif kind == "extra-array":
        arrays["fc1.weight"] = rng.normal(size=(10, 8)).astype(np.float32)  # a personal layer
    elif kind == "missing-array":
        del arrays[name]
    elif kind == "huge-norm":
        arrays[name] = arrays[name] * np.float32(1e6)
    elif kind == "metric-type":
        metrics = MetricRecord({protocol.NUM_EXAMPLES: [1.0, 2.0]})
    elif kind == "metric-negative":
        metrics = MetricRecord({protocol.NUM_EXAMPLES: -5})
    elif kind == "metric-missing":
        metrics = MetricRecord({})
    elif kind == "not-arrays":
        return ConfigRecord({"x": 1}), metrics
    return {k: Array(v) for k, v in arrays.items()}, metrics


KINDS = ["nan", "inf", "shape", "dtype", "extra-array", "missing-array", "huge-norm", "metric-type",
         "metric-negative", "metric-missing", "not-arrays"]


@pytest.mark.parametrize("seed", range(20))
def test_random_malformed_replies_are_dropped_with_a_reason(seed):
    InProcessGrid(None, 0, {})  # sets the task identity that Messages are stamped with
    rng = np.random.default_rng(seed)
    global_arrays = protocol.to_record(_arrays(rng))
    spec = spec_of(global_arrays)
    requested, replies, broken = {}, [], {}
    for node in range(1, 9):
        owners = [2 * node, 2 * node + 1]
        requested[node] = owners
        instruction = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=node,
                              message_type=MessageType.TRAIN)
        content = RecordDict()
        for o in owners:
            arrays = {k: v * np.float32(1e-3) for k, v in _arrays(rng).items()}  # small, valid updates
            metrics = MetricRecord({protocol.NUM_EXAMPLES: 10})
            if rng.random() < 0.5:
                kind = KINDS[rng.integers(len(KINDS))]
                broken[o] = kind
                rec, metrics = _mutate(kind, arrays, metrics, rng)
                content[protocol.owner_key(o)] = rec if isinstance(rec, ConfigRecord) else ArrayRecord(rec)
            else:
                content[protocol.owner_key(o)] = protocol.to_record(arrays)
            content[protocol.metrics_key(o)] = metrics
        replies.append(Message(content, reply_to=instruction))
    valid = validate_replies(replies, requested, spec, max_norm=1.0)
    for o, kind in broken.items():
        assert o in valid.dropped, f"{kind} reply of owner {o} was accepted"
        assert o not in valid.arrays and valid.dropped[o]
    accepted = {o for owners in requested.values() for o in owners} - set(broken)
    assert set(valid.arrays) == accepted


def _random_invalid(rng):
    """One (key, invalid value) pair."""
    choices = [
        ("target-epsilon", float(-rng.random() * 10)), ("target-epsilon", float("inf")),
        ("delta", float(1 + rng.random())), ("delta", 0.0), ("clipping-norm", float(-rng.random())),
        ("num-owners", int(-rng.integers(0, 100))), ("num-rounds", 0), ("local-epochs", 0),
        ("batch-size", "sixteen"), ("learning-rate", float("nan")), ("privacy-unit", "planet"),
        ("noise-placement", "anywhere"), ("accountant", "zcdp"), ("dataset", "imagenet"),
        ("norm", "batch"), ("partitioner", "random"), ("validation-fraction", 1.5),
        ("fraction-train", 0.0), ("min-valid-fraction", -0.1), ("noise-multiplier", -1.0),
        ("max-records", -3), ("method", "secure"), ("resume", "maybe"),
    ]
    return choices[rng.integers(len(choices))]


@pytest.mark.parametrize("seed", range(40))
def test_random_invalid_configs_fail_at_startup_naming_the_key(seed):
    rng = np.random.default_rng(seed)
    key, value = _random_invalid(rng)
    cfg = {k.replace("_", "-"): v for k, v in JobConfig().to_dict().items()}
    cfg[key] = value
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert f"'{key}'" in str(err.value)
