"""The owner's ledger and policy against four attacks of an independent review, each
turned around: the attack is tried and must fail.

- Concurrent runs: several runs served by one node at the same time (each with its
  own ``context.state``) all charge the one ledger file, under a lock that holds
  across processes; what they release together stays within the policy's cap.
- ``owners_mod`` with a run-chosen ``num-owners``: under a node's policy every owner
  the node hosts, whatever the run calls it, charges the node's one ledger; the
  per-owner ledgers of releases made without a policy are composed in.
- A policy without ``state-dir``: refused at set-up and at train, naming the key.
- Evaluation of a run the policy refuses: an error reply, no metrics, the app's
  handler never called (the joint-DP client and the NumPyClient route).
"""

from __future__ import annotations

import json
import multiprocessing

import dp_accounting as dpa
import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from flwr_jdp.client import JointDPClient, numpy_client_app, owners_mod
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import owner_id
from flwr_jdp.joint_dp.owner_guard import Instruction, InstructionRefused, agreed_release
from flwr_jdp.joint_dp.owner_store import OWNER_LEDGERS, charge_owners, load_owner_ledger
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.guard import NODE_LEDGER, AgreedRelease, charge
from flwr_jdp.privacy.policy import RunTerms, run_policy
from flwr_jdp.strategies import JointDP
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.silo_guard import silo_policy
from tests.test_distributed_noise import Probe, _data, _initial, _rc, _train_fn, user_app
from tests.test_dropin import RC, Tiny, _loader, _sgd_train
from tests.test_mutation_owner_store import _ctx, _local_cfg
from tests.test_run_config_attacks import _events, _pld_epsilon

CAP = 1.0


def _node_ledger(root) -> dict:
    return json.loads((root / "owners" / "ledger-node.json").read_text())


# ------------------------------------------------------------------ 1. concurrent runs
def _tiny_app() -> ClientApp:
    app = ClientApp()
    loader = _loader()
    jdp = JointDPClient(app, model_fn=Tiny, train_data=lambda ctx: loader)

    @app.train()
    def train(msg, context):  # noqa: ANN001, ANN202
        return jdp.train(msg, context, Tiny(), loader, _sgd_train())

    return app


def test_interleaved_runs_on_one_node_charge_one_ledger_within_the_cap(tmp_path):
    """Four runs on one node (cap 1, a state-dir), interleaved round by round, each its
    own context.state and session: together they release no more than the cap allows,
    and the node's ledger file holds every release (the review's attack: 1.91 released,
    0.993 on file)."""
    z, q, steps = 3.0, 0.2, 2
    node = {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path / "node"), "max-epsilon": CAP}
    rc = dict(RC, **{"jdp.noise-multiplier": z, "jdp.num-rounds": 100, "jdp.target-epsilon": 50.0})
    app = _tiny_app()
    InProcessGrid(app, 1, rc)  # stamps message identities
    net = Tiny()
    public = protocol.to_record({n: p.detach().numpy() for n, p in net.named_parameters() if n.startswith("head.")})
    shared = protocol.to_record({n: p.detach().numpy() for n, p in net.named_parameters() if n.startswith("body.")})
    runs = [Context(run_id=r, node_id=7, node_config=dict(node), state=RecordDict(), run_config=dict(rc))
            for r in (1, 2, 3, 4)]
    for ctx in runs:
        setup = Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: public}),
                        dst_node_id=7, message_type=MessageType.QUERY)
        assert app(setup, ctx).has_content()
    released = 0
    for rnd in range(1, 100):
        replies = []
        for i, ctx in enumerate(runs):
            cfg = ConfigRecord({protocol.ROUND: rnd, protocol.OWNERS: [0], protocol.SAMPLE_RATES: [q],
                                protocol.STEPS: [steps], protocol.NOISE_MULTIPLIER: z, protocol.SESSION: f"s{i}"})
            msg = Message(RecordDict({protocol.SHARED: shared, protocol.CONFIG: cfg}), dst_node_id=7,
                          message_type=MessageType.TRAIN)
            replies.append(app(msg, ctx))
        released += sum(r.has_content() for r in replies)
        if all(r.has_error() for r in replies):
            break
    assert released >= 4  # every run released before the cap was reached
    total = epsilon(dpa.SelfComposedDpEvent(ev.dp_sgd(z, q, steps), released), 1e-5, "pld")
    assert total <= CAP * (1 + 1e-9)
    state = _node_ledger(tmp_path / "node")
    assert len(state["rounds"]) == released and {r["note"] for r in state["rounds"]} >= {f"session s{i} (owners [0])"
                                                                                       for i in range(4)}
    assert _pld_epsilon(_events(state), 1e-5) <= CAP * (1 + 1e-6)
    assert not any(k.startswith("ledger.") for ctx in runs for k in ctx.state.keys())  # the file is the only truth


def _charge_many(root: str, start, rounds: int) -> None:  # noqa: ANN001
    ctx = Context(run_id=0, node_id=1, node_config={"state-dir": root}, state=RecordDict(), run_config={})
    agreed = AgreedRelease(unit="record", max_sample_rate=0.1, max_steps=1, fixed_noise=1.0, rounds=10**6,
                           budget=1e9, delta=1e-5, accountant="rdp")
    start.wait()
    for rnd in range(1, rounds + 1):
        charge(ctx, OWNER_LEDGERS, {0: (agreed, Instruction(rnd, 0.1, 1, 1.0))}, "record", node_ledger=True)


def test_charges_from_several_processes_at_once_are_all_on_file(tmp_path):
    """A SuperNode runs each run's ClientApp in its own process: four processes charging
    the same ledger at once lose none of each other's releases (the lock is the
    file's, not the process's)."""
    procs, rounds = 4, 12
    mp = multiprocessing.get_context("fork")
    start = mp.Barrier(procs)
    workers = [mp.Process(target=_charge_many, args=(str(tmp_path), start, rounds)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * procs
    state = _node_ledger(tmp_path)
    assert len(state["rounds"]) == procs * rounds
    assert state["scopes"]["self"][0][1] == procs * rounds  # the one event, counted once per release


# ------------------------------------------------------------------ 2. owners_mod and num-owners
def _owners_app(released: list) -> ClientApp:
    """A user's app behind owners_mod: the records each owner loads follow the run's
    ``num-owners`` (its partition-id of num-partitions)."""
    x = np.random.default_rng(7).normal(size=(48, 32)).astype(np.float32)

    def load(context: Context):  # noqa: ANN202
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        p, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        part = torch.from_numpy(x[p * 48 // n:(p + 1) * 48 // n])
        return DataLoader(TensorDataset(part, torch.zeros(len(part), dtype=torch.long)), batch_size=8)

    app = ClientApp(mods=[owners_mod])
    jdp = JointDPClient(app, model_fn=Probe, train_data=load)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = jdp.train(msg, context, Probe(), load(context), _train_fn)
        if not reply.has_error():
            released.append(owner_id(context))
        return reply

    return app


def test_a_run_chosen_num_owners_charges_the_nodes_one_ledger(tmp_path):
    """The review's attack: runs with num-owners 2, then 4, on one node (cap 1) give every
    record of the node fresh per-owner ledgers. Under the policy every owner charges the
    node's one ledger: each release is in it, and all together stay within the cap. Each
    hosted owner reports its share of the cap at set-up (cap / 2), so the honest first
    run completes."""
    node = {"state-dir": str(tmp_path / "node"), "max-epsilon": CAP, "seeded-noise": True, "num-partitions": 1}
    released: list[int] = []
    app = _owners_app(released)
    for run, owners in enumerate((2, 4)):
        rc = _rc(owners, **{"noise-placement": "local", "noise-multiplier": 0.0, "num-rounds": 2,
                            "accountant": "rdp", "target-epsilon": 8.0, "max-skipped-rounds": 1,
                            "results-dir": str(tmp_path / f"results-{run}")})
        grid = InProcessGrid(app, 1, rc, node_config=node, errors_as_replies=True)
        strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
        try:
            strategy.start(grid=grid, initial_arrays=_initial())
        except RuntimeError:  # the second run: the node's ledger is full
            assert run == 1
        if run == 0:
            assert strategy.status == "completed" and strategy.owner_caps == {0: CAP / 2, 1: CAP / 2}
            assert sorted(released) == [0, 0, 1, 1]
    files = sorted(p.name for p in (tmp_path / "node" / "owners").glob("ledger-*.json"))
    assert files == ["ledger-node.json"]  # no owner id, old or new, has a ledger of its own
    state = _node_ledger(tmp_path / "node")
    assert len(state["rounds"]) == len(released) >= 4
    assert _pld_epsilon(_events(state), 1e-5) <= CAP * (1 + 1e-6)


def test_under_a_policy_any_owner_id_charges_the_same_ledger_and_without_one_each_its_own(tmp_path):
    """An owner id the node does not control (a run's partition, or the Flower node id a
    node without partition-id falls back to) does not select a fresh budget under a
    policy; without a policy each owner keeps its own ledger."""
    cfg = _local_cfg(**{"num-rounds": 100, "target-epsilon": 50.0, "noise-multiplier": 2.0})
    sizes = {o: OwnerSize(100, 100) for o in (0, 1007)}
    policy = _ctx({"state-dir": str(tmp_path / "policy"), "max-epsilon": CAP})
    charged = 0
    with pytest.raises(InstructionRefused, match=r"owners \[0\] \(this node's owners' ledger\).*node's budget 1"):
        for rnd in range(1, 100):
            charge_owners(cfg, policy, sizes, {0: Instruction(rnd, 0.1, 10, 2.0)}, "s")
            charged += 1
    assert charged >= 1
    with pytest.raises(InstructionRefused, match=r"owners \[1007\].*node's budget 1"):
        charge_owners(cfg, policy, sizes, {1007: Instruction(1, 0.1, 10, 2.0)}, "s")
    assert len(_node_ledger(tmp_path / "policy")["rounds"]) == charged

    trusting = _ctx({"state-dir": str(tmp_path / "trust")})
    for o in (0, 1007):
        charge_owners(cfg, trusting, sizes, {o: Instruction(1, 0.1, 10, 2.0)}, "s")
    assert sorted(p.name for p in (tmp_path / "trust" / "owners").glob("ledger-*.json")) == [
        "ledger-0.json", "ledger-1007.json"]


def test_the_nodes_ledger_composes_the_per_owner_ledgers_beside_it(tmp_path):
    """Releases made without a policy (per-owner ledgers) count against a policy set
    later on the same state-dir: the node's ledger composes them in."""
    cfg = _local_cfg(**{"num-rounds": 100, "target-epsilon": 50.0, "noise-multiplier": 2.0})
    sizes = {0: OwnerSize(100, 100), 1: OwnerSize(100, 100)}
    root = str(tmp_path)
    for rnd in (1, 2):
        charge_owners(cfg, _ctx({"state-dir": root}), sizes, {o: Instruction(rnd, 0.1, 10, 2.0) for o in (0, 1)}, "s")
    before = [load_owner_ledger(_ctx({"state-dir": root}), o, agreed_release(cfg, sizes[o]), "record")
              for o in (0, 1)]
    both = epsilon(ev.compose([b.ledger.scope_event("self") for b in before]), 1e-5, "rdp")
    node = load_owner_ledger(_ctx({"state-dir": root, "max-epsilon": 100.0}), NODE_LEDGER,
                             agreed_release(cfg, sizes[0], 100.0), "record")
    assert node.releases == 0 and node.epsilon() == pytest.approx(both) and both > max(b.epsilon() for b in before)
    cap = (both + before[0].epsilon()) / 2  # what the per-owner ledgers spent already exceeds it
    with pytest.raises(InstructionRefused, match="node's budget"):
        charge_owners(cfg, _ctx({"state-dir": root, "max-epsilon": cap}), sizes, {0: Instruction(3, 0.1, 10, 2.0)},
                      "s")


# ------------------------------------------------------------------ 3. a policy without a state-dir
def test_a_policy_without_a_state_dir_is_refused_at_set_up_and_at_train(tmp_path):
    terms = RunTerms(target_epsilon=8.0, delta=1e-5, unit="record", neighbouring="add-remove", placement="local")
    with pytest.raises(InstructionRefused, match="it needs node config 'state-dir' for its ledger"):
        run_policy({"max-epsilon": CAP}, terms)
    assert run_policy({"max-epsilon": CAP, "state-dir": str(tmp_path)}, terms).max_epsilon == CAP
    with pytest.raises(InstructionRefused, match="'state-dir'"):
        silo_policy(_ctx({"max-epsilon": CAP}), parse_subject_config({"data-dir": "/nonexistent"}))

    node = {"max-epsilon": CAP, "seeded-noise": True}  # the review's node: a fresh budget per run
    rc = _rc(3, **{"noise-placement": "local", "noise-multiplier": 0.0, "num-rounds": 1, "accountant": "rdp",
                   "results-dir": str(tmp_path / "results")})
    grid = InProcessGrid(user_app(), 3, rc, node_config=node, errors_as_replies=True)
    with pytest.raises(RuntimeError, match="failed at set-up: refused: a policy's cap covers all runs on this node: "
                                          "it needs node config 'state-dir'"):
        JointDP.from_run_config(rc, node_settle_s=0.0).start(grid=grid, initial_arrays=_initial())
    assert not any(r.metadata.message_type == MessageType.TRAIN for r in grid.sent)
    # a node that loses its state-dir after an honest set-up refuses at train
    ctx = grid.contexts[1000]
    cfg = ConfigRecord({protocol.ROUND: 1, protocol.OWNERS: [0], protocol.SAMPLE_RATES: [0.3],
                        protocol.STEPS: [3], protocol.NOISE_MULTIPLIER: 5.0, protocol.SESSION: "s"})
    reply = grid.client_app(Message(RecordDict({protocol.SHARED: _initial(), protocol.CONFIG: cfg}),
                                    dst_node_id=1000, message_type=MessageType.TRAIN), ctx)
    assert reply.has_error() and "needs node config 'state-dir'" in reply.error.reason
    assert not any(k.startswith("ledger.") for k in ctx.state.keys())


# ------------------------------------------------------------------ 4. evaluate under the policy
def _evaluate(session: str) -> Message:
    crafted = {n: np.full(p.shape, 0.3, np.float32) for n, p in Probe().named_parameters() if n.startswith("body.")}
    return Message(RecordDict({protocol.SHARED: protocol.to_record(crafted),
                               protocol.CONFIG: ConfigRecord({protocol.ROUND: 1, protocol.SESSION: session,
                                                              protocol.OWNERS: [0]})}),
                   dst_node_id=1000, message_type=MessageType.EVALUATE)


def test_a_run_the_policy_refuses_gets_no_evaluation_metrics(tmp_path):
    """The review's attack: after an honest run, a run refused at set-up (FedAvg, or
    another delta) sends an evaluate message naming the honest run's session. It gets
    an error reply and no metrics; the same message under the honest run config gets
    the owner's metrics (the check is what refuses it)."""
    node = {"state-dir": str(tmp_path / "node"), "max-epsilon": CAP, "seeded-noise": True}
    rc = _rc(1, **{"noise-placement": "local", "noise-multiplier": 0.0, "num-rounds": 1, "accountant": "rdp",
                   "results-dir": str(tmp_path / "results")})
    JointDP.from_run_config(rc, node_settle_s=0.0).start(
        grid=InProcessGrid(user_app(), 1, rc, node_config=node, errors_as_replies=True), initial_arrays=_initial())
    session = next(p.name for p in (tmp_path / "node").iterdir() if p.name != "owners")
    for run_config, refused in ((rc, False), ({**rc, "jdp.method": "fedavg"}, True), ({**rc, "jdp.delta": 0.1}, True)):
        app = user_app()
        ctx = InProcessGrid(app, 1, run_config, node_config=node).contexts[1000]
        reply = app(_evaluate(session), ctx)
        if refused:
            assert reply.has_error() and reply.error.reason.startswith("refused: ") and not reply.has_content()
        else:
            assert not reply.has_error() and "accuracy" in reply.content["metrics"]


class _Client(NumPyClient):
    """A legacy app's client (``net`` and ``trainloader`` as Flower's examples name them)."""

    def __init__(self, context: Context, calls: list) -> None:
        self.net, self.trainloader, self.calls = Probe(), _data(owner_id(context)), calls

    def fit(self, parameters, config):  # noqa: ANN001, ANN201
        _train_fn(self.net, self.trainloader)
        return [], len(self.trainloader.dataset), {}

    def evaluate(self, parameters, config):  # noqa: ANN001, ANN201
        self.calls.append(1)
        return 0.5, 1, {"accuracy": 1.0}


def test_the_numpyclient_route_answers_a_refused_runs_evaluate_with_an_error(tmp_path):
    """The same through numpy_client_app: the client's evaluate is called for the
    accepted run, never for the refused one (another delta)."""
    calls: list = []
    app = numpy_client_app(lambda context: _Client(context, calls).to_client())
    node = {"state-dir": str(tmp_path / "node"), "max-epsilon": CAP, "seeded-noise": True}
    rc = _rc(1, **{"noise-placement": "local", "noise-multiplier": 0.0})
    ctx = InProcessGrid(app, 1, rc, node_config=node).contexts[1000]
    public = protocol.to_record({n: p.detach().numpy() for n, p in Probe().named_parameters() if n.startswith("head.")})
    setup = app(Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: public}),
                        dst_node_id=1000, message_type=MessageType.QUERY), ctx)
    assert setup.has_content()
    honest = app(_evaluate("s1"), ctx)
    assert not honest.has_error() and isinstance(honest.content["metrics"], MetricRecord) and calls == [1]
    ctx.run_config["jdp.delta"] = 0.1  # the submitter's next run
    refused = app(_evaluate("s1"), ctx)
    assert refused.has_error() and "refused: run-config key 'jdp.delta'=0.1" in refused.error.reason
    assert calls == [1]
