"""Regression tests of the second privacy review's findings A3 and A4, the attacker's way.

A3 (deviating server, distributed noise): after a normal set-up the server sends an
ordinary train message, no SecAgg+ stage. An owner adds only a share of the Skellam
noise its ledger charges, so its vector may leave only summed and masked inside
flwr-jdp's secure sum: the train handler refuses the message before any charge or
encoding, and (second line) the reply guard lets no release out of a train reply
outside the secure sum.

A4 (run submitter, a node whose policy names ``central``): a central release is charged
to the node's one ledger as the event the trusted server claims to apply
(``PoissonSampled(q, Gaussian(z))``; owner unit ``Gaussian(z)``), so the policy's
``max-epsilon`` covers every run on the node's ``state-dir``, central ones included.
"""

from __future__ import annotations

import json

import dp_accounting as dpa
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.client import JointDPClient
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.privacy.rdp import ORDERS
from tests.test_distributed_noise import Probe, Spy, _rc, user_app
from tests.test_dropin import RC, Tiny, _loader, _setup_and_instruction, _sgd_train

Z, Q, SCALE, DELTA = 2.0, 0.3, 100.0, 1e-5


def _plain_distributed_train(tmp_path, owners: int, policy: dict) -> tuple[Message, Context]:
    """The A3 attack: set-up as usual, then a train message with no SecAgg+ stage."""
    rc = _rc(owners, **{"noise-seed": -1})
    app = user_app()
    InProcessGrid(app, 3, rc)  # stamps message identities
    node = {"partition-id": 0, "num-partitions": owners, "state-dir": str(tmp_path), **policy}
    ctx = Context(run_id=1, node_id=1000, node_config=node, state=RecordDict(), run_config=dict(rc))
    net = Probe()
    public = protocol.to_record({n: p.detach().numpy() for n, p in net.named_parameters() if n.startswith("head.")})
    shared = protocol.to_record({n: p.detach().numpy() for n, p in net.named_parameters() if n.startswith("body.")})
    setup = app(Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: public}),
                        dst_node_id=1000, message_type=MessageType.QUERY), ctx)
    assert setup.has_content(), setup.error.reason
    cfg = ConfigRecord({protocol.ROUND: 1, protocol.OWNERS: [0], protocol.SAMPLE_RATES: [Q], protocol.STEPS: [1],
                        protocol.NOISE_MULTIPLIER: Z, protocol.SESSION: "s1", protocol.SCALE: SCALE})
    plain = Message(RecordDict({protocol.SHARED: shared, protocol.CONFIG: cfg}), dst_node_id=1000,
                    message_type=MessageType.TRAIN)  # no secaggplus_configs: no masking at all
    return app(plain, ctx), ctx


POLICIES = [(3, {"max-epsilon": 8.0, "honest-owners": 3}), (16, {})]


@pytest.mark.parametrize(("owners", "policy"), POLICIES)
def test_a_train_message_outside_secagg_is_refused_before_any_charge(tmp_path, monkeypatch, owners, policy):
    spy = Spy(monkeypatch)
    reply, _ = _plain_distributed_train(tmp_path, owners, policy)
    assert reply.has_error(), "the owner answered a distributed train message outside the secure sum"
    assert "secure sum" in reply.error.reason and "distributed" in reply.error.reason
    assert spy.vectors == []  # nothing encoded: no noise share drawn, no data read into a release
    assert not list(tmp_path.glob("owners/ledger-*.json"))  # nothing charged


@pytest.mark.parametrize(("owners", "policy"), POLICIES)
def test_the_reply_guard_lets_no_field_vector_out_of_a_train_reply_outside_secagg(tmp_path, monkeypatch, owners,
                                                                                 policy):
    """Second line: with the train handler's check fooled (it believes it runs inside the
    secure sum), the node still sends no release outside it."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr("flwr_jdp.joint_dp.client.inside_secure_sum", lambda: True)
    reply, _ = _plain_distributed_train(tmp_path, owners, policy)
    assert len(spy.vectors) == 1  # the handler did encode its vector ...
    assert not reply.has_error()
    assert not [r for r in reply.content.values() if isinstance(r, ArrayRecord)]  # ... and none of it left


def _central_node(tmp_path, cap: float, unit: str = "record") -> dict:
    return {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path), "max-epsilon": cap,
            "noise-placements": ["local", "central"], "delta": DELTA, "privacy-unit": unit}


def _central_run(tmp_path, node: dict, run_id: int, rounds: int, z: float, q: float, unit: str = "record",
                 *, start: int = 1) -> list[bool]:
    """One central run on the node: ``rounds`` train messages; which were released."""
    rc = dict(RC, **{"jdp.noise-placement": "central", "jdp.num-rounds": rounds, "jdp.delta": DELTA,
                     "jdp.accountant": "rdp", "jdp.privacy-unit": unit})
    app = ClientApp()
    loader = _loader()
    jdp = JointDPClient(app, model_fn=Tiny, train_data=lambda ctx: loader)
    ctx = Context(run_id=run_id, node_id=7, node_config=node, state=RecordDict(), run_config=rc)
    released = []
    for rnd in range(start, start + rounds):
        _, _, train = _setup_and_instruction(app, ctx, z, q, 1, rnd=rnd)
        reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train())
        released.append(reply.has_content())
        if reply.has_error():
            assert reply.error.reason.startswith("refused:"), reply.error.reason
    return released


def test_twenty_central_releases_do_not_pass_a_cap_of_half_an_epsilon(tmp_path):
    """The review's reproduction: q = 1, z = 0.3, 20 rounds, a node cap of 0.5."""
    released = _central_run(tmp_path, _central_node(tmp_path, 0.5), 1, 20, 0.3, 1.0)
    assert not any(released)  # one such round alone is worth far more than 0.5
    assert not list((tmp_path / "owners").glob("ledger-*.json"))  # refused before anything was charged


def _rdp(event: dpa.DpEvent, count: int) -> float:
    """Epsilon of ``count`` compositions of ``event`` at DELTA, by dp_accounting's own RDP
    accountant (at the orders the ledger uses)."""
    return dpa.rdp.RdpAccountant(list(ORDERS)).compose(event, count).get_epsilon(DELTA)


@pytest.mark.parametrize(("unit", "z", "q", "event"), [
    ("record", 3.0, 0.5, dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(3.0))),
    ("owner", 4.0, 0.5, dpa.GaussianDpEvent(4.0)),  # the owner's clipped update: no amplification claimed
])
def test_central_runs_on_one_state_dir_compose_to_the_cap(tmp_path, unit, z, q, event):
    """Runs of two central rounds each, one after another on the node's state-dir (new
    run ids, fresh context state): the node releases exactly as many rounds as the
    cap allows for the server's claimed event, then refuses."""
    cap = 2.5
    node = _central_node(tmp_path, cap, unit)
    released = []
    for run in range(1, 13):
        released += _central_run(tmp_path, node, run, 2, z, q, unit)
    count = sum(released)
    assert released == [True] * count + [False] * (len(released) - count)  # refused from then on
    assert 0 < count < len(released)
    spent, more = _rdp(event, count), _rdp(event, count + 1)
    print(f"{unit}: {count} central rounds released under cap {cap}: eps {spent:.3f}, one more {more:.3f}")
    assert spent <= cap * (1 + 1e-3) and more > cap * (1 - 1e-3)  # exactly the rounds the cap allows
    ledger = json.loads((tmp_path / "owners" / "ledger-node.json").read_text())
    assert len(ledger["rounds"]) == count  # one node ledger, every run's central releases on it


def test_a_central_run_without_a_policy_is_not_charged_on_the_node(tmp_path):
    """Without a policy the run config is trusted: the server's ledger accounts central noise."""
    node = {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path)}
    assert all(_central_run(tmp_path, node, 1, 2, 1.0, 0.5))
    assert not list(tmp_path.glob("owners/ledger-*.json"))


def test_a_central_round_under_a_policy_refuses_more_than_one_step(tmp_path):
    """The owner makes one clipped sum per central round; a server asking for more steps
    (to be charged less per step?) is refused, as is a rate above 1."""
    node = _central_node(tmp_path, 8.0)
    rc = dict(RC, **{"jdp.noise-placement": "central", "jdp.delta": DELTA})
    app = ClientApp()
    loader = _loader()
    jdp = JointDPClient(app, model_fn=Tiny, train_data=lambda ctx: loader)
    ctx = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=rc)
    for q, steps in ((0.5, 3), (1.5, 1)):
        _, _, train = _setup_and_instruction(app, ctx, 1.0, q, steps)
        reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train())
        assert reply.has_error() and reply.error.reason.startswith("refused:"), reply
