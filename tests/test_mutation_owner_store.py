"""An owner's state on its node (flwr_jdp/joint_dp/owner_store.py), written for
mutation testing (docs/mutation.md): personal arrays saved equal personal arrays
loaded (``context.state`` and, after a restart, the node's ``state-dir``), the
rounds and broadcast they were fitted on, the owner's own ledger charged before
anything is trained, the instruction read strictly, the per-round generator; and
what flwr-jdp's own ClientApp builds from that state (the owners a node hosts, the
seeded model and public personal values, the owner's model: the broadcast plus its
own personal state). No Flower run; the own app's set-up reads the digits data."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from apps.joint_dp.joint_dp import client_app, task
from apps.joint_dp.joint_dp.server_app import initial_arrays
from apps.joint_dp.joint_dp.task import initial_model, node_job_config
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_guard import Instruction, InstructionRefused, agreed_release
from flwr_jdp.joint_dp.owner_store import (
    charge_owners,
    load_owner_ledger,
    load_personal_arrays,
    owner_generator,
    personal_fit_on,
    personal_key,
    read_instructions,
    save_personal_arrays,
    shared_arrays,
    shared_digest,
    trained_rounds,
)
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.params import get_arrays, split_parameters
from flwr_jdp.privacy.guard import NODE_LEDGER
from flwr_jdp.training.user_loop import UserLoopError


def _ctx(node_config=None, run_config=None):
    return Context(run_id=1, node_id=5, node_config=dict(node_config or {}), state=RecordDict(),
                   run_config=dict(run_config or {}))


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"fc.weight": rng.normal(size=(3, 4)).astype(np.float32), "fc.bias": rng.normal(size=3).astype(np.float32)}


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype


# ------------------------------------------------------------------ personal arrays
def test_personal_arrays_saved_are_the_arrays_loaded_and_rounds_are_counted():
    ctx = _ctx()
    assert load_personal_arrays(ctx, 2) is None and trained_rounds(ctx, 2) == 0 and personal_fit_on(ctx, 2) == ""
    save_personal_arrays(ctx, 2, _arrays(1), fit_on="abc")
    _same(load_personal_arrays(ctx, 2), _arrays(1))
    assert trained_rounds(ctx, 2) == 1 and personal_fit_on(ctx, 2) == "abc"
    save_personal_arrays(ctx, 2, _arrays(2), fit_on="def", count_round=False)
    _same(load_personal_arrays(ctx, 2), _arrays(2))
    assert trained_rounds(ctx, 2) == 1 and personal_fit_on(ctx, 2) == "def"
    save_personal_arrays(ctx, 2, _arrays(3))
    assert trained_rounds(ctx, 2) == 2 and personal_fit_on(ctx, 2) == ""
    assert load_personal_arrays(ctx, 3) is None  # another owner on the node has its own state
    assert personal_key(2) == "personal.2" and personal_key(np.int64(7)) == "personal.7"


def test_a_restarted_node_reads_its_personal_state_back_from_its_state_dir(tmp_path):
    node = {"state-dir": str(tmp_path)}
    ctx = _ctx(node)
    save_personal_arrays(ctx, 4, _arrays(1), "sess1", fit_on="f1")
    save_personal_arrays(ctx, 4, _arrays(2), "sess1", fit_on="f2")
    assert (tmp_path / "sess1" / "personal-4.npz").is_file()
    assert not list((tmp_path / "sess1").glob(".personal-4.npz-*"))  # written atomically, nothing left over
    for ask in (load_personal_arrays, trained_rounds, personal_fit_on):  # each restores on its own
        fresh = _ctx(node)
        got = ask(fresh, 4, "sess1")
        if ask is load_personal_arrays:
            _same(got, _arrays(2))
        elif ask is trained_rounds:
            assert got == 2
        else:
            assert got == "f2"
        assert personal_key(4) in fresh.state
    assert load_personal_arrays(_ctx(node), 4, "other") is None  # another session: a fresh owner
    assert load_personal_arrays(_ctx(node), 5, "sess1") is None
    assert load_personal_arrays(_ctx(), 4, "sess1") is None  # no state-dir: nothing on disk
    restored = _ctx(node)
    save_personal_arrays(restored, 4, _arrays(3), "sess1")  # continues the count from disk
    assert trained_rounds(restored, 4, "sess1") == 1  # (the count lives with context.state first)


def test_a_state_dir_that_does_not_exist_yet_is_created(tmp_path):
    node = {"state-dir": str(tmp_path / "not" / "yet")}
    save_personal_arrays(_ctx(node), 1, _arrays(5), "s9")
    _same(load_personal_arrays(_ctx(node), 1, "s9"), _arrays(5))


def test_state_is_written_to_disk_only_for_a_plain_session_id(tmp_path):
    for session in ("", "../up", "a/b"):
        ctx = _ctx({"state-dir": str(tmp_path)})
        save_personal_arrays(ctx, 1, _arrays(), session)
        _same(load_personal_arrays(ctx, 1, session), _arrays())  # context.state still holds it
    assert list(tmp_path.rglob("*.npz")) == []


def test_an_old_state_file_without_metadata_is_read_as_zero_rounds(tmp_path):
    (tmp_path / "s").mkdir()
    np.savez(tmp_path / "s" / "personal-1.npz", **_arrays(4))
    ctx = _ctx({"state-dir": str(tmp_path)})
    _same(load_personal_arrays(ctx, 1, "s"), _arrays(4))
    assert trained_rounds(ctx, 1, "s") == 0 and personal_fit_on(ctx, 1, "s") == ""


# ------------------------------------------------------------------ the broadcast
def test_shared_arrays_and_their_digest():
    arrays = _arrays(1)
    assert shared_arrays(None) == {}
    _same(shared_arrays(protocol.to_record(arrays)), arrays)
    copy = shared_arrays(arrays)
    assert copy is not arrays and list(copy) == list(arrays)
    d = shared_digest(arrays)
    assert len(d) == 32 and d == shared_digest(protocol.to_record(arrays))
    changed = dict(arrays, **{"fc.bias": arrays["fc.bias"] + np.float32(1e-3)})
    renamed = {"fc.w": arrays["fc.weight"], "fc.bias": arrays["fc.bias"]}
    assert len({d, shared_digest(changed), shared_digest(renamed), shared_digest(None)}) == 4


def test_the_per_round_generator_is_seeded_per_round_and_owner_or_secure():
    cfg = parse_config({"noise-seed": 11})
    draw = lambda g: torch.rand(4, generator=g).tolist()  # noqa: E731
    a = draw(owner_generator(cfg, 1, 0))
    assert a == draw(owner_generator(cfg, 1, 0))
    assert len({tuple(a), tuple(draw(owner_generator(cfg, 2, 0))), tuple(draw(owner_generator(cfg, 1, 1))),
                tuple(draw(owner_generator(parse_config({"noise-seed": 12}), 1, 0)))}) == 4
    secure = parse_config({})
    assert draw(owner_generator(secure, 1, 0)) != draw(owner_generator(secure, 1, 0))


# ------------------------------------------------------------------ the instruction
def _instruction_record(**over):
    rec = {protocol.ROUND: 3, protocol.OWNERS: [4, 2], protocol.SAMPLE_RATES: [0.1, 0.2],
           protocol.STEPS: [7, 9], protocol.NOISE_MULTIPLIER: 1.5, protocol.SESSION: "s"}
    rec.update(over)
    return ConfigRecord({k: v for k, v in rec.items() if v is not None})


def test_instructions_are_read_per_owner():
    cfg = parse_config({})
    got = read_instructions(cfg, _instruction_record(), [2, 4])
    assert got == {2: Instruction(3, 0.2, 9, 1.5), 4: Instruction(3, 0.1, 7, 1.5)}
    assert list(got) == [2, 4]
    assert read_instructions(cfg, _instruction_record(), [4]) == {4: Instruction(3, 0.1, 7, 1.5)}
    fedavg = parse_config({"method": "fedavg"})
    assert read_instructions(fedavg, ConfigRecord({protocol.ROUND: 6}), [1, 2]) == {
        1: Instruction(6, 1.0, 1, 0.0), 2: Instruction(6, 1.0, 1, 0.0)}
    assert read_instructions(fedavg, ConfigRecord(), [1]) == {1: Instruction(0, 1.0, 1, 0.0)}


@pytest.mark.parametrize("key", [protocol.ROUND, protocol.OWNERS, protocol.SAMPLE_RATES, protocol.STEPS,
                                 protocol.NOISE_MULTIPLIER, protocol.SESSION])
def test_a_missing_key_is_refused_never_defaulted(key):
    with pytest.raises(InstructionRefused, match=f"lacks \\['{key}'\\]"):
        read_instructions(parse_config({}), _instruction_record(**{key: None}), [4])


@pytest.mark.parametrize("over", [{protocol.SAMPLE_RATES: [0.1]}, {protocol.STEPS: [7]},
                                  {protocol.OWNERS: [4]}])
def test_one_value_per_owner_is_required(over):
    with pytest.raises(InstructionRefused, match="owners but"):
        read_instructions(parse_config({}), _instruction_record(**over), [4])


# ------------------------------------------------------------------ the owner's ledger
def _local_cfg(**extra):
    return parse_config({"privacy-unit": "record", "noise-placement": "local", "noise-multiplier": 1.0,
                         "num-rounds": 3, "target-epsilon": 8.0, "accountant": "rdp", "batch-size": 10,
                         **extra})


def test_each_owner_checks_and_charges_its_own_ledger_before_training(tmp_path):
    cfg = _local_cfg()
    ctx = _ctx({"state-dir": str(tmp_path)})
    sizes = {1: OwnerSize(100, 100), 2: OwnerSize(50, 50)}
    ok = {1: Instruction(1, 0.1, 10, 1.0), 2: Instruction(1, 0.2, 5, 1.0)}
    charge_owners(cfg, ctx, sizes, ok, "s")
    for o in (1, 2):
        agreed = agreed_release(cfg, sizes[o])
        ledger = load_owner_ledger(ctx, o, agreed, "record")
        assert ledger.releases == 1 and ledger.epsilon() > 0 and ledger.ledger.unit == "record"
        on_disk = json.loads((tmp_path / "owners" / f"ledger-{o}.json").read_text())
        assert [r["round"] for r in on_disk["rounds"]] == [1] and on_disk["rounds"][0]["note"] == "session s"
        assert load_owner_ledger(_ctx({"state-dir": str(tmp_path)}), o, agreed, "record").releases == 1
        assert ledger.ledger.scope_event(next(iter(ledger.ledger.scopes))) == agreed.event(ok[o])
    # one owner's refusal refuses the message: nobody is charged for it
    bad = {1: Instruction(2, 0.1, 10, 1.0), 2: Instruction(2, 0.9, 5, 1.0)}
    with pytest.raises(InstructionRefused, match="owner 2: .*sampling rate"):
        charge_owners(cfg, ctx, sizes, bad, "s")
    for o in (1, 2):
        assert load_owner_ledger(ctx, o, agreed_release(cfg, sizes[o]), "record").releases == 1
    assert load_owner_ledger(_ctx(), 1, agreed_release(cfg, sizes[1]), "record").releases == 0
    # the node restarts: each owner's ledger is read back from its state-dir before the next charge
    restarted = _ctx({"state-dir": str(tmp_path)})
    charge_owners(cfg, restarted, sizes, {o: dataclasses.replace(i, server_round=2) for o, i in ok.items()}, "s")
    for o in (1, 2):
        on_disk = json.loads((tmp_path / "owners" / f"ledger-{o}.json").read_text())
        assert [r["round"] for r in on_disk["rounds"]] == [1, 2]


def test_an_owner_stops_at_its_budget_and_a_node_cap_lowers_it(tmp_path):
    cfg = _local_cfg(**{"num-rounds": 100, "target-epsilon": 2.0, "noise-multiplier": 2.0})
    sizes = {0: OwnerSize(100, 100)}
    step = {0: Instruction(1, 0.1, 10, 2.0)}
    ctx = _ctx()
    charged = 0
    with pytest.raises(InstructionRefused, match="owner's budget 2"):
        for rnd in range(1, 200):
            charge_owners(cfg, ctx, sizes, {0: dataclasses.replace(step[0], server_round=rnd)}, "s")
            charged += 1
    assert charged >= 1
    ledger = load_owner_ledger(ctx, 0, agreed_release(cfg, sizes[0]), "record")
    assert ledger.releases == charged and ledger.epsilon() <= 2.0
    capped = _ctx({"max-epsilon": 1.0, "state-dir": str(tmp_path)})  # a policy: the node's one ledger
    with pytest.raises(InstructionRefused, match="node's budget 1 "):
        for rnd in range(1, charged + 1):
            charge_owners(cfg, capped, sizes, {0: dataclasses.replace(step[0], server_round=rnd)}, "s")
    node = load_owner_ledger(capped, NODE_LEDGER, agreed_release(cfg, sizes[0], 1.0), "record")
    assert 1 <= node.releases < charged and node.epsilon() <= 1.0 * (1 + 1e-9)


def test_a_new_session_named_by_the_server_does_not_reset_the_owners_ledger(tmp_path):
    """The owner is charged under session A; its SuperNode restarts (a fresh
    context.state, the same state-dir) and the server names session B. The owner's
    ledger is where the node keeps it, not where the server points: the epsilon spent
    under A carries over, and a release past the budget is refused under B."""
    cfg = _local_cfg(**{"num-rounds": 100, "target-epsilon": 2.0, "noise-multiplier": 2.0})
    sizes = {0: OwnerSize(100, 100)}
    agreed = agreed_release(cfg, sizes[0])
    node = {"state-dir": str(tmp_path)}
    session_a = _ctx(node)
    charged = 0
    with pytest.raises(InstructionRefused, match="owner's budget 2"):
        for rnd in range(1, 200):
            charge_owners(cfg, session_a, sizes, {0: Instruction(rnd, 0.1, 10, 2.0)}, "sessionA")
            charged += 1
    spent = load_owner_ledger(session_a, 0, agreed, "record").epsilon()
    assert charged >= 2 and spent <= 2.0 * (1 + 1e-9)

    session_b = _ctx(node)  # the node restarted: nothing in context.state
    carried = load_owner_ledger(session_b, 0, agreed, "record")
    assert carried.releases == charged and carried.epsilon() == pytest.approx(spent)
    with pytest.raises(InstructionRefused, match="owner 0: releasing would spend .* > the owner's budget 2"):
        charge_owners(cfg, session_b, sizes, {0: Instruction(1, 0.1, 10, 2.0)}, "sessionB")
    assert load_owner_ledger(_ctx(node), 0, agreed, "record").releases == charged  # nothing charged
    assert not (tmp_path / "sessionB").exists()  # no per-session ledger to start from empty

    # a release the budget still allows is charged under B onto the same ledger
    half = _local_cfg(**{"num-rounds": 100, "target-epsilon": 2.0 * 1.5, "noise-multiplier": 2.0})
    charge_owners(half, _ctx(node), sizes, {0: Instruction(1, 0.1, 10, 2.0)}, "sessionB")
    notes = [r["note"] for r in load_owner_ledger(_ctx(node), 0, agreed_release(half, sizes[0]), "record")
             .ledger.rounds]
    assert notes == ["session sessionA"] * charged + ["session sessionB"]


def test_the_owners_ledger_is_one_file_in_its_own_terms(tmp_path):
    """One ledger per owner whatever the run: it records the unit, relation and delta
    it counts in, and a run in other terms (no policy on the node: the first run's)
    is refused, not given a fresh ledger or re-accounted at its own delta; the
    accountant is the current run's."""
    node = {"state-dir": str(tmp_path)}
    sizes = {0: OwnerSize(100, 100)}
    record = _local_cfg()
    charge_owners(record, _ctx(node), sizes, {0: Instruction(1, 0.1, 10, 1.0)}, "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["owners"]
    path = tmp_path / "owners" / "ledger-0.json"
    assert {k: json.loads(path.read_text())[k] for k in ("unit", "neighbouring", "delta")} == {
        "unit": "record", "neighbouring": "add-remove", "delta": 1e-5}
    user = _local_cfg(**{"privacy-unit": "user", "records-per-user": 1})
    for other, unit, term in ((user, "user", "unit='record'"), (_local_cfg(delta=1e-3), "record", "delta=1e-05")):
        with pytest.raises(InstructionRefused, match=f"ledger \\({path}\\) counts in other terms.*{term}"):
            load_owner_ledger(_ctx(node), 0, agreed_release(other, sizes[0]), unit)
        with pytest.raises(InstructionRefused, match="counts in other terms"):
            charge_owners(other, _ctx(node), sizes, {0: Instruction(2, 0.1, 10, 1.0)}, "s")
    reread = load_owner_ledger(_ctx(node), 0, agreed_release(_local_cfg(accountant="pld"), sizes[0]), "record")
    assert reread.releases == 1 and reread.ledger.delta == 1e-5 and reread.ledger.accountant == "pld"


def test_an_old_layout_ledger_is_refused_naming_its_path(tmp_path):
    """A ledger of the layout keyed by unit and relation is not silently ignored."""
    old = tmp_path / "owners-user-add-remove" / "ledger-0.json"
    old.parent.mkdir()
    old.write_text("{}")
    with pytest.raises(InstructionRefused, match=f"old layout at {old}"):
        charge_owners(_local_cfg(), _ctx({"state-dir": str(tmp_path)}), {0: OwnerSize(100, 100)},
                      {0: Instruction(1, 0.1, 10, 1.0)}, "s")
    assert not (tmp_path / "owners").exists()


def test_nothing_is_charged_by_owners_under_central_noise_or_without_dp():
    sizes = {0: OwnerSize(100, 100)}
    for cfg in (parse_config({"noise-placement": "central"}), parse_config({"method": "fedavg"})):
        ctx = _ctx()
        charge_owners(cfg, ctx, sizes, {0: Instruction(1, 0.9, 99, 0.0)}, "s")  # not checked either
        assert not any(k.startswith("ledger.") for k in ctx.state.keys())


# ------------------------------------------------------------------ the owner's model in the own app
# What flwr-jdp's own ClientApp (client_app.py on task.py) builds from this state:
# which owners a node hosts (hosting_mod), the node's data-dir, the seeded model,
# the public personal values (server_app.initial_arrays) and the owner's model
# (JointDPClient.load: the broadcast plus the owner's own personal state).
RC = {"num-owners": 4, "batch-size": 32, "num-rounds": 2, "noise-seed": 3}


def _message(ctx, content, message_type):
    InProcessGrid(client_app.app, 1, ctx.run_config)  # stamps message identities
    return Message(RecordDict(content), dst_node_id=ctx.node_id, message_type=message_type)


def _public_and_shared(cfg):
    """The server's initial arrays split into the public personal values (sent at
    set-up) and the shared ones (the first broadcast)."""
    rec = initial_arrays(cfg)
    split = split_parameters(initial_model(cfg), cfg.effective_personal_rule, allow_empty=True)
    return ({n: rec[n].numpy() for n in split.personal}, {n: rec[n].numpy() for n in split.shared})


def _set_up(ctx):
    """The set-up query as the server sends it; returns the reply's set-up record."""
    public, _ = _public_and_shared(node_job_config(ctx))
    reply = client_app.app(_message(ctx, {protocol.CONFIG: ConfigRecord(),
                                          protocol.PUBLIC_PERSONAL: protocol.to_record(public)},
                                    MessageType.QUERY), ctx)
    assert reply.has_content(), reply.error.reason
    return reply.content[protocol.SETUP]


def _evaluate_msg(ctx, shared, session="s"):
    return _message(ctx, {protocol.SHARED: protocol.to_record(shared),
                          protocol.CONFIG: ConfigRecord({protocol.ROUND: 1, protocol.SESSION: session})},
                    MessageType.EVALUATE)


def test_a_node_hosts_the_owners_its_partition_names_and_reads_its_own_data_dir():
    rc = dict(RC, **{"num-owners": 5})
    hosted = _set_up(_ctx({"partition-id": 1, "num-partitions": 3}, rc))
    assert list(hosted[protocol.OWNER_IDS]) == protocol.hosted_owners(5, 1, 3) == [1, 4]
    assert len(hosted[protocol.NUM_RECORDS]) == 2 and min(hosted[protocol.NUM_RECORDS]) > 0
    assert list(_set_up(_ctx({}, rc))[protocol.OWNER_IDS]) == list(range(5))  # a lone node hosts all
    one = _set_up(_ctx({"partition-id": 3, "num-partitions": 5}, rc))  # one owner per node: itself
    assert list(one[protocol.OWNER_IDS]) == [3]
    for bad in ({"partition-id": 3, "num-partitions": 3}, {"partition-id": -1, "num-partitions": 3}):
        ctx = _ctx(bad, rc)
        reply = client_app.app(_message(ctx, {protocol.CONFIG: ConfigRecord()}, MessageType.QUERY), ctx)
        assert reply.has_error() and "partition-id" in reply.error.reason
    ctx = _ctx({"data-dir": "/elsewhere"}, {"num-owners": 4})
    assert node_job_config(ctx).data_dir == "/elsewhere"
    assert node_job_config(_ctx({}, {"num-owners": 4, "data-dir": "/x"})).data_dir == "/x"


def test_the_owner_model_is_the_broadcast_plus_its_own_personal_state(tmp_path):
    node = {"partition-id": 2, "num-partitions": 4, "state-dir": str(tmp_path)}
    ctx = _ctx(node, RC)
    cfg = node_job_config(ctx)
    model = initial_model(cfg)
    split = client_app.jdp._split(cfg, model)
    assert split.personal and split.shared
    seeded = dict(get_arrays(model, split.personal))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a copy: the next model starts from the seeded values again
    _same(dict(get_arrays(initial_model(cfg), split.personal)), seeded)

    public, initial_shared = _public_and_shared(cfg)
    _same(public, seeded)
    _set_up(ctx)
    shared = {n: np.full(a.shape, 0.25, a.dtype) for n, a in initial_shared.items()}
    fresh = client_app.jdp.load(initial_model(cfg), _evaluate_msg(ctx, shared), ctx)
    _same(dict(get_arrays(fresh, split.personal)), seeded)  # no state yet: the public values
    _same(dict(get_arrays(fresh, split.shared)), shared)
    mine = {n: np.full(a.shape, -0.5, a.dtype) for n, a in seeded.items()}
    save_personal_arrays(ctx, 2, mine, "s", fit_on="x")
    assert trained_rounds(ctx, 2, "s") == 1 and personal_fit_on(ctx, 2, "s") == "x"
    for context in (ctx, _ctx(node, RC)):  # also after a restart (no set-up since), from disk
        loaded = client_app.jdp.load(initial_model(cfg), _evaluate_msg(context, shared), context)
        _same(dict(get_arrays(loaded, split.personal)), mine)
        _same(dict(get_arrays(loaded, split.shared)), shared)
    with pytest.raises(UserLoopError, match="does not match"):  # a broadcast must name every shared array
        client_app.jdp.load(initial_model(cfg), _evaluate_msg(ctx, dict(list(shared.items())[1:])), ctx)


def test_public_personal_values_are_seeded_or_a_zero_head():
    cfg = parse_config({**RC, "release-personal": "seeded", "personal-layers": r"^(conv1|fc1)\."})
    model = initial_model(cfg)
    split = split_parameters(model, cfg.effective_personal_rule)
    seeded, _ = _public_and_shared(cfg)
    assert set(seeded) == set(split.personal)
    _same(seeded, dict(get_arrays(model, split.personal)))
    seeded[next(iter(seeded))] += 1.0  # a fresh copy each time
    _same(_public_and_shared(cfg)[0], dict(get_arrays(model, split.personal)))
    seeded = _public_and_shared(cfg)[0]
    zero = _public_and_shared(dataclasses.replace(cfg, release_personal="zero-head"))[0]
    head = tuple(model.HEAD_PREFIXES)
    assert head and any(n.startswith(head) for n in zero) and any(not n.startswith(head) for n in zero)
    for n, v in zero.items():
        assert v.shape == seeded[n].shape and v.dtype == seeded[n].dtype
        if n.startswith(head):
            assert not v.any() and seeded[n].any()
        else:
            np.testing.assert_array_equal(v, seeded[n])
            assert v.any()
    everything = initial_arrays(dataclasses.replace(cfg, release_personal="zero-head"))
    assert set(everything.keys()) == {n for n, _ in model.named_parameters()}  # shared ones too, as seeded
    for n in split.shared:
        np.testing.assert_array_equal(everything[n].numpy(), get_arrays(model, (n,))[n])


def test_the_model_split_allows_no_personal_layer_only_outside_joint_dp():
    fedavg = parse_config({**RC, "method": "fedavg"})
    split = client_app.jdp._split(fedavg, initial_model(fedavg))
    assert list(split.personal) == [] and split.shared
    nothing = parse_config({**RC, "personal-layers": "^nothing$"})
    with pytest.raises(ConfigError, match="'personal-layers'"):
        client_app.jdp._split(nothing, initial_model(nothing))
    assert isinstance(protocol.to_record(_arrays()), ArrayRecord)


def test_an_evaluation_fit_records_the_broadcast_but_no_trained_round():
    ctx = _ctx({"partition-id": 1, "num-partitions": 4}, RC)
    cfg = node_job_config(ctx)
    _set_up(ctx)
    public, shared = _public_and_shared(cfg)
    fits = []

    def fit(m):  # a user's fit: moves whatever it may train
        fits.append(sorted(n for n, p in m.named_parameters() if p.requires_grad))
        with torch.no_grad():
            for p in m.parameters():
                if p.requires_grad:
                    p.add_(1.0)

    model = client_app.jdp.load(initial_model(cfg), _evaluate_msg(ctx, shared), ctx, fit=fit)
    split = client_app.jdp._split(cfg, model)
    assert fits == [sorted(split.personal)]  # the shared parameters were frozen for the fit
    assert all(p.requires_grad for p in model.parameters())  # and thawed after it
    _same(dict(get_arrays(model, split.shared)), shared)
    _same(load_personal_arrays(ctx, 1, "s"), {n: v + np.float32(1) for n, v in public.items()})
    assert trained_rounds(ctx, 1, "s") == 0 and personal_fit_on(ctx, 1, "s") == shared_digest(shared)
    client_app.jdp.load(initial_model(cfg), _evaluate_msg(ctx, shared), ctx, fit=fit)
    assert len(fits) == 1  # fitted once per broadcast


def test_owners_data_is_read_as_the_run_config_says(monkeypatch):
    """The node's data-dir, the seed and every partition setting reach the loader."""
    seen = {}
    from flwr_jdp.joint_dp import seed_model

    monkeypatch.setattr(seed_model, "load_partitions", lambda *a: seen.setdefault("partitions", a))
    cfg = parse_config({"num-owners": 5, "seed": 9, "data-dir": "/data/here", "classes-per-owner": 3,
                        "validation-fraction": 0.2})
    task.owner_data(cfg)
    assert seen["partitions"] == (cfg.dataset, "/data/here", 5, 3, cfg.max_records, cfg.records_per_user, 9,
                                  cfg.partitioner, 0.2, cfg.validation_source)
