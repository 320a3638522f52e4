"""The owner's policy, on the owner's node (:mod:`flwr_jdp.privacy.policy`): the attacks of
a deviating server or run submitter, each through the production client half
(:class:`~flwr_jdp.joint_dp.client.JointDPClient` on a user's small model, the shared
guard, the real :class:`JointDP` strategy) on an in-process grid, refused before
anything is released or kept within the ledger's bound.

- δ from the run: a node capped at ε = 1 at δ = 1e-5 is spent; runs with δ = 0.1 and
  0.4 are refused at set-up and at train, and the owner's ledger at the policy's δ
  never exceeds 1.
- The ledger split by unit and relation: runs with another relation or unit are
  refused; the ledger is one file per node.
- The budget from the run: a larger ``target-epsilon`` does not raise the cap.
- Distributed share sizes from the run: more owners, fewer colluders or less dropout
  than the policy's ``honest-owners`` floor do not shrink the noise an owner adds
  (the variance of the vector noise it added, measured).
- No policy: trusted with one line under simulation; refused on a real SuperNode
  (Flower's own ``flwr-clientapp`` code calls the app) unless opted in.
- Subject-level silos: the same checks (delta; the cap below their share of the plan).
"""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

import flwr_jdp.privacy.policy as policy_module
from apps.subject_dp.subject_dp.client_app import client as subject_client
from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.budgets import node_max_epsilon
from flwr_jdp.privacy.guard import Instruction
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.privacy.policy import DEFAULT_PLACEMENTS, OwnerPolicy
from flwr_jdp.strategies import JointDP
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.silo_guard import cap_agreement
from tests.helpers import own_state_dirs
from tests.test_distributed_noise import Spy, _initial, _rc, user_app
from tests.test_silo_guard import RC as SILO_RC
from tests.test_silo_guard import _honest, _ledgers, _refused, _send, silos  # noqa: F401 - silos: a fixture

CAP, DELTA = 1.0, 1e-5


def _local(owners: int = 3, **over: object) -> dict:
    """A user's run config under local noise (the server is not trusted)."""
    return _rc(owners, **{"noise-placement": "local", "noise-multiplier": 0.0, "num-rounds": 3, "accountant": "rdp",
                          **over})


def _grid(rc: dict, nodes: int, node_config: dict, fault=None) -> tuple[JointDP, InProcessGrid]:  # noqa: ANN001
    """A fresh run (its own results-dir) of ``nodes`` owners, one per node."""
    results = rc.get("jdp.results-dir") or f"{node_config.get('state-dir', '/nonexistent')}-results-{id(rc)}"
    rc = {**rc, "jdp.results-dir": results}
    grid = InProcessGrid(user_app(), nodes, rc, node_config=node_config, fault=fault, errors_as_replies=True,
                         node_configs=own_state_dirs(node_config, nodes))
    return JointDP.from_run_config(rc, node_settle_s=0.0), grid


def _start(rc: dict, nodes: int, node_config: dict, fault=None) -> tuple[JointDP, InProcessGrid]:  # noqa: ANN001
    strategy, grid = _grid(rc, nodes, node_config, fault)
    strategy.start(grid=grid, initial_arrays=_initial())
    return strategy, grid


def _stalled(rc: dict, nodes: int, node_config: dict, fault=None) -> InProcessGrid:  # noqa: ANN001
    """A run every owner refuses at train: it stops after ``max-skipped-rounds``."""
    strategy, grid = _grid({**rc, "jdp.max-skipped-rounds": 1}, nodes, node_config, fault)
    with pytest.raises(Exception, match="rounds in a row"):
        strategy.start(grid=grid, initial_arrays=_initial())
    return grid


def _node(tmp_path, **policy: object) -> dict:
    """A node; a policy in its node config accepts the tests' seeded noise (``seeded-noise``) unless told otherwise."""
    seeded = {"seeded-noise": True} if "max-epsilon" in policy else {}
    return {"state-dir": str(tmp_path / "node"), **seeded, **policy}


def _ledger_epsilon(path, delta: float = DELTA) -> float:
    """The owner's ledger file re-accounted at ``delta`` by a fresh ledger."""
    state = json.loads(path.read_text())
    ledger = PrivacyLedger(delta=delta, accountant=state["accountant"], unit=state["unit"],
                           neighbouring=state["neighbouring"])
    ledger.load_state_dict(dict(state, delta=delta))
    return ledger.epsilon()


def _ledger_files(tmp_path) -> dict[str, str]:
    return {str(p.relative_to(tmp_path)): p.read_text() for p in sorted((tmp_path / "node").rglob("*.json"))}


def _train_replies(grid: InProcessGrid) -> list[Message]:
    return [r for r in grid.sent if r.metadata.message_type == MessageType.TRAIN]


# ------------------------------------------------------------------ attack 2: delta from the run
def test_runs_at_another_delta_are_refused_and_the_ledger_stays_within_the_cap(tmp_path):
    """Policy max-epsilon 1 on every node (delta 1e-5 by default), run target 8. Run 1
    is planned for the cap and spends it; runs with delta 0.1 and 0.4 for 108 and 200
    rounds are refused at set-up, naming the key and the policy's delta, and nothing
    is written; the ledgers re-accounted at delta 1e-5 stay within 1."""
    node = _node(tmp_path, **{"max-epsilon": CAP})
    strategy, _ = _start(_local(**{"target-epsilon": 8.0}), 3, node)
    assert strategy.status == "completed" and set(strategy.owner_caps.values()) == {CAP}
    files = sorted((tmp_path / "node").glob("*/owners/ledger-*.json"))
    assert [str(p.relative_to(tmp_path)) for p in files] == [f"node/{i}/owners/ledger-node.json" for i in range(3)]
    spent = [_ledger_epsilon(p) for p in files]
    assert all(0.9 * CAP < e <= CAP * (1 + 1e-9) for e in spent), spent
    before = _ledger_files(tmp_path)
    for delta, rounds in ((0.1, 108), (0.4, 200)):
        rc = _local(**{"target-epsilon": 8.0, "delta": delta, "num-rounds": rounds})
        with pytest.raises(RuntimeError, match=rf"refused: run-config key 'jdp.delta'={delta}, this node's policy "
                                               r"\(node config\) accounts its ledger at delta = 1e-05"):
            _start(rc, 3, node)
        assert _ledger_files(tmp_path) == before
    assert all(_ledger_epsilon(p) <= CAP * (1 + 1e-9) for p in files)


def test_a_run_config_changed_after_set_up_is_refused_at_train_before_any_release(tmp_path, monkeypatch):
    """The check is repeated at every train message: nodes whose run config says delta
    0.1 after an honest set-up refuse every instruction; nothing is charged or sent,
    and the train function never reads a batch."""
    strategy, grid = _grid(_local(**{"max-skipped-rounds": 1}), 3, _node(tmp_path, **{"max-epsilon": CAP}))
    real_configure = strategy.configure_train

    def submitter_changes_delta(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        for ctx in grid.contexts.values():
            ctx.run_config["jdp.delta"] = 0.1
        return real_configure(*args, **kwargs)

    strategy.configure_train = submitter_changes_delta
    read = []
    monkeypatch.setattr("tests.test_distributed_noise._train_fn", lambda net, loader: read.append(1))
    with pytest.raises(Exception, match="rounds in a row"):
        strategy.start(grid=grid, initial_arrays=_initial())
    replies = _train_replies(grid)
    assert replies and all(r.has_error() and "refused: run-config key 'jdp.delta'=0.1" in r.error.reason
                           for r in replies)
    assert not read and not (tmp_path / "node" / "owners").exists()


# ------------------------------------------------------------------ attack 3: unit and relation
@pytest.mark.parametrize(("over", "key", "policy_value"), [
    ({"neighbouring": "replace-one", "accountant": "pld"}, "jdp.neighbouring", "add-remove"),
    ({"privacy-unit": "user"}, "jdp.privacy-unit", "record"),
])
def test_runs_in_another_unit_or_relation_are_refused_and_the_ledger_is_one_file(tmp_path, over, key, policy_value):
    node = _node(tmp_path, **{"max-epsilon": 8.0})
    _start(_local(**{"num-rounds": 1}), 3, node)
    before = _ledger_files(tmp_path)
    assert sorted(before) == [f"node/{i}/owners/ledger-node.json" for i in range(3)]
    with pytest.raises(RuntimeError, match=rf"refused: run-config key '{key}'=.*counts its ledger in '{policy_value}'"):
        _start(_local(**over), 3, node)
    assert _ledger_files(tmp_path) == before


def test_without_a_policy_a_run_in_other_terms_finds_the_same_ledger_and_is_refused(tmp_path):
    """No policy (in-process: the run config is trusted): the ledger still records the
    terms it counts in, so a later run with another relation is refused at train, not
    given a fresh ledger; nothing is charged."""
    node = _node(tmp_path)
    _start(_local(**{"num-rounds": 1}), 3, node)
    before = _ledger_files(tmp_path)
    grid = _stalled(_local(**{"neighbouring": "replace-one", "accountant": "pld"}), 3, node)
    reasons = [r.error.reason for r in _train_replies(grid)]
    assert reasons and all("counts in other terms" in r and "neighbouring='add-remove'" in r for r in reasons)
    assert _ledger_files(tmp_path) == before


# ------------------------------------------------------------------ attack 4: the budget from the run
def test_a_larger_target_epsilon_does_not_raise_the_policys_budget(tmp_path):
    """Policy file max-epsilon 1; the run asks for target 100 and the server hides the
    cap (its set-up replies report none), so it sends the noise of epsilon 100: every
    owner refuses, and no ledger holds anything."""
    policy = tmp_path / "policy.toml"
    policy.write_text(f"max-epsilon = {CAP}\ndelta = {DELTA}\nseeded-noise = true\n")

    def hide_cap(msg, reply):  # noqa: ANN001, ANN202
        if msg.metadata.message_type == MessageType.QUERY and not reply.has_error():
            reply.content[protocol.SETUP][protocol.MAX_EPSILON] = [0.0]
        return reply

    grid = _stalled(_local(**{"target-epsilon": 100.0}), 3, _node(tmp_path, **{"policy-file": str(policy)}),
                    fault=hide_cap)
    replies = _train_replies(grid)
    assert replies and all(r.has_error() and "is too small" in r.error.reason and "budget 1 at delta 1e-05"
                           in r.error.reason for r in replies)
    assert not _ledger_files(tmp_path)


# ------------------------------------------------------------------ attack 5: distributed share sizes
def _shares(monkeypatch, tmp_path, nodes: int, honest: int, **run: object) -> tuple[list[float], float]:
    """Each owner's measured noise variance per coordinate over two rounds, and the
    mu the ledger charges (the plan's)."""
    spy = Spy(monkeypatch)
    rc = _rc(nodes, **{"results-dir": str(tmp_path / "results"), "noise-multiplier": 0.5, "target-epsilon": 1e6,
                       "num-rounds": 2, **run})
    _start(rc, nodes, _node(tmp_path, **{"max-epsilon": 1e6, "honest-owners": honest}))
    variances = [float(np.var(np.concatenate([a.ravel() for a in v["noise"]]))) for v in spy.vectors]
    assert len(variances) == 2 * nodes
    return variances, spy.vectors[0]["plan"].mu


@pytest.mark.parametrize(("nodes", "honest", "run", "run_divisor"), [
    (6, 3, {}, 6),  # the server adds owners of its own: the run plans mu / 6
    (3, 2, {"colluding-owners": 0}, 3),  # fewer colluders than the owner assumes
    (4, 2, {"dropout-tolerance": 0.0}, 4),  # every owner said to survive
])
def test_the_run_config_cannot_shrink_an_owners_share_below_its_floor(monkeypatch, tmp_path, nodes, honest, run,
                                                                      run_divisor):
    variances, mu = _shares(monkeypatch, tmp_path, nodes, honest, **run)
    for var in variances:  # Sk(mu / h): variance 2 mu / h, never the run's 2 mu / (s - k)
        assert var == pytest.approx(2 * mu / honest, rel=0.1)
        assert var > 1.2 * 2 * mu / run_divisor


def test_a_tenfold_cut_of_the_floored_share_fails_the_check(monkeypatch, tmp_path):
    """The same measurement with each share's mu cut tenfold fails."""
    import dataclasses

    import flwr_jdp.joint_dp.distributed as distributed

    real = distributed.encode_release
    monkeypatch.setattr(distributed, "encode_release", lambda ints, plan, rng: real(
        ints, dataclasses.replace(plan, noise_multiplier=plan.noise_multiplier / math.sqrt(10)), rng))
    variances, mu = _shares(monkeypatch, tmp_path, 3, 2)
    with pytest.raises(AssertionError):
        for var in variances:
            assert var == pytest.approx(2 * mu / 2, rel=0.1)


# ------------------------------------------------------------------ placements
def test_central_noise_is_refused_unless_the_policy_names_it(tmp_path):
    rc = _rc(3, **{"noise-placement": "central", "num-rounds": 1, "accountant": "rdp",
                   "results-dir": str(tmp_path / "results")})
    with pytest.raises(RuntimeError, match=r"refused: run-config key 'jdp.noise-placement'='central', this node's "
                                           r"policy \(node config\) allows \['local', 'distributed'\]"):
        _start(rc, 3, _node(tmp_path, **{"max-epsilon": 8.0}))
    strategy, _ = _start(rc, 3, _node(tmp_path, **{"max-epsilon": 8.0, "noise-placements": "local,central"}))
    assert strategy.status == "completed"


def test_a_seeded_or_unnoised_run_is_refused_under_a_policy(tmp_path):
    """A run submitter who seeds the noise (``noise-seed``) could subtract it; one who asks
    for FedAvg (``method``) would get the raw model: both refused at set-up, nothing charged."""
    node = _node(tmp_path, **{"max-epsilon": 8.0, "seeded-noise": False})
    rc = _local(3, **{"noise-seed": 7, "results-dir": str(tmp_path / "r1")})
    with pytest.raises(RuntimeError, match=r"refused: run-config key 'jdp.noise-seed'=7 makes the noise reproducible"):
        _start(rc, 3, node)
    rc = _local(3, **{"method": "fedavg", "results-dir": str(tmp_path / "r2")})
    with pytest.raises(RuntimeError, match=r"refused: the run releases without noise \(run-config key 'jdp.method'\)"):
        _start(rc, 3, node)
    assert not _ledger_files(tmp_path)
    strategy, _ = _start(_local(3, **{"noise-seed": -1, "results-dir": str(tmp_path / "r3")}), 3, node)
    assert strategy.status == "completed"


def test_a_policy_can_require_noise_from_the_os_csprng(tmp_path):
    """The run submitter chooses ``secure-noise``; a policy with ``secure-noise = true``
    refuses a run that draws its noise from torch's generator, and accepts one that does not."""
    node = _node(tmp_path, **{"max-epsilon": 8.0, "secure-noise": True, "seeded-noise": False})
    with pytest.raises(RuntimeError, match=r"refused: run-config key '(jdp\.)?secure-noise'=false draws the noise"):
        _start(_local(3, **{"noise-seed": -1, "results-dir": str(tmp_path / "r1")}), 3, node)
    assert not _ledger_files(tmp_path)
    strategy, _ = _start(_local(3, **{"noise-seed": -1, "secure-noise": True, "results-dir": str(tmp_path / "r2")}),
                         3, node)
    assert strategy.status == "completed"
    with pytest.raises(ConfigError, match="'secure-noise' must be true or false"):
        OwnerPolicy.from_node_config({"max-epsilon": 1, "secure-noise": "yes"})


# ------------------------------------------------------------------ no policy
def _query(node_config: dict) -> tuple[Message, Context]:
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", 0)):
        if getattr(TaskIdentity, f"_{attr}") is None:
            setattr(TaskIdentity, attr, value)
    msg = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7, message_type=MessageType.QUERY)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3, **node_config},
                  state=RecordDict(), run_config=_local())
    return msg, ctx


def _on_supernode(monkeypatch, tmp_path, app, msg: Message, ctx: Context) -> Message:
    """``app`` answers ``msg`` as on a real SuperNode: called by Flower's own
    ``run_clientapp`` (the code of the ``flwr-clientapp`` process), its transport to
    the SuperNode replaced by direct hand-over."""
    import flwr.supernode.runtime.run_clientapp as runtime

    replies = []
    client = SimpleNamespace(close=lambda: None)
    run = SimpleNamespace(fab_id="app", fab_version="1.0", run_id=1)
    for name, value in {
        "RuntimeHttpClient": SimpleNamespace(from_server_address=lambda **_: client),
        "HeartbeatSender": lambda _fn: SimpleNamespace(start=lambda: None, stop=lambda: None, is_running=False),
        "register_signal_handlers": lambda **_: None,
        "event": lambda *_, **__: None,
        "pull_task_input": lambda _client: (msg, ctx, run, SimpleNamespace(content=b"", hash_str="0")),
        "install_from_fab": lambda *_, **__: None,
        "get_project_dir": lambda *_: tmp_path,
        "get_load_client_app_fn": lambda **_: (lambda *_: app),
        "push_message": lambda _client, reply, _ctx: replies.append(reply),
        "flwr_exit": lambda **_: None,
    }.items():
        monkeypatch.setattr(runtime, name, value)
    runtime.run_clientapp("127.0.0.1:1", token="t", insecure=True, runtime_dependency_install=False)
    assert len(replies) == 1
    return replies[0]


def test_on_a_real_supernode_without_a_policy_the_owner_refuses_unless_opted_in(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="flwr")
    monkeypatch.setattr(policy_module, "_LOGGED", set())
    reply = _on_supernode(monkeypatch, tmp_path, user_app(), *_query({}))
    assert reply.has_error() and "refused: this SuperNode names no policy" in reply.error.reason
    assert "policy=\"trust-run\"" in reply.error.reason and "max-epsilon" in reply.error.reason
    for node_config in ({"policy": "trust-run"}, {"max-epsilon": 2.0, "seeded-noise": True,
                                                   "state-dir": str(tmp_path / "node")}):
        reply = _on_supernode(monkeypatch, tmp_path, user_app(), *_query(node_config))
        assert not reply.has_error(), reply.error.reason
        assert list(reply.content[protocol.SETUP][protocol.MAX_EPSILON]) == [node_config.get("max-epsilon", 0.0)]
    trusting = [r.getMessage() for r in caplog.records if "trust the run submitter" in r.getMessage()]
    assert len(trusting) == 1 and "'policy'='trust-run'" in trusting[0]
    # off a SuperNode (one's own process) the same app is answered without the opt-in
    assert not policy_module.on_supernode()


def test_under_simulation_without_a_policy_the_run_is_trusted_with_one_line(monkeypatch, tmp_path, caplog):
    """Flower's simulation engine calls the app from its Ray actor's ``run``; flwr-jdp's
    in-process grid calls it directly. The line is logged once for the process,
    whatever the number of messages and rounds."""
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

    caplog.set_level(logging.WARNING, logger="flwr")
    monkeypatch.setattr(policy_module, "_LOGGED", set())
    app = user_app()
    for _ in range(2):
        _, reply, _ = VirtualClientEngineActor.run(None, lambda: app, *_query({})[:1], "0", _query({})[1])
        assert not reply.has_error()
    strategy, _ = _start(_local(**{"num-rounds": 1}), 3, {"state-dir": str(tmp_path / "node")})
    assert strategy.status == "completed"
    lines = [r.getMessage() for r in caplog.records if "trust the run submitter" in r.getMessage()]
    assert len(lines) == 1 and "target-epsilon, delta" in lines[0]


# ------------------------------------------------------------------ subject-level silos
def test_silos_refuse_a_run_at_another_delta_before_reading_data(silos, tmp_path):  # noqa: F811
    rc = {**SILO_RC, "delta": 1e-3}
    grid = InProcessGrid(subject_client, 2, rc, node_config={"state-dir": str(tmp_path), "max-epsilon": 4.0})
    _refused(_send(grid, 1, **_honest(1, rc)), "run-config key 'delta'=0.001, this node's policy (node config) "
             "accounts its ledger at delta = 1e-05")
    assert silos["data"] == [] and silos["trained"] == 0 and _ledgers(grid, tmp_path) == ({}, {})


def test_a_silos_budget_is_its_policys_cap_when_smaller(silos, tmp_path):  # noqa: F811
    """The cap lies between one round's epsilon and the plan's two: round 1 is charged
    (at the policy's delta), round 2 refused with nothing trained. One silo per node, each
    node its own state-dir (under a policy a node's silos share its one ledger)."""
    rc = {**SILO_RC, "num-silos": 2}
    agreed = cap_agreement(parse_subject_config(rc))
    one = PrivacyLedger(delta=DELTA, accountant="pld", unit="subject")
    one.record_round(1, {"self": agreed.event(Instruction(1, agreed.max_sample_rate, agreed.max_steps,
                                                          agreed.fixed_noise))})
    cap = (one.epsilon() + agreed.budget) / 2
    assert one.epsilon() < cap < agreed.budget
    node = {"state-dir": str(tmp_path), "max-epsilon": cap}
    grid = InProcessGrid(subject_client, 2, rc, node_config=node, node_configs=own_state_dirs(node, 2))
    assert not any(r.has_error() for r in _send(grid, 1, **_honest(1, rc)))
    trained = silos["trained"]
    assert trained == 2
    _refused(_send(grid, 2, **_honest(2, rc)), f"the node's budget {cap:g}")
    assert silos["trained"] == trained
    on_disk = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/silos/ledger-*.json"))]
    assert [str(p.relative_to(tmp_path)) for p in sorted(tmp_path.glob("*/silos/ledger-*.json"))] == [
        "0/silos/ledger-node.json", "1/silos/ledger-node.json"]
    assert all(len(s["rounds"]) == 1 and s["delta"] == DELTA for s in on_disk)


# ------------------------------------------------------------------ reading the policy
def test_the_policy_reader_checks_every_key_and_its_defaults(tmp_path):
    assert OwnerPolicy.from_node_config({"partition-id": 0, "state-dir": "x"}) is None
    assert OwnerPolicy.from_node_config({"policy": "trust-run"}) is None
    p = OwnerPolicy.from_node_config({"max-epsilon": 2})
    assert (p.max_epsilon, p.delta, p.privacy_unit, p.neighbouring, p.noise_placements, p.honest_owners) == (
        2.0, 1e-5, "record", "add-remove", DEFAULT_PLACEMENTS, 1)
    assert OwnerPolicy.from_node_config({"max-epsilon": 2}, default_unit="subject").privacy_unit == "subject"
    assert p.budget(8.0) == 2.0 and p.budget(0.5) == 0.5
    f = tmp_path / "policy.toml"
    f.write_text('max-epsilon = 3.0\ndelta = 1e-6\nprivacy-unit = "user"\nneighbouring = "replace-one"\n'
                 'noise-placements = ["distributed"]\nhonest-owners = 4\n')
    q = OwnerPolicy.from_node_config({FILE: str(f)})
    assert (q.max_epsilon, q.delta, q.privacy_unit, q.neighbouring, q.noise_placements, q.honest_owners) == (
        3.0, 1e-6, "user", "replace-one", ("distributed",), 4)
    assert q.source == f"policy file {f}"
    bad = [
        ({"max-epsilon": 0}, "node config key 'max-epsilon' must be a number > 0"),
        ({"max-epsilon": "x"}, "'max-epsilon' must be"),
        ({"max-epsilon": math.inf}, "'max-epsilon' must be"),
        ({"max-epsilon": 1, "delta": 1.0}, r"'delta' must be a number in \(0, 1\)"),
        ({"max-epsilon": 1, "privacy-unit": "row"}, "'privacy-unit' must be one of"),
        ({"max-epsilon": 1, "neighbouring": "swap"}, "'neighbouring' must be one of"),
        ({"max-epsilon": 1, "noise-placements": "local,trusted"}, "'noise-placements' must be a non-empty list"),
        ({"max-epsilon": 1, "honest-owners": 0}, "'honest-owners' must be an integer >= 1"),
        ({"max-epsilon": 1, "honest-owners": 2.5}, "'honest-owners' must be an integer >= 1"),
        ({"delta": 1e-5}, "'max-epsilon' is missing"),
        ({"max-epsilon": 1, "policy": "trust-run"}, "contradict"),
        ({"policy": "trust-all"}, "'policy' must be 'trust-run'"),
        ({"max-epsilon": 1, FILE: str(f)}, "write the policy in one place"),
        ({FILE: str(tmp_path / "missing.toml")}, "cannot read the policy file"),
    ]
    for node_config, match in bad:
        with pytest.raises(ConfigError, match=match):
            OwnerPolicy.from_node_config(node_config)
    f.write_text("max-epsilon = 1.0\nmax-epsilom = 2.0\n")
    with pytest.raises(ConfigError, match="unknown key 'max-epsilom'"):
        OwnerPolicy.from_node_config({FILE: str(f)})
    assert node_max_epsilon({"max-epsilon": "0.5"}) == 0.5  # the owner budgets' reader is the policy's


FILE = policy_module.FILE_KEY
