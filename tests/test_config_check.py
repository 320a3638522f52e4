"""Every system's run config is checked by one helper (:mod:`flwr_jdp.config_check`):
a bad value fails at start-up naming the key and its allowed range in the same words."""

import re
from dataclasses import dataclass

import pytest

from flwr_jdp.altmin.config import parse_altmin_config
from flwr_jdp.config_check import coerce, namespace, need, parse_dataclass
from flwr_jdp.joint_dp.config import ConfigError, namespaced_config, parse_config
from flwr_jdp.mtl.config import namespaced_mtl_config, parse_mtl_config
from flwr_jdp.subject.config import parse_subject_config


def _says(key: str, allowed: str, value) -> str:
    return re.escape(f"run-config key '{key}' must be {allowed}, got {value!r}")


@pytest.mark.parametrize("parse,run_config,key,allowed,value", [
    (parse_config, {"delta": 1.0}, "delta", "in (0, 1)", 1.0),
    (namespaced_config, {"jdp.clipping-norm": 0.0}, "jdp.clipping-norm", "> 0 and finite", 0.0),
    (parse_mtl_config, {"radius": -1.0}, "radius", "> 0 and finite (the ball radius B)", -1.0),
    (parse_mtl_config, {"dim": 0}, "dim", ">= 1", 0),  # synthetic task keys (mtl/tasks.py)
    (parse_mtl_config, {"pool": 0}, "pool", ">= 1", 0),  # task source keys
    (namespaced_mtl_config, {"jdp.delta": 2.0}, "jdp.delta", "in (0, 1)", 2.0),
    (namespaced_mtl_config, {"jdp.num-tasks": 1}, "jdp.num-tasks", "0 (one task per node) or >= 2", 1),
    (parse_subject_config, {"seq-len": 0}, "seq-len", "in [1, 1000]", 0),
    (parse_altmin_config, {"rank": 60, "dim": 50}, "rank", "in [1, dim] = [1, 50]", 60),  # problem keys
    (parse_altmin_config, {"clip-decay": 2.0}, "clip-decay", "in (0, 1]", 2.0),
    (parse_altmin_config, {"a-share": 1.0}, "a-share", "in (0, 1)", 1.0),
])
def test_each_system_names_the_key_and_range(parse, run_config, key, allowed, value):
    with pytest.raises(ConfigError, match=_says(key, allowed, value)):
        parse(run_config)


@pytest.mark.parametrize("parse,key", [
    (parse_config, "batch-size"), (parse_mtl_config, "rounds"), (parse_subject_config, "batch-size"),
    (parse_altmin_config, "epochs"), (parse_altmin_config, "noise-seed"),
])
def test_each_system_names_a_mistyped_key(parse, key):
    with pytest.raises(ConfigError, match=_says(key, "of type int", "many")):
        parse({key: "many"})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError, match=_says("x", ">= 0", -1)):
        need(False, "x", ">= 0", -1)
    need(True, "x", ">= 0", 1)


def test_coerce_matches_parse_config():
    assert coerce("k", "false", True) is False and coerce("k", "TRUE", False) is True
    assert coerce("k", 3.0, 1) == 3 and coerce("k", "3", 1) == 3 and coerce("k", 2, 0.5) == 2.0
    assert coerce("k", 5, "") == "5"
    for bad, default in (("maybe", True), (True, 1), (2.5, 1), (float("inf"), 1), (True, 0.5), ("x", 0.5)):
        with pytest.raises(ConfigError, match="'k' must be of type"):
            coerce("k", bad, default)


@dataclass(frozen=True)
class _Knobs:
    rate: float = 0.1
    steps: int = 1
    on: bool = False
    name: str = "a"

    def __post_init__(self) -> None:
        need(self.steps >= 1, "steps", ">= 1", self.steps)


def test_parse_dataclass_fields_prefix_and_unknown_keys():
    knobs = parse_dataclass(_Knobs, {"rate": "0.5", "steps": 2.0, "on": "true", "other": 1})
    assert knobs == _Knobs(0.5, 2, True, "a")
    assert parse_dataclass(_Knobs, {"steps": 9, "app.steps": 3}, prefix="app.").steps == 3
    with pytest.raises(ConfigError, match=_says("app.steps", ">= 1", 0)):
        parse_dataclass(_Knobs, {"app.steps": 0}, prefix="app.")
    with pytest.raises(ConfigError, match=_says("app.rate", "of type float", "x")):
        parse_dataclass(_Knobs, {"app.rate": "x"}, prefix="app.")
    assert namespace({"app.steps": 3, "steps": 1}, "app.", ("steps", "rate")) == {"steps": 3}
    with pytest.raises(ConfigError, match="unknown run-config key 'app.nope'; flwr-jdp's keys are app.rate"):
        namespace({"app.nope": 3}, "app.", ("steps", "rate"))
