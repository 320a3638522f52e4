"""The server re-clips what it noises; invalid central updates become zero; a
non-finite record gets a zero gradient in the DP trainers (issue items 6a-6c)."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.joint_dp.validation import NORM_SLACK, max_sampled_units, spec_of
from flwr_jdp.models import SeedCNN
from flwr_jdp.params import split_parameters
from flwr_jdp.privacy.mechanisms import clip_float64, global_norm_numpy, reclipped_sum
from flwr_jdp.strategies import JointDP
from flwr_jdp.training import dp_sgd
from flwr_jdp.training.dp_sgd import UnitBatch, clipped_unit_sum

from .helpers import run_inprocess

SHAPES = {"conv.weight": (4, 1, 3, 3), "fc2.bias": (10,)}
C = 0.5


# ---------------------------------------------------------------- re-clipping
def test_reclip_is_exact_and_non_expansive():
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = [rng.normal(size=(7, 3)).astype(np.float32) * rng.uniform(0.01, 5), rng.normal(size=4)]
        y = [a + rng.normal(size=a.shape) * rng.uniform(0, 2) for a in x]
        cx, cy = clip_float64(x, C), clip_float64(y, C)
        assert all(a.dtype == np.float64 for a in cx)
        assert global_norm_numpy(cx) <= C  # exactly, in float64: no slack
        diff = global_norm_numpy([a - b for a, b in zip(cx, cy)])
        assert diff <= global_norm_numpy([np.float64(a) - b for a, b in zip(x, y)]) * (1 + 1e-12)
    total, over = reclipped_sum({0: [np.full(4, 1.0)], 1: [np.full(4, 0.01)]}, {0: C, 1: C})
    assert set(over) == {0} and over[0] == pytest.approx(2.0)
    assert total[0] == pytest.approx(np.full(4, C / 2 * 2.0 / (2.0 + 1e-6)) + 0.01)


def test_max_sampled_units_bounds_honest_poisson_samples():
    rng = np.random.default_rng(1)
    for n, q in [(100, 0.04), (600, 0.1), (20, 0.5), (5, 0.9)]:
        bound = max_sampled_units(n, q)
        assert n * q <= bound <= n
        assert rng.binomial(n, q, size=200_000).max() <= bound
    assert max_sampled_units(37, 1.0) == 37 and max_sampled_units(0, 0.3) == 0


# ----------------------------------------------------- the server's aggregation
def _strategy(unit, sizes, tmp_path, **extra):
    cfg = parse_config({"privacy-unit": unit, "noise-placement": "central", "noise-multiplier": 1.0,
                        "results-dir": str(tmp_path), "num-owners": len(sizes), **extra})
    strategy = JointDP(cfg)
    strategy.noise_multiplier = 0.0  # noiseless, to check the aggregate itself
    strategy.sizes = {o: OwnerSize(n, n) for o, n in sizes.items()}
    strategy.owner_node = {o: 100 + o for o in sizes}  # one node per owner
    strategy.schedule = build_schedule(cfg, strategy.sizes)
    current = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    strategy._current = protocol.to_record(current)
    strategy.spec = spec_of(strategy._current)
    strategy._requested = {100 + o: [o] for o in sizes}
    return strategy


def _replies(updates):
    """One reply per owner (node 100 + o) carrying ``updates[o]`` (arrays or a record)."""
    InProcessGrid(None, 0, {})  # sets the task identity Messages are stamped with
    out = []
    for o, arrays in updates.items():
        instruction = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=100 + o,
                              message_type=MessageType.TRAIN)
        rec = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(
            {k: Array(np.asarray(v, np.float32)) for k, v in zip(SHAPES, arrays)})
        content = RecordDict({protocol.owner_key(o): rec,
                              protocol.metrics_key(o): MetricRecord({protocol.NUM_EXAMPLES: 10})})
        out.append(Message(content, reply_to=instruction))
    return out


def _direction(rng, norm):
    arrays = [rng.normal(size=s) for s in SHAPES.values()]
    scale = norm / global_norm_numpy(arrays)
    return [(a * scale).astype(np.float32) for a in arrays]


def test_owner_unit_central_reclips_to_c_and_zeroes_invalid_updates(tmp_path, caplog):
    rng = np.random.default_rng(2)
    strategy = _strategy("owner", {o: 50 for o in range(5)}, tmp_path, **{"clipping-norm": C})
    within = _direction(rng, C * (1 + NORM_SLACK / 2))  # accepted, but above C
    good = _direction(rng, C * 0.3)
    nan = _direction(rng, C * 0.5)
    nan[0].flat[3] = np.nan
    updates = {0: within, 1: good, 2: nan, 3: _direction(rng, 4 * C),
               4: ArrayRecord({"conv.weight": Array(np.zeros(3, np.float32))})}  # malformed
    with caplog.at_level(logging.WARNING):
        new, info = strategy.aggregate_train(1, _replies(updates))
    assert info["zeroed-owners"] == 2 and info["dropped-owners"] == 1 and info["valid-owners"] == 4
    assert "replaced an invalid update by zero" in caplog.text and "NaN or Inf" in caplog.text
    assert "exceeds the clipping norm" in caplog.text and "dropped reply" in caplog.text
    expected = 5.0  # fraction-train 1: every owner expected, zeroed ones included
    want = [(w * (C / (global_norm_numpy(within) + 1e-6)) + g) / expected
            for w, g in zip(clip_float64(within, np.inf), clip_float64(good, np.inf))]
    got = [new[k].numpy() for k in SHAPES]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_grad_sum_central_reclips_to_the_sample_bound_and_zeroes_nan(tmp_path, caplog):
    rng = np.random.default_rng(3)
    strategy = _strategy("record", {0: 80, 1: 80, 2: 80}, tmp_path,
                         **{"clipping-norm": C, "batch-size": 8, "learning-rate": 1.0})
    q = strategy.schedule.server_rate
    bound = C * max_sampled_units(80, q)
    huge = _direction(rng, 3 * bound)
    honest = _direction(rng, 2.5 * C)
    nan = _direction(rng, C)
    nan[1].flat[0] = np.inf
    with caplog.at_level(logging.WARNING):
        new, info = strategy.aggregate_train(1, _replies({0: huge, 1: honest, 2: nan}))
    assert info["zeroed-owners"] == 1 and info["valid-owners"] == 3
    assert "re-clipped to the bound" in caplog.text
    denominator = q * 240
    want = [-(h * (bound / (global_norm_numpy(huge) + 1e-6)) + g) / denominator
            for h, g in zip(clip_float64(huge, np.inf), clip_float64(honest, np.inf))]
    for a, b in zip([new[k].numpy() for k in SHAPES], want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_zeroed_updates_count_for_min_valid_fraction_malformed_ones_do_not(tmp_path):
    rng = np.random.default_rng(4)
    strategy = _strategy("owner", {0: 9, 1: 9}, tmp_path, **{"min-valid-fraction": 1.0})
    bad = _direction(rng, 0.1)
    bad[0].flat[0] = np.nan
    new, info = strategy.aggregate_train(1, _replies({0: _direction(rng, 0.1), 1: bad}))
    assert new is not None and not strategy.last_round_info.get("skipped")
    malformed = ArrayRecord({"conv.weight": Array(np.zeros(2, np.float32))})
    new, info = strategy.aggregate_train(2, _replies({0: _direction(rng, 0.1), 1: malformed}))
    assert new is None and strategy.last_round_info["skipped"]


def test_local_placement_still_drops_non_finite_replies(tmp_path):
    rng = np.random.default_rng(5)
    strategy = _strategy("owner", {0: 9, 1: 9}, tmp_path, **{"noise-placement": "local"})
    bad = _direction(rng, 0.1)
    bad[0].flat[0] = np.nan
    _, info = strategy.aggregate_train(1, _replies({0: _direction(rng, 0.1), 1: bad}))
    assert info["dropped-owners"] == 1 and info["zeroed-owners"] == 0


def test_central_run_with_a_nan_reply_zeroes_it_and_stays_finite(run_config, caplog):
    run_config.update({"noise-placement": "central", "num-rounds": 1})

    def fault(instruction, reply):
        key = protocol.owner_key(0)
        if instruction.metadata.message_type == "train" and key in reply.content:
            rec = reply.content[key]
            name = next(iter(rec.keys()))
            bad = rec[name].numpy().copy()
            bad.flat[0] = np.nan
            rec[name] = Array(bad)
        return reply

    with caplog.at_level(logging.WARNING):
        _, _, result = run_inprocess(run_config, fault=fault)
    metrics = result.train_metrics_clientapp[1]
    assert metrics["zeroed-owners"] == 1 and metrics["dropped-owners"] == 0
    assert all(np.all(np.isfinite(a.numpy())) for a in result.arrays.values())
    assert "replaced an invalid update by zero: owner 0" in caplog.text


# ------------------------------------------------- non-finite per-unit gradients
def _model_and_data(n=10, seed=0):
    torch.manual_seed(seed)
    model = SeedCNN(1, 8, 10)
    split = split_parameters(model, r"^fc1\.")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    return model, split, x, y


def test_clipped_unit_sum_zeroes_a_non_finite_row():
    shared = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    g = [torch.randn(4, 3), torch.randn(4, 2, 2)]
    for p, gs in zip(shared, g):
        p.grad_sample = gs.clone()
    shared[1].grad_sample[2, 0, 1] = float("nan")
    batch = UnitBatch(torch.arange(4), torch.arange(4), 4)
    got = clipped_unit_sum(shared, batch, 1.0)
    for p, gs in zip(shared, g):
        p.grad_sample = gs[[0, 1, 3]].clone()
    want = clipped_unit_sum(shared, UnitBatch(torch.arange(3), torch.arange(3), 3), 1.0)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_central_clipped_sum_ignores_a_corrupt_record(value):
    """Record unit, q = 1: the sum with a NaN/Inf record equals the sum without it."""
    model, split, x, y = _model_and_data()
    bad = x.copy()
    bad[4, 0, 3, 3] = value
    gen = torch.Generator().manual_seed(0)
    sums, _ = dp_sgd.clipped_gradient_sum(model, split, bad, y, user_ids=None, clipping_norm=C,
                                          sample_rate=1.0, generator=gen)
    keep = np.arange(len(y)) != 4
    ref, _ = dp_sgd.clipped_gradient_sum(model, split, x[keep], y[keep], user_ids=None,
                                         clipping_norm=C, sample_rate=1.0, generator=gen)
    for a, b in zip(sums, ref):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("unit,personal_lr", [("record", 0.0), ("user", 0.0), ("record", 0.1)])
def test_dp_sgd_with_a_nan_record_stays_finite(unit, personal_lr):
    model, split, x, y = _model_and_data(12)
    x[2, 0, 0, 0] = np.nan
    users = np.repeat(np.arange(4), 3) if unit == "user" else None
    dp_sgd.train_dp_sgd(model, split, x, y, user_ids=users, noise_multiplier=1.0, clipping_norm=C,
                        sample_rate=1.0, steps=2, lr=0.1, personal_lr=personal_lr,
                        generator=torch.Generator().manual_seed(1))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if unit == "user":
        sums, _ = dp_sgd.clipped_gradient_sum(model, split, x, y, user_ids=users, clipping_norm=C,
                                              sample_rate=1.0, generator=torch.Generator())
        assert global_norm_numpy(sums) <= 4 * C * (1 + 1e-5)
