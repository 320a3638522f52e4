"""Under local noise the owners enforce their own guarantee: a malicious server that
sends less noise, drops keys, raises the sampling rate or the steps, or asks for more
rounds than agreed gets refusals (error replies naming the reason), no release, and
no charge in the owners' own ledgers."""

import json

import pytest

from apps.joint_dp.joint_dp.client_app import app as client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_guard import Instruction, agreed_release
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.privacy.units import PrivacyUnit
from flwr_jdp.strategies import JointDP, load_results
from tests.helpers import own_state_dirs


class TamperingJointDP(JointDP):
    """A ServerApp strategy that rewrites its train instructions with ``tamper``."""

    def __init__(self, cfg, tamper, honest_budget=True):
        super().__init__(cfg, node_settle_s=0.0)
        self.tamper = tamper
        if not honest_budget:  # the server ignores its own budget
            self.ledger.would_exceed = lambda *a, **k: False

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for m in messages:
            self.tamper(server_round, m.content[protocol.CONFIG])
        return messages


def _run(run_config, tamper, server_rounds=None, honest_budget=True, node_config=None):
    """The owners run with ``run_config``; the server may plan ``server_rounds``."""
    cfg = parse_config(dict(run_config, **({"num-rounds": server_rounds} if server_rounds else {})))
    grid = InProcessGrid(client_app, 2, run_config, node_config=node_config,
                         node_configs=own_state_dirs(node_config or {}, 2))
    strategy = TamperingJointDP(cfg, tamper, honest_budget)
    strategy.start(grid=grid, initial_arrays=initial_arrays(parse_config(run_config)))
    return strategy, grid


def _train_replies(grid):
    return [r for r in grid.sent if r.metadata.message_type == "train"]


def _own_ledgers(grid):
    out = {}
    for ctx in grid.contexts.values():
        for key in ctx.state.keys():
            if key.startswith("ledger."):
                out[int(key.split(".")[1])] = json.loads(str(ctx.state[key]["state"]))
    return out


def _set(key, value):
    def tamper(_, rec):
        rec[key] = value
    return tamper


def _scale(key, factor):
    def tamper(_, rec):
        value = rec[key]
        rec[key] = [type(v)(v * factor) for v in value] if isinstance(value, list) else value * factor
    return tamper


def _drop(key):
    def tamper(_, rec):
        del rec[key]
    return tamper


@pytest.mark.parametrize("tamper, reason", [
    (_set(protocol.NOISE_MULTIPLIER, 0.0), "noise multiplier 0.0 is not a positive number"),
    (_scale(protocol.NOISE_MULTIPLIER, 0.5), "is below the agreed noise-multiplier"),
    (_scale(protocol.SAMPLE_RATES, 2.0), "is above the agreed"),
    (_scale(protocol.STEPS, 2), "steps per round, agreed at most"),
    (_drop(protocol.NOISE_MULTIPLIER), "lacks ['noise-multiplier']"),
    (_drop(protocol.SAMPLE_RATES), "lacks ['sample-rates']"),
    (_drop(protocol.STEPS), "lacks ['steps']"),
    (_set(protocol.ROUND, 7), "round 7 is outside the agreed 1..2"),
])
def test_owners_refuse_an_instruction_with_less_privacy_than_agreed(run_config, tamper, reason, caplog):
    strategy, grid = _run(run_config, tamper)
    replies = _train_replies(grid)
    assert replies and all(r.has_error() for r in replies)  # fail closed: nothing released
    assert all(reason in r.error.reason for r in replies), replies[0].error.reason
    assert not any(k.startswith("owner.") for r in replies if r.has_content() for k in r.content.keys())
    assert _own_ledgers(grid) == {}  # nothing charged by the owners either
    assert all(r["valid_owners"] == 0 for r in load_results(run_config["results-dir"])["history"])
    assert any("refused" in rec.getMessage() for rec in caplog.records)


def test_owners_refuse_a_calibrated_noise_multiplier_that_is_too_small(run_config):
    """The run calibrates z for the owners' target; a server that sends a smaller z
    (here: calibrated for a budget 4x larger) is refused."""
    run_config.update({"noise-multiplier": 0.0, "target-epsilon": 2.0})
    _, grid = _run(run_config, _scale(protocol.NOISE_MULTIPLIER, 0.3))
    replies = _train_replies(grid)
    assert replies and all(r.has_error() and "is too small" in r.error.reason for r in replies)


def test_honest_instructions_are_accepted_and_charged_by_each_owner(run_config):
    """The honest server's calibrated schedule passes every owner's check, and each
    owner's own ledger equals the server's scope of that owner."""
    run_config.update({"noise-multiplier": 0.0, "target-epsilon": 3.0})
    strategy, grid = _run(run_config, lambda *_: None)
    assert all(not r.has_error() for r in _train_replies(grid))
    own = _own_ledgers(grid)
    assert sorted(own) == [0, 1, 2, 3]
    for o, state in own.items():
        assert len(state["rounds"]) == 2
        assert state["epsilon"] <= 3.0 * (1 + 1e-9)
        assert state["scopes"]["self"] == strategy.ledger.scopes[f"owner/{o}"]


def test_owners_stop_at_their_budget_when_the_server_asks_for_more(run_config, tmp_path):
    """A server that plans six rounds where the owners agreed to two, ignores its
    budget and numbers every round 1: each owner releases while its own ledger stays
    within the target (two rounds' worth), then refuses."""
    honest = dict(run_config, **{"num-rounds": 2, "results-dir": str(tmp_path / "honest")})
    _, grid = _run(honest, lambda *_: None)
    two_rounds = max(state["epsilon"] for state in _own_ledgers(grid).values())
    run_config.update({"num-rounds": 2, "target-epsilon": two_rounds * (1 + 1e-6),
                       "max-skipped-rounds": 10})  # let the server go on asking
    _, grid = _run(run_config, _set(protocol.ROUND, 1), server_rounds=6, honest_budget=False)
    replies = _train_replies(grid)
    assert [r.has_error() for r in replies] == [False] * 4 + [True] * 8  # 2 nodes x 6 rounds
    assert all("owner's budget" in r.error.reason for r in replies if r.has_error())
    for state in _own_ledgers(grid).values():
        assert len(state["rounds"]) == 2 and state["epsilon"] <= two_rounds * (1 + 1e-6)


def test_a_node_cap_below_the_run_target_refuses_a_server_that_ignores_it(run_config, monkeypatch, tmp_path):
    """Node config ``max-epsilon`` caps the owner's budget below the run's target. The
    honest server plans for the cap it is told at set-up (``tests/test_owner_budgets.py``);
    a server that ignores it and sends the run's multiplier is refused."""
    monkeypatch.setattr(JointDP, "_plan_owner_budgets", lambda self: None)
    run_config.update({"noise-multiplier": 0.0, "target-epsilon": 8.0})
    node = {"max-epsilon": 1.0, "seeded-noise": True, "state-dir": str(tmp_path / "node")}
    _, grid = _run(run_config, lambda *_: None, node_config=node)
    replies = _train_replies(grid)
    assert replies and all(r.has_error() and "owner's budget 1" in r.error.reason for r in replies)


def test_agreed_release_follows_the_owners_own_size():
    cfg = parse_config({"batch-size": 16, "local-epochs": 2, "num-rounds": 3, "noise-multiplier": 1.0})
    agreed = agreed_release(cfg, OwnerSize(160, 160))
    assert agreed.max_sample_rate == pytest.approx(0.1) and agreed.max_steps == 20
    assert agreed.check(Instruction(1, 0.1, 20, 1.0)) is None
    assert agreed.check(Instruction(1, 0.05, 10, 2.0)) is None  # less is fine
    assert "steps" in agreed.check(Instruction(1, 0.1, 21, 1.0))
    user = parse_config({"privacy-unit": "user", "records-per-user": 4, "batch-size": 16,
                         "noise-multiplier": 1.0})
    assert agreed_release(user, OwnerSize(160, 40)).max_sample_rate == pytest.approx(0.1)
    owner = parse_config({"privacy-unit": "owner", "noise-multiplier": 1.0})
    assert agreed_release(owner, OwnerSize(160, 160)).unit is PrivacyUnit.OWNER
    central = agreed_release(parse_config({"noise-placement": "central", "noise-multiplier": 1.0}), OwnerSize(10, 10))
    assert central.max_steps == 1 and central.max_sample_rate == 1.0  # one clipped sum per round
    with pytest.raises(ValueError, match="agreed_distributed"):
        agreed_release(parse_config({"noise-placement": "distributed", "num-owners": 3}), OwnerSize(10, 10))


def test_owner_checks_use_the_runs_neighbouring_relation():
    """A noise multiplier calibrated under add/remove is too small for the same
    target under replace-one (one record moves a sum by up to 2C), and the owner's
    own check says so."""
    from flwr_jdp.joint_dp.schedule import build_schedule, calibrate_schedule

    base = {"noise-multiplier": 0.0, "target-epsilon": 2.0, "num-rounds": 2, "batch-size": 16}
    add_remove = parse_config(base)
    replace_one = parse_config(dict(base, neighbouring="replace-one"))
    size = OwnerSize(160, 160)
    z = calibrate_schedule(add_remove, build_schedule(add_remove, {0: size}))
    steps = agreed_release(add_remove, size).max_steps
    instruction = Instruction(1, 0.1, steps, z)
    assert agreed_release(add_remove, size).check(instruction) is None
    agreed = agreed_release(replace_one, size)
    assert agreed.neighbouring == "replace-one"
    assert "is too small" in agreed.check(instruction)
