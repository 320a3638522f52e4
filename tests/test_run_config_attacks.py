"""Every run-config key a run submitter sets, tried the way an attacker would.

A node's policy caps its owners at ε = 1 (δ 1e-5, record unit, add/remove). The run
submitter then sets one key to a value chosen against the owners, and the server
hides the cap from its own planning (its set-up replies report none), so it plans the
noise of the run's target. Whatever happens (a refusal, a failed run, a completed
one), each owner's ledger on its node (the node's one ledger under its policy; one owner per
node here, each node its own state-dir), recomputed by dp_accounting's own PLD
accountant from the events it holds, stays within the cap, and every release that
left an owner is in its ledger (charged before it left).

Keys that only steer the server's post-processing or its liveness (step sizes,
averaging, time-outs, where results go) leave what an owner releases and charges
unchanged: the owners' ledgers are the same, event for event, as a run without them.

The threat table of docs/guarantees.md names these tests for those keys.
"""

from __future__ import annotations

import json

import dp_accounting as dpa
import pytest
from flwr.app import MessageType

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.privacy.events import from_dict
from flwr_jdp.strategies import JointDP
from tests.helpers import own_state_dirs
from tests.test_distributed_noise import RECORDS, _initial, _rc, user_app

CAP, DELTA, OWNERS = 1.0, 1e-5, 3


def _hide_cap(msg, reply):  # noqa: ANN001, ANN202
    """The server plans as if no owner had a cap."""
    if msg.metadata.message_type == MessageType.QUERY and not reply.has_error():
        reply.content[protocol.SETUP][protocol.MAX_EPSILON] = [0.0]
    return reply


def _run(tmp_path, hide_cap: bool = True, **over: object) -> InProcessGrid:
    rc = _rc(OWNERS, **{"noise-placement": "local", "noise-multiplier": 0.0, "num-rounds": 3, "accountant": "rdp",
                        "target-epsilon": 50.0, "max-skipped-rounds": 1, "results-dir": str(tmp_path / "results"),
                        **over})
    node = {"state-dir": str(tmp_path / "node"), "max-epsilon": CAP, "seeded-noise": True}
    grid = InProcessGrid(user_app(), OWNERS, rc, node_config=node, fault=_hide_cap if hide_cap else None,
                         errors_as_replies=True, node_configs=own_state_dirs(node, OWNERS))
    try:
        JointDP.from_run_config(rc, node_settle_s=0.0).start(grid=grid, initial_arrays=_initial())
    except Exception:  # noqa: BLE001 - a run the owners refuse ends as failed: what matters is their ledgers
        pass
    return grid


def _ledgers(tmp_path) -> dict[int, dict]:
    """Each node's ledger (``<state-dir>/<i>/owners/ledger-node.json``), by the node's partition id."""
    return {i: json.loads(path.read_text()) for i in range(OWNERS)
            if (path := tmp_path / "node" / str(i) / "owners" / "ledger-node.json").is_file()}


def _events(state: dict) -> list[dpa.DpEvent]:
    """The owner's recorded releases: each distinct event with its count."""
    return [dpa.SelfComposedDpEvent(from_dict(d), int(c)) for scope in state["scopes"].values() for d, c in scope]


def _pld_epsilon(events: list[dpa.DpEvent], delta: float) -> float:
    """dp_accounting's PLD accountant, on its own, over an owner's recorded events."""
    if not events:
        return 0.0
    acc = dpa.pld.PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dpa.ComposedDpEvent(events))
    return acc.get_epsilon(delta)


def _released(grid: InProcessGrid) -> dict[int, int]:
    """Train replies that carried a release, per owner (one owner per node here)."""
    counts: dict[int, int] = {}
    for reply in grid.sent:
        if reply.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            node = reply.metadata.src_node_id
            counts[node] = counts.get(node, 0) + 1
    return counts


#: A value of each key chosen against the owners: more rounds, more steps, a larger
#: sampling rate, less noise, a larger clip, another accountant, another split of the
#: parameters, everything shared.
ATTACKS = [
    ("num-rounds", 40), ("local-epochs", 20), ("batch-size", RECORDS), ("noise-multiplier", 0.3),
    ("target-epsilon", 1e4), ("clipping-norm", 1e4), ("accountant", "pld"), ("num-owners", 2),
    ("personal-layers", r"^body\."), ("method", "full-dp"), ("user-batch-size", 4.0),
]


@pytest.mark.parametrize("server", ["hides-caps", "plans-caps"])
@pytest.mark.parametrize(("key", "value"), ATTACKS, ids=[k for k, _ in ATTACKS])
def test_a_submitters_key_cannot_take_an_owner_past_its_policy(tmp_path, key, value, server):
    """The server either hides the caps (it plans the run's target: the owners refuse)
    or plans for them (the owners release, within their cap)."""
    grid = _run(tmp_path, hide_cap=server == "hides-caps", **{key: value})
    ledgers = _ledgers(tmp_path)
    for owner, state in ledgers.items():
        assert state["delta"] == DELTA and state["unit"] == "record" and state["neighbouring"] == "add-remove"
        spent = _pld_epsilon(_events(state), DELTA)
        assert spent <= CAP * (1 + 1e-6), f"owner {owner}: epsilon {spent} > cap {CAP} with {key}={value!r}"
    released = _released(grid)
    charged = {1000 + owner: len(state["rounds"]) for owner, state in ledgers.items()}
    assert all(released.get(node, 0) <= charged.get(node, 0) for node in released), (released, charged)


#: Keys that steer only the server (its step, averaging, liveness, files) or the
#: owner's local, unsent computation.
POST_PROCESSING = [
    ("learning-rate", 100.0), ("server-learning-rate", 0.01), ("ema-decay", 0.9), ("min-valid-fraction", 1.0),
    ("round-timeout", 5.0), ("max-skipped-rounds", 5), ("resume", False), ("secure-noise", True),
]


SAME = {"target-epsilon": 0.8, "num-rounds": 2, "noise-seed": -1}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The owners' ledgers after a run without any of the keys below (run once)."""
    base = tmp_path_factory.mktemp("base")
    _run(base, **SAME)
    return _ledgers(base)


@pytest.mark.parametrize(("key", "value"), POST_PROCESSING, ids=[k for k, _ in POST_PROCESSING])
def test_a_post_processing_key_leaves_the_owners_charges_unchanged(tmp_path, baseline, key, value):
    other = tmp_path / "other"
    _run(other, **{**SAME, key: value})
    a, b = baseline, _ledgers(other)
    assert a and a.keys() == b.keys()
    for owner in a:
        assert a[owner]["scopes"]["self"] and a[owner]["scopes"] == b[owner]["scopes"], (key, owner)
        assert len(a[owner]["rounds"]) == len(b[owner]["rounds"]) == 2


def test_the_attacks_release_where_the_server_plans_for_the_caps(tmp_path):
    """The attack test is not vacuous: with the caps planned for, owners release and
    their ledgers reach the cap."""
    _run(tmp_path, hide_cap=False, **{"batch-size": RECORDS})
    spent = [_pld_epsilon(_events(s), DELTA) for s in _ledgers(tmp_path).values()]
    assert len(spent) == OWNERS and all(0.5 * CAP < e <= CAP * (1 + 1e-6) for e in spent), spent
