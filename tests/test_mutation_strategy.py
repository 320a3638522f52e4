"""JointDP's aggregation and noise, unit by unit (written for mutation testing,
docs/mutation.md): the noise the server adds against the event its ledger records,
the denominators, the charge before an instruction leaves, who is selected, the
calibration, the skip rule and the inner strategy's post-processing. No Flower run:
each test drives ``configure_train`` / ``aggregate_train`` of a strategy set up by
hand (what ``start`` does at set-up), in well under a second."""

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule, calibrate_schedule
from flwr_jdp.joint_dp.validation import NORM_SLACK, max_sampled_units, spec_of
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger, owner_scope
from flwr_jdp.strategies.joint_dp import JointDP

SHAPES = {"w": (40, 50), "b": (50,)}  # 2050 numbers: a std measured to ~3%


def _strategy(tmp_path, sizes, nodes=None, z=2.0, current=None, inner=None, ledger=None, **extra):
    """A JointDP as ``start`` leaves it after the set-up: owners ``sizes`` (owner ->
    records), hosted on ``nodes`` (owner -> node; default one node per owner)."""
    cfg = parse_config({"noise-multiplier": z, "results-dir": str(tmp_path), "num-owners": len(sizes),
                        "noise-seed": 3, "accountant": "rdp", **extra})
    strategy = JointDP(cfg, inner=inner, ledger=ledger)
    strategy.sizes = {o: OwnerSize(n, max(1, n // 2)) for o, n in sizes.items()}
    strategy.owner_node = dict(nodes or {o: 100 + o for o in sizes})
    strategy.schedule = build_schedule(cfg, strategy.sizes)
    strategy._current = protocol.to_record(current or {k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
    strategy.spec = spec_of(strategy._current)
    return strategy


def _replies(strategy, messages, updates, weights=None):
    """One reply per node to the instructions ``messages``, carrying ``updates[o]``
    (name -> array) for each owner it was asked for."""
    out = []
    for msg in messages:
        content = RecordDict()
        for o in msg.content[protocol.CONFIG][protocol.OWNERS]:
            content[protocol.owner_key(o)] = ArrayRecord(
                {k: Array(np.asarray(v, np.float32)) for k, v in updates[o].items()})
            content[protocol.metrics_key(o)] = MetricRecord(
                {protocol.NUM_EXAMPLES: (weights or {}).get(o, strategy.sizes[o].num_records)})
        out.append(Message(content, reply_to=msg))
    return out


def _round(strategy, updates, server_round=1, weights=None, noiseless=False):
    """configure_train, then aggregate_train of the replies ``updates``; ``noiseless``:
    the server adds no noise (z = 0 after the round was charged at the configured z)."""
    InProcessGrid(None, 0, {})  # sets the task identity Messages are stamped with
    messages = list(strategy.configure_train(server_round, strategy._current, ConfigRecord(), None))
    if noiseless:
        strategy.noise_multiplier = 0.0
    return messages, strategy.aggregate_train(server_round, _replies(strategy, messages, updates, weights))


def _zeros():
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def _flat(record) -> np.ndarray:
    return np.concatenate([record[k].numpy().astype(np.float64).ravel() for k in SHAPES])


def _recorded_gaussian(strategy, scope=SERVER_SCOPE):
    """(noise multiplier, sampling rate) of the one event the ledger holds for ``scope``."""
    ((data, count),) = strategy.ledger.scopes[scope]
    assert count == 1
    event, q = ev.from_dict(data), 1.0
    while hasattr(event, "event"):  # self-composed and Poisson-sampled events wrap the Gaussian
        q = getattr(event, "sampling_probability", q)
        event = event.event
    return float(event.noise_multiplier), float(q)


def _assert_std(values: np.ndarray, expected: float):
    tol = 6 / math.sqrt(2 * values.size)
    assert tol < 0.15
    assert float(values.std()) == pytest.approx(expected, rel=tol)
    assert abs(float(values.mean())) <= 6 * expected / math.sqrt(values.size)


# ------------------------------------------------------------------ central noise
def test_record_unit_central_noise_is_lr_z_c_over_the_expected_batch_recorded_in_the_ledger(tmp_path):
    """Every clipped gradient sum zero: the new shared parameters are the server's
    noise step alone, ``-lr N(0, (z C)^2) / (q N)`` with z and q those of the event
    the ledger recorded for the round (and sent to the owners)."""
    strategy = _strategy(tmp_path, {0: 300, 1: 100, 2: 200}, z=2.0, **{
        "privacy-unit": "record", "noise-placement": "central", "clipping-norm": 0.7,
        "learning-rate": 0.3, "batch-size": 30})
    messages, (new, info) = _round(strategy, {o: _zeros() for o in range(3)})
    z, q = _recorded_gaussian(strategy)
    assert z == 2.0 and q == pytest.approx(strategy.schedule.server_rate) and q == pytest.approx(90 / 600)
    assert {m.content[protocol.CONFIG][protocol.NOISE_MULTIPLIER] for m in messages} == {2.0}
    assert info["valid-owners"] == 3 and info["zeroed-owners"] == 0
    _assert_std(_flat(new), 0.3 * z * 0.7 / (q * 600))


def test_owner_unit_central_noise_is_server_lr_z_c_over_the_expected_owners(tmp_path):
    strategy = _strategy(tmp_path, {o: 20 for o in range(4)}, z=1.5, **{
        "privacy-unit": "owner", "noise-placement": "central", "clipping-norm": 0.4,
        "server-learning-rate": 0.5})
    _, (new, _) = _round(strategy, {o: _zeros() for o in range(4)})
    z, q = _recorded_gaussian(strategy)
    assert z == 1.5 and q == 1.0
    _assert_std(_flat(new), 0.5 * z * 0.4 / 4)


def test_central_sum_with_no_noise_is_the_reclipped_sum_over_the_expected_count(tmp_path):
    """Noiseless (z = 0 set after the set-up) the aggregate is exact: the grad-sum
    step ``current - lr * sum / (q N)`` with every owner's sum re-clipped to
    ``C * max_sampled_units`` (an honest sum passes unchanged), the owner-unit step
    ``current + server_lr * sum / (fraction * owners)`` with each update clipped to C."""
    rng = np.random.default_rng(0)
    current = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    strategy = _strategy(tmp_path, {0: 60, 1: 30}, current=dict(current), **{
        "privacy-unit": "record", "noise-placement": "central", "clipping-norm": 0.5,
        "learning-rate": 2.0, "batch-size": 9})
    q = strategy.schedule.server_rate
    bound0 = 0.5 * max_sampled_units(60, q)
    small = {k: (v * 1e-3).astype(np.float32) for k, v in current.items()}  # well inside its bound
    big = {k: rng.normal(size=s).astype(np.float32) * 100 for k, s in SHAPES.items()}
    _, (new, _) = _round(strategy, {0: big, 1: small}, noiseless=True)
    norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in big.values()))
    bound1 = 0.5 * max_sampled_units(30, q)
    assert 1e-3 * math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in current.values())) < bound1
    for k in SHAPES:
        total = big[k].astype(np.float64) * bound0 / (norm + 1e-6) + small[k]
        np.testing.assert_allclose(new[k].numpy(), current[k] - 2.0 * total / (q * 90), rtol=1e-5, atol=1e-7)
        assert new[k].numpy().dtype == np.float32

    owner = _strategy(tmp_path, {o: 5 for o in range(3)}, current=dict(current), **{
        "privacy-unit": "owner", "noise-placement": "central", "clipping-norm": 0.5,
        "server-learning-rate": 0.8})
    within = {k: (v * 0.5 * (1 + NORM_SLACK / 2) / norm).astype(np.float32) for k, v in big.items()}
    norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in within.values()))
    assert norm > 0.5
    _, (new, info) = _round(owner, {0: within, 1: small, 2: _zeros()}, noiseless=True)
    assert info["zeroed-owners"] == 0
    for k in SHAPES:
        total = within[k].astype(np.float64) * 0.5 / (norm + 1e-6) + small[k]
        np.testing.assert_allclose(new[k].numpy(), current[k] + 0.8 * total / 3, rtol=1e-5, atol=1e-7)


def test_central_owner_sum_divides_by_the_expected_not_the_received_count(tmp_path):
    """fraction-train 0.5 of 4 owners: the expected count is 2 (a public number), not
    the number of owners that replied."""
    strategy = _strategy(tmp_path, {o: 5 for o in range(4)}, **{
        "privacy-unit": "owner", "noise-placement": "central", "clipping-norm": 1.0,
        "fraction-train": 0.5, "min-valid-fraction": 0.0, "noise-multiplier": 1.0})
    one = {"w": np.full(SHAPES["w"], 1e-4, np.float32), "b": np.zeros(50, np.float32)}
    for rnd in range(1, 20):
        strategy.rng = np.random.default_rng(rnd)
        strategy.noise_multiplier = 1.0
        messages, (new, info) = _round(strategy, {o: one for o in range(4)}, server_round=rnd, noiseless=True)
        asked = sum(len(m.content[protocol.CONFIG][protocol.OWNERS]) for m in messages)
        if asked not in (0, 2):
            break
    assert asked not in (0, 2), "no round asked 1 or 3 owners"
    np.testing.assert_allclose(new["w"].numpy(), np.full(SHAPES["w"], 1e-4 * asked / 2), rtol=1e-5)


# ---------------------------------------------------------------- without noise at the server
def test_local_owner_unit_averages_the_noised_deltas_times_the_server_lr(tmp_path):
    rng = np.random.default_rng(1)
    current = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    strategy = _strategy(tmp_path, {o: 8 for o in range(3)}, current=dict(current), **{
        "privacy-unit": "owner", "noise-placement": "local", "server-learning-rate": 0.6})
    updates = {o: {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for o in range(3)}
    _, (new, info) = _round(strategy, updates)
    assert info["valid-owners"] == 3
    for k in SHAPES:
        mean = sum(updates[o][k].astype(np.float64) for o in range(3)) / 3
        np.testing.assert_allclose(new[k].numpy(), current[k] + 0.6 * mean, rtol=1e-5, atol=1e-6)
    z, q = _recorded_gaussian(strategy, owner_scope(1))
    assert (z, q) == (2.0, 1.0) and SERVER_SCOPE not in strategy.ledger.scopes


def test_local_record_unit_is_the_average_weighted_by_each_owners_examples(tmp_path):
    strategy = _strategy(tmp_path, {0: 10, 1: 30}, **{"privacy-unit": "record", "noise-placement": "local"})
    a = {k: np.full(s, 1.0, np.float32) for k, s in SHAPES.items()}
    b = {k: np.full(s, 5.0, np.float32) for k, s in SHAPES.items()}
    _, (new, _) = _round(strategy, {0: a, 1: b}, weights={0: 10, 1: 30})
    for k in SHAPES:
        np.testing.assert_allclose(new[k].numpy(), np.full(SHAPES[k], 4.0), rtol=1e-6)
        assert new[k].numpy().dtype == np.float32


# ------------------------------------------------------------------ the charge and the instruction
def test_each_round_is_charged_before_its_instructions_leave_with_its_own_z_and_rates(tmp_path):
    strategy = _strategy(tmp_path, {0: 40, 1: 80, 2: 160}, nodes={0: 7, 1: 7, 2: 9}, z=1.3, **{
        "privacy-unit": "record", "noise-placement": "local", "batch-size": 20, "local-epochs": 1})
    InProcessGrid(None, 0, {})
    messages = list(strategy.configure_train(4, strategy._current, ConfigRecord({"lr": 0.1}), None))
    assert [r["round"] for r in strategy.ledger.rounds] == [4]  # charged when the messages exist
    assert strategy.ledger.rounds[0]["note"] == "3 owners"
    assert sorted(m.metadata.dst_node_id for m in messages) == [7, 9]
    by_node = {m.metadata.dst_node_id: m.content[protocol.CONFIG] for m in messages}
    assert list(by_node[7][protocol.OWNERS]) == [0, 1] and list(by_node[9][protocol.OWNERS]) == [2]
    for m in messages:
        rec = m.content[protocol.CONFIG]
        owners = list(rec[protocol.OWNERS])
        assert list(rec[protocol.SAMPLE_RATES]) == [strategy.schedule.owner_rates[o] for o in owners]
        assert list(rec[protocol.STEPS]) == [strategy.schedule.owner_steps[o] for o in owners]
        assert rec[protocol.NOISE_MULTIPLIER] == 1.3 and rec[protocol.ROUND] == 4
        assert rec[protocol.SESSION] == strategy.session and rec["lr"] == 0.1
        assert m.content[protocol.SHARED] is strategy._current
    assert strategy.schedule.owner_rates == {0: 0.5, 1: 0.25, 2: 0.125}
    for o in range(3):
        z, q = _recorded_gaussian(strategy, owner_scope(o))
        assert z == 1.3 and q == strategy.schedule.owner_rates[o]
    assert strategy._requested == {7: [0, 1], 9: [2]}


def test_grad_sum_instructions_ask_one_step_at_the_servers_rate(tmp_path):
    strategy = _strategy(tmp_path, {0: 40, 1: 80}, **{
        "privacy-unit": "record", "noise-placement": "central", "batch-size": 12})
    InProcessGrid(None, 0, {})
    messages = list(strategy.configure_train(1, strategy._current, ConfigRecord(), None))
    for m in messages:
        rec = m.content[protocol.CONFIG]
        assert list(rec[protocol.SAMPLE_RATES]) == [strategy.schedule.server_rate] == [24 / 120]
        assert list(rec[protocol.STEPS]) == [1]


def test_a_round_over_the_budget_is_refused_and_not_charged(tmp_path):
    """Also with a ledger of a larger budget of its own: the run's target-epsilon caps it."""
    for ledger in (None, PrivacyLedger(delta=1e-5, accountant="rdp", unit="owner", budget=None)):
        strategy = _strategy(tmp_path, {0: 40, 1: 40}, z=3.0, ledger=ledger, **{
            "privacy-unit": "owner", "noise-placement": "local", "target-epsilon": 3.0})
        InProcessGrid(None, 0, {})
        rounds = 0
        with pytest.raises(PrivacyBudgetExhausted, match="target-epsilon=3.0") as refused:
            for rounds in range(1, 50):
                strategy.configure_train(rounds, strategy._current, ConfigRecord(), None)
        assert len(strategy.ledger.rounds) == rounds - 1 >= 1
        assert strategy.ledger.epsilon() <= 3.0
        spent = float(str(refused.value).split("would spend epsilon=")[1].split(" ")[0])
        assert spent > 3.0  # the epsilon the refused round would have reached


def test_configure_train_outside_start_is_refused(tmp_path):
    strategy = _strategy(tmp_path, {0: 10})
    strategy.schedule = None
    with pytest.raises(Exception, match="own start"):
        strategy.configure_train(1, strategy._current, ConfigRecord(), None)


# ------------------------------------------------------------------ selection and calibration
def test_owner_unit_selects_a_random_fraction_of_the_owners_and_charges_only_them(tmp_path):
    sizes = {o: 3 for o in range(200)}
    strategy = _strategy(tmp_path, sizes, **{
        "privacy-unit": "owner", "noise-placement": "local", "fraction-train": 0.3})
    InProcessGrid(None, 0, {})
    messages = list(strategy.configure_train(1, strategy._current, ConfigRecord(), None))
    chosen = sorted(o for m in messages for o in m.content[protocol.CONFIG][protocol.OWNERS])
    assert 30 <= len(chosen) <= 90 and len(set(chosen)) == len(chosen)
    assert sorted(strategy.ledger.scopes) == sorted(owner_scope(o) for o in chosen)
    again = [strategy._select() for _ in range(3)]
    assert len({tuple(s) for s in again}) > 1  # a fresh draw every round
    assert all(s == sorted(s) for s in again)

    full = _strategy(tmp_path, {3: 9, 1: 9, 2: 9}, **{"privacy-unit": "owner", "noise-placement": "local"})
    assert full._select() == [1, 2, 3]


def test_the_noise_multiplier_is_calibrated_only_when_asked(tmp_path):
    strategy = _strategy(tmp_path, {0: 100, 1: 100}, z=0.0, **{"privacy-unit": "record", "target-epsilon": 2.0})
    strategy._calibrate()
    assert strategy.noise_multiplier == calibrate_schedule(strategy.cfg, strategy.schedule) > 0
    fixed = _strategy(tmp_path, {0: 100, 1: 100}, z=1.7, **{"privacy-unit": "record"})
    fixed._calibrate()
    assert fixed.noise_multiplier == 1.7
    fedavg = _strategy(tmp_path, {0: 100, 1: 100}, z=0.0, method="fedavg")
    fedavg._calibrate()
    assert fedavg.noise_multiplier == 0.0


# ------------------------------------------------------------------ skipping and post-processing
def test_too_few_valid_replies_skip_the_round_but_enough_do_not(tmp_path):
    strategy = _strategy(tmp_path, {o: 5 for o in range(4)}, **{
        "privacy-unit": "owner", "noise-placement": "local", "min-valid-fraction": 0.5})
    InProcessGrid(None, 0, {})
    messages = list(strategy.configure_train(1, strategy._current, ConfigRecord(), None))
    two = _replies(strategy, [m for m in messages if m.metadata.dst_node_id in (100, 101)],
                   {o: _zeros() for o in range(4)})
    new, info = strategy.aggregate_train(1, two)  # 2 of 4 = ceil(0.5 * 4): enough
    assert new is not None and info["valid-owners"] == 2 and info["dropped-owners"] == 2
    assert "skipped" not in strategy.last_round_info
    one = _replies(strategy, [m for m in messages if m.metadata.dst_node_id == 100], {0: _zeros()})
    new, info = strategy.aggregate_train(1, one)
    assert new is None and strategy.last_round_info["skipped"] is True
    assert len(strategy.last_drop_reasons) == 3 and all("no reply" in r for r in strategy.last_drop_reasons)
    assert info["valid-owners"] == 1 and info["dropped-owners"] == 3 and info["zeroed-owners"] == 0


def test_min_valid_fraction_zero_still_needs_one_reply(tmp_path):
    strategy = _strategy(tmp_path, {0: 5, 1: 5}, **{
        "privacy-unit": "owner", "noise-placement": "local", "min-valid-fraction": 0.0})
    InProcessGrid(None, 0, {})
    strategy.configure_train(1, strategy._current, ConfigRecord(), None)
    new, info = strategy.aggregate_train(1, [])
    assert new is None and info["valid-owners"] == 0


def test_per_silo_shares_nothing_and_returns_the_current_arrays(tmp_path):
    strategy = _strategy(tmp_path, {0: 5, 1: 5}, method="per-silo")
    strategy.spec = {}
    InProcessGrid(None, 0, {})
    messages = list(strategy.configure_train(1, strategy._current, ConfigRecord(), None))
    new, info = strategy.aggregate_train(1, _replies(strategy, messages, {0: {}, 1: {}}))
    assert new is strategy._current and info["valid-owners"] == 2


def test_the_inner_strategy_steps_on_the_dp_aggregate_and_keeps_the_dtype(tmp_path):
    current = {"w": np.full(SHAPES["w"], 1.0, np.float32), "b": np.zeros(50, np.float32)}
    target = {k: np.full(s, 3.0, np.float32) for k, s in SHAPES.items()}  # the DP aggregate

    def released(inner):
        strategy = _strategy(tmp_path, {0: 5}, current=dict(current), inner=inner,
                             **{"privacy-unit": "owner", "noise-placement": "local"})
        return strategy._post_process(1, protocol.to_record(target))

    for inner in (None, FedAvg()):
        out = released(inner)
        np.testing.assert_array_equal(out["w"].numpy(), target["w"])

    momentum = released(FedAvgM(server_momentum=0.9, server_learning_rate=0.5))
    # FedAvgM from `current`: pseudo-gradient current - aggregate, step 0.5
    np.testing.assert_allclose(momentum["w"].numpy(), 1.0 - 0.5 * (1.0 - 3.0), rtol=1e-6)
    np.testing.assert_allclose(momentum["b"].numpy(), 0.0 - 0.5 * (0.0 - 3.0), rtol=1e-6)

    adam = released(FedAdam(eta=0.1, tau=1e-9))
    w = adam["w"].numpy()
    assert w.dtype == np.float32 and set(adam.keys()) == set(SHAPES)
    # one Adam step from `current` towards the aggregate: +eta (bias uncorrected: <= eta)
    assert np.all(w > 1.0) and np.all(w <= 1.0 + 0.1 + 1e-6)


def test_each_dropped_reply_is_logged_with_its_owner_node_and_cause(tmp_path, caplog):
    """The operator's account of a round: which owner (and node) was dropped and why
    (no reply, refused by the owner, an error reply, an invalid reply)."""
    import logging

    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    strategy = _strategy(tmp_path, {o: 5 for o in range(4)}, **{
        "privacy-unit": "owner", "noise-placement": "local", "min-valid-fraction": 0.0})
    InProcessGrid(None, 0, {})
    messages = {m.metadata.dst_node_id: m for m in
                strategy.configure_train(1, strategy._current, ConfigRecord(), None)}
    replies = [
        Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="refused: too little noise"),
                reply_to=messages[101]),
        Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="out of memory"), reply_to=messages[102]),
        *_replies(strategy, [messages[103]], {3: {"w": np.zeros(3, np.float32)}}),
    ]
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
    lines = [r.getMessage() for r in caplog.records if "dropped reply" in r.getMessage()]
    assert len(lines) == 4
    causes = {0: "no reply within round-timeout", 1: "refused by the owner", 2: "error reply", 3: "invalid reply"}
    for o, cause in causes.items():
        (line,) = [x for x in lines if x.startswith(f"round 1: dropped reply of owner {o} (node {100 + o}), ")]
        rest = line.split(", ", 1)[1]
        assert rest.startswith(cause + ": ")  # then validate_replies' reason, naming the owner or node
        assert f"owner {o}:" in rest or f"owner {o} (" in rest or f"node {100 + o} " in rest
    assert any(x.endswith("refused: too little noise") for x in lines)
