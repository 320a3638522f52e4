"""Owner budgets the server plans for (local noise): a node that caps its owners'
budget with node config ``max-epsilon`` reports the cap at set-up, and the server
asks those owners for a noise multiplier calibrated for the cap, records it in their
ledger scopes and says so, instead of sending the run's multiplier they refuse.

Through the real strategy and client half (flwr-jdp's own app, 4 owners on 2 nodes
behind ``hosting_mod``, or 2 owners on 2 nodes without it) on an in-process grid."""

from __future__ import annotations

import json
import logging

import dp_accounting as dpa
import pytest
from dp_accounting.pld import PLDAccountant
from flwr.app import ConfigRecord

from apps.joint_dp.joint_dp.client_app import app as client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.budgets import BudgetGroup, describe, node_max_epsilon
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_guard import Instruction, InstructionRefused, agreed_release
from flwr_jdp.joint_dp.owner_store import read_instructions
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule, calibrate_schedule
from flwr_jdp.strategies import JointDP, load_results

TARGET, CAP = 8.0, 1.0


def _config(tmp_path, **over):
    return {"num-owners": 4, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
            "results-dir": str(tmp_path / "results"), "noise-seed": 7, "noise-multiplier": 0.0,
            "target-epsilon": TARGET, **over}


class _Tampering(JointDP):
    """A server that rewrites the train instructions to the nodes ``tamper`` names."""

    def __init__(self, cfg, tamper):
        super().__init__(cfg, node_settle_s=0.0)
        self.tamper = tamper

    def configure_train(self, server_round, arrays, config, grid):
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for m in messages:
            self.tamper(m.metadata.dst_node_id, m.content[protocol.CONFIG])
        return messages


def _run(run_config, node_configs, tmp_path, tamper=None, nodes=2):
    # a node with a cap has a policy: it accepts this test's seeded noise only when the policy says so
    node_configs = {i: {"state-dir": str(tmp_path / f"node-{i}"), **node_configs.get(i, {}),
                        **({"seeded-noise": True} if "max-epsilon" in node_configs.get(i, {}) else {})}
                    for i in range(nodes)}
    grid = InProcessGrid(client_app, nodes, run_config, node_configs=node_configs)
    cfg = parse_config(run_config)
    strategy = _Tampering(cfg, tamper) if tamper else JointDP(cfg, node_settle_s=0.0)
    strategy.start(grid=grid, initial_arrays=initial_arrays(cfg))
    return strategy, grid


def _train_replies(grid):
    return [r for r in grid.sent if r.metadata.message_type == "train"]


def _owner_ledger_files(tmp_path, nodes=2):
    """Each owner's own ledger, as its node keeps it on its state-dir (under a policy the
    node's one ledger, ``ledger-node.json``: here only where node ``i`` hosts owner ``i`` alone)."""
    out = {}
    for i in range(nodes):
        for path in (tmp_path / f"node-{i}" / "owners").glob("ledger-*.json"):
            name = path.stem.split("-")[1]
            out[i if name == "node" else int(name)] = json.loads(path.read_text())
    return out


# -------------------------------------------------- an independent accountant
def _event(data: dict) -> dpa.DpEvent:
    """A recorded event (the ledger's JSON) rebuilt with dp_accounting's classes."""
    name = data["class_name"]
    if name == "GaussianDpEvent":
        return dpa.GaussianDpEvent(data["noise_multiplier"])
    if name == "PoissonSampledDpEvent":
        return dpa.PoissonSampledDpEvent(data["sampling_probability"], _event(data["event"]))
    if name == "SelfComposedDpEvent":
        return dpa.SelfComposedDpEvent(_event(data["event"]), data["count"])
    if name == "ComposedDpEvent":
        return dpa.ComposedDpEvent([_event(e) for e in data["events"]])
    raise AssertionError(f"unexpected event {name}")


def _recomputed_epsilon(history: list, delta: float) -> float:
    """Epsilon of a scope's recorded (event, count) history by dp_accounting's own PLD
    accountant (add/remove, the ledger's grid)."""
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    for data, count in history:
        accountant.compose(_event(data), int(count))
    return accountant.get_epsilon(delta)


def _noise_multipliers(history: list) -> set[float]:
    def walk(data):
        if data["class_name"] == "GaussianDpEvent":
            return {data["noise_multiplier"]}
        return set().union(*(walk(e) for e in ([data["event"]] if "event" in data else data["events"])))
    return set().union(*(walk(data) for data, _ in history))


# -------------------------------------------------- the plan, end to end
def test_a_capped_owner_is_planned_for_and_each_owner_reaches_its_own_budget(tmp_path, caplog):
    """Nodes 1 and 3 (one owner each: under a policy a node's owners share its ledger)
    cap their owners at epsilon 1 below the run's target 8; nodes 0 and 2 set a cap
    above the target, which changes nothing. Nobody
    refuses; each owner's scope (server ledger and the owner's own ledger on its
    state-dir) records its own multiplier, the capped owners end within and close to
    their cap, the others at the target; an independent PLD accountant agrees;
    results.json and one set-up line say which owners ran at which epsilon."""
    caplog.set_level(logging.INFO, logger="flwr")
    rc = _config(tmp_path)
    strategy, grid = _run(rc, {0: {"max-epsilon": 20.0}, 1: {"max-epsilon": CAP}, 2: {"max-epsilon": 20.0},
                               3: {"max-epsilon": CAP}}, tmp_path, nodes=4)

    replies = _train_replies(grid)
    assert len(replies) == 8 and not any(r.has_error() for r in replies)  # 4 nodes x 2 rounds
    results = load_results(rc["results-dir"])
    assert [row["valid_owners"] for row in results["history"]] == [4, 4]
    assert strategy.owner_caps == {0: 20.0, 1: CAP, 2: 20.0, 3: CAP}

    # the capped owners were asked for more noise, calibrated for their cap
    run_z = strategy.noise_multiplier
    capped_z = strategy.noise_of(1)
    assert strategy.noise_of(3) == capped_z > run_z and strategy.noise_of(0) == strategy.noise_of(2) == run_z

    own = _owner_ledger_files(tmp_path, nodes=4)
    assert sorted(own) == [0, 1, 2, 3]
    spent = {}
    for o in range(4):
        history = strategy.ledger.scopes[f"owner/{o}"]
        assert own[o]["scopes"]["self"] == history  # the owner recorded what the server did
        assert _noise_multipliers(history) == {capped_z if o in (1, 3) else run_z}
        spent[o] = strategy.ledger.scope_epsilon(f"owner/{o}")
        # (b) an independent recomputation of the recorded events agrees with both ledgers
        independent = _recomputed_epsilon(history, rc.get("delta", 1e-5))
        assert independent == pytest.approx(spent[o], rel=1e-3)
        assert own[o]["epsilon"] == pytest.approx(spent[o], rel=1e-9)
    for o in (1, 3):  # within the cap, the most exposed of them close to it
        assert spent[o] <= CAP * (1 + 1e-9)
    assert max(spent[1], spent[3]) >= 0.99 * CAP
    for o in (0, 2):
        assert spent[o] <= TARGET * (1 + 1e-9)
    assert max(spent[0], spent[2]) >= 0.99 * TARGET
    assert results["epsilon"] == pytest.approx(max(spent.values()))

    # (d) results.json lists the owners by budget, with the noise they added and what they spent
    groups = {g["budget"]: g for g in results["owner_budgets"]}
    assert sorted(groups) == [CAP, TARGET]
    assert groups[CAP]["owners"] == [1, 3] and groups[CAP]["capped"] is True
    assert groups[CAP]["noise_multiplier"] == capped_z
    assert groups[CAP]["epsilon"] == pytest.approx(max(spent[1], spent[3]))
    assert groups[TARGET]["owners"] == [0, 2] and groups[TARGET]["capped"] is False
    assert groups[TARGET]["noise_multiplier"] == run_z
    assert groups[TARGET]["epsilon"] == pytest.approx(max(spent[0], spent[2]))

    lines = [r.getMessage() for r in caplog.records if "owner budgets" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"owner budgets: 2 owners capped at epsilon 1 (noise multiplier {capped_z:.4g}), "
                             f"2 at 8 ({run_z:.4g})")


def test_a_capped_owner_refuses_a_tenth_of_its_noise(tmp_path):
    """(c) The server plans for the cap, then sends node 1's owners a tenth of the
    multiplier calibrated for them: they refuse (nothing trained, sent or charged);
    node 0's uncapped owners, asked honestly, train."""
    rc = _config(tmp_path)
    capped_node = 1001  # InProcessGrid's node of partition 1

    def tamper(node, rec):
        if node == capped_node:
            value = rec[protocol.NOISE_MULTIPLIER]
            rec[protocol.NOISE_MULTIPLIER] = ([v / 10 for v in value] if isinstance(value, list)
                                              else value / 10)

    strategy, grid = _run(rc, {1: {"max-epsilon": CAP}}, tmp_path, tamper=tamper)
    replies = {r.metadata.src_node_id: r for r in _train_replies(grid)}  # the last round's
    refused = [r for r in _train_replies(grid) if r.metadata.src_node_id == capped_node]
    assert refused and all(r.has_error() for r in refused)
    assert all("is too small" in r.error.reason and "owner's budget 1 " in r.error.reason for r in refused)
    assert not replies[1000].has_error()
    own = _owner_ledger_files(tmp_path)
    assert sorted(own) == [0, 2] and all(len(own[o]["rounds"]) == 2 for o in own)
    assert strategy.noise_of(1) > strategy.noise_of(0)


def test_a_fixed_noise_multiplier_that_breaks_a_cap_fails_at_start_up(tmp_path):
    """A fixed ``noise-multiplier`` is the noise the run was configured with: an owner
    it would take over its node's cap fails the start-up, naming the owners, their node
    and the keys, before anything is released; one it keeps within the cap is used."""
    rc = _config(tmp_path, **{"noise-multiplier": 1.0})
    caps = {1: {"max-epsilon": CAP}, 3: {"max-epsilon": CAP}}  # one owner per node: its cap is its own
    with pytest.raises(ConfigError) as err:
        _run(rc, caps, tmp_path, nodes=4)
    message = str(err.value)
    for part in ("owners [1, 3]", "nodes [1001, 1003]", "node config 'max-epsilon'", "'noise-multiplier'=1",
                 "'num-rounds'=2", "raise it to at least"):
        assert part in message, message
    assert _owner_ledger_files(tmp_path, nodes=4) == {}

    z = float(message.split("at least ")[1].split(",")[0]) * 1.01
    rc = _config(tmp_path / "met", **{"noise-multiplier": z})
    strategy, grid = _run(rc, caps, tmp_path / "met", nodes=4)
    assert not any(r.has_error() for r in _train_replies(grid))
    assert strategy.noise_of(1) == strategy.noise_of(0) == z
    spent = [strategy.ledger.scope_epsilon(f"owner/{o}") for o in (1, 3)]
    assert CAP * 0.9 < max(spent) <= CAP


@pytest.mark.parametrize("value", [-1.0, 0, "many", float("nan"), True])
def test_a_bad_cap_fails_at_start_up_naming_the_node_config_key(tmp_path, value):
    rc = _config(tmp_path, **{"num-owners": 2})
    with pytest.raises(RuntimeError, match="node 1001 failed at set-up: .*node config key 'max-epsilon' must be a "
                                           "number > 0"):
        _run(rc, {1: {"max-epsilon": value}}, tmp_path)


# -------------------------------------------------- the pieces
def test_node_caps_are_read_strictly():
    assert node_max_epsilon({}) is None
    assert node_max_epsilon({"max-epsilon": 2}) == 2.0
    assert node_max_epsilon({"max-epsilon": "0.5"}) == 0.5
    for bad in (0.0, -3, "x", float("inf"), False, [1.0]):
        with pytest.raises(ConfigError, match="node config key 'max-epsilon'"):
            node_max_epsilon({"max-epsilon": bad})


def test_the_noise_multiplier_is_one_value_or_one_per_owner():
    assert protocol.noise_value([1.5, 1.5]) == 1.5
    assert protocol.noise_value([1.5, 4.0]) == [1.5, 4.0]
    assert protocol.noise_multipliers(1.5, 3) == [1.5, 1.5, 1.5]
    assert protocol.noise_multipliers([1.5, 4.0], 2) == [1.5, 4.0]
    assert protocol.noise_multipliers([1.5], 2) is None
    cfg = parse_config({})
    rec = ConfigRecord({protocol.ROUND: 1, protocol.OWNERS: [4, 2], protocol.SAMPLE_RATES: [0.1, 0.2],
                        protocol.STEPS: [7, 9], protocol.NOISE_MULTIPLIER: [1.5, 4.0], protocol.SESSION: "s"})
    assert read_instructions(cfg, rec, [2, 4]) == {2: Instruction(1, 0.2, 9, 4.0), 4: Instruction(1, 0.1, 7, 1.5)}
    rec[protocol.NOISE_MULTIPLIER] = [1.5]
    with pytest.raises(InstructionRefused, match="2 owners but 1 noise multipliers"):
        read_instructions(cfg, rec, [2])


def test_the_guard_accepts_the_noise_planned_for_its_cap_and_refuses_a_tenth_of_it():
    cfg = parse_config({"noise-multiplier": 0.0, "target-epsilon": TARGET, "num-rounds": 3, "batch-size": 16})
    size = OwnerSize(160, 160)
    schedule = build_schedule(cfg, {0: size})
    z_cap = calibrate_schedule(parse_config({"noise-multiplier": 0.0, "target-epsilon": CAP, "num-rounds": 3,
                                             "batch-size": 16}), schedule)
    z_run = calibrate_schedule(cfg, schedule)
    agreed = agreed_release(cfg, size, CAP)
    rate, steps = schedule.owner_rates[0], schedule.owner_steps[0]
    assert agreed.check(Instruction(1, rate, steps, z_cap)) is None
    assert "is too small" in agreed.check(Instruction(1, rate, steps, z_run))  # the run's noise: over the cap
    assert "is too small" in agreed.check(Instruction(1, rate, steps, z_cap / 10))
    assert agreed_release(cfg, size, 2 * TARGET).check(Instruction(1, rate, steps, z_run)) is None


def test_the_set_up_line():
    groups = [BudgetGroup(0.5, True, 5.0, (3,)), BudgetGroup(1.0, True, 3.21, (1, 2)),
              BudgetGroup(8.0, False, 1.02, tuple(range(4, 18)))]
    assert describe(groups) == ("owner budgets: 1 owner capped at epsilon 0.5 (noise multiplier 5), 2 owners "
                                "capped at epsilon 1 (noise multiplier 3.21), 14 at 8 (1.02)")


def test_central_noise_does_not_plan_for_caps_and_says_so(tmp_path, caplog):
    """Under central noise one server-side mechanism covers every owner at the target:
    the caps are reported but not planned for, with one warning naming the owners (a
    node's policy must name central noise to trust the server with clipped sums). The
    capped node charges the server's claimed noise to its ledger, so it refuses the
    rounds that would take it over its cap (here the first); the uncapped owner trains."""
    rc = _config(tmp_path, **{"num-owners": 2, "num-rounds": 1, "noise-placement": "central"})
    strategy, grid = _run(rc, {1: {"max-epsilon": CAP, "noise-placements": "local,central"}}, tmp_path)
    assert strategy.owner_caps == {0: None, 1: CAP} and strategy.owner_noise == {}
    replies = _train_replies(grid)
    refused = [r for r in replies if r.has_error()]
    assert refused and len(refused) < len(replies)
    assert all("refused" in r.error.reason and "budget" in r.error.reason for r in refused), refused
    warned = [r.getMessage() for r in caplog.records if "max-epsilon" in r.getMessage()]
    assert len(warned) == 1 and "Owners [1]" in warned[0] and "not planned for" in warned[0]
    assert "owner_budgets" not in load_results(rc["results-dir"])
