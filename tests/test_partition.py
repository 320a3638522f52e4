"""Partitions: even sizes, at most k classes per owner, disjoint owners, test split by
the owner's classes, and a validation split carved from training data only."""

import numpy as np
import pytest

from flwr_jdp.data.partition import balanced_indices, load_partitions

from .helpers import load_example


@pytest.mark.parametrize("owners", [4, 16, 64, 256])
def test_balanced_split_is_even_disjoint_and_label_skewed(owners):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=30_000)
    idx, classes = balanced_indices(labels, owners, 8, 10_000, seed=3)
    sizes = [len(i) for i in idx]
    assert sum(sizes) == 10_000
    assert max(sizes) - min(sizes) <= 1
    flat = np.concatenate(idx)
    assert len(np.unique(flat)) == len(flat)  # no record held twice
    for i, cls in zip(idx, classes, strict=True):
        assert set(np.unique(labels[i]).tolist()) == set(cls)
        assert len(cls) <= 8


def test_balanced_split_fails_with_a_reason_when_a_class_is_short():
    labels = np.array([0] * 5 + [1] * 1000)
    with pytest.raises(ValueError, match="class 0 has only 5 records"):
        balanced_indices(labels, 2, 1, 400, seed=0)


def test_digits_owners_hold_at_most_8_classes_and_test_split_matches():
    owners = load_partitions("digits", "", 16, 8, 0, 1, 0, "balanced", 0.0)
    sizes = [len(o.y_train) for o in owners]
    assert max(sizes) - min(sizes) <= 1
    for o in owners:
        assert len(o.classes) <= 8
        assert set(np.unique(o.y_test).tolist()) <= set(o.classes)


def test_validation_split_comes_from_training_records_only():
    plain = load_partitions("digits", "", 4, 8, 0, 1, 0, "balanced", 0.0)
    val = load_partitions("digits", "", 4, 8, 0, 1, 0, "balanced", 0.25)
    for p, v in zip(plain, val, strict=True):
        assert len(v.y_train) + len(v.y_test) == len(p.y_train)
        train_rows = {row.tobytes() for row in p.x_train}
        assert all(row.tobytes() in train_rows for row in v.x_test)  # no test record used
        assert not {row.tobytes() for row in v.x_test} & {row.tobytes() for row in v.x_train}


def test_node_config_data_dir_overrides_the_run_config():
    from flwr.app import Context, RecordDict

    from apps.joint_dp.joint_dp.task import node_job_config

    ctx = Context(1, 5, {"partition-id": 0, "num-partitions": 1, "data-dir": "/data/on/this/node"},
                  RecordDict(), {"dataset": "fashion-mnist", "data-dir": "/data/default"})
    assert node_job_config(ctx).data_dir == "/data/on/this/node"
    ctx2 = Context(1, 5, {"partition-id": 0, "num-partitions": 1}, RecordDict(),
                   {"dataset": "fashion-mnist", "data-dir": "/data/default"})
    assert node_job_config(ctx2).data_dir == "/data/default"


@pytest.mark.parametrize("partitioner", ["balanced", "pathological"])
def test_pool_validation_uses_records_no_owner_holds_and_keeps_training_splits(partitioner):
    plain = load_partitions("digits", "", 8, 8, 600, 1, 0, partitioner, 0.0)
    pool = load_partitions("digits", "", 8, 8, 600, 1, 0, partitioner, 0.1, "pool")
    held = {row.tobytes() for o in plain for row in o.x_train}
    test = {row.tobytes() for o in plain for row in o.x_test}
    seen: set[bytes] = set()
    for p, v in zip(plain, pool, strict=True):
        assert np.array_equal(p.x_train, v.x_train) and np.array_equal(p.y_train, v.y_train)
        rows = {row.tobytes() for row in v.x_test}
        assert not rows & held and not rows & test and not rows & seen  # unused, disjoint
        seen |= rows
        assert set(np.unique(v.y_test).tolist()) <= set(p.classes)
        assert abs(len(v.y_test) - len(p.y_test)) <= 8  # dealt like the test split


def test_carved_validation_understates_the_owners_label_prior_and_pool_does_not():
    # ~19 training records per owner, as at n = 512 on 10,000 Fashion-MNIST records
    plain = load_partitions("digits", "", 32, 8, 600, 1, 0, "balanced", 0.0)
    carve = load_partitions("digits", "", 32, 8, 600, 1, 0, "balanced", 0.1, "carve")
    pool = load_partitions("digits", "", 32, 8, 600, 1, 0, "balanced", 0.1, "pool")
    share = load_example("joint_dp/validation_bias.py", "jdp_validation_bias").prior_of_evaluated_class
    on_test, on_carve, on_pool = (share(o) for o in (plain, carve, pool))
    assert on_carve < 0.8 * on_test  # a held-out record's class is left rarer
    assert abs(on_pool - on_test) < 0.01


def test_pool_validation_fails_naming_the_key_when_no_records_are_left():
    with pytest.raises(ValueError, match="validation-source"):
        load_partitions("digits", "", 4, 8, 0, 1, 0, "balanced", 0.1, "pool")


def test_validation_source_is_checked_at_start_up():
    from flwr_jdp.joint_dp.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="'validation-source'"):
        parse_config({"validation-source": "test"})
    with pytest.raises(ConfigError, match="'validation-source'.*validation-fraction"):
        parse_config({"validation-source": "pool"})
    assert parse_config({"validation-source": "pool", "validation-fraction": 0.1}).validation_source == "pool"
