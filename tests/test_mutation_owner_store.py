"""An owner's state on its node (flwr_jdp/joint_dp/owner_store.py, owner_state.py),
written for mutation testing (docs/mutation.md): personal arrays saved equal
personal arrays loaded (``context.state`` and, after a restart, the node's
``state-dir``), the rounds and broadcast they were fitted on, the owner's own
ledger charged before anything is trained, the instruction read strictly, the
per-round generator. No data set, no Flower run."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from flwr_jdp.joint_dp import owner_state, protocol
from flwr_jdp.joint_dp.config import parse_config
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
from flwr_jdp.models import build_model
from flwr_jdp.params import get_arrays, split_parameters


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
        ledger = load_owner_ledger(ctx, o, "s", agreed, "record")
        assert ledger.releases == 1 and ledger.epsilon() > 0 and ledger.ledger.unit == "record"
        on_disk = json.loads((tmp_path / "s" / f"ledger-{o}.json").read_text())
        assert [r["round"] for r in on_disk["rounds"]] == [1] and on_disk["rounds"][0]["note"] == "session s"
        assert load_owner_ledger(_ctx({"state-dir": str(tmp_path)}), o, "s", agreed, "record").releases == 1
        assert ledger.ledger.scope_event(next(iter(ledger.ledger.scopes))) == agreed.event(ok[o])
    # one owner's refusal refuses the message: nobody is charged for it
    bad = {1: Instruction(2, 0.1, 10, 1.0), 2: Instruction(2, 0.9, 5, 1.0)}
    with pytest.raises(InstructionRefused, match="owner 2: .*sampling rate"):
        charge_owners(cfg, ctx, sizes, bad, "s")
    for o in (1, 2):
        assert load_owner_ledger(ctx, o, "s", agreed_release(cfg, sizes[o]), "record").releases == 1
    assert load_owner_ledger(_ctx(), 1, "s", agreed_release(cfg, sizes[1]), "record").releases == 0
    # the node restarts: each owner's ledger is read back from its state-dir before the next charge
    restarted = _ctx({"state-dir": str(tmp_path)})
    charge_owners(cfg, restarted, sizes, {o: dataclasses.replace(i, server_round=2) for o, i in ok.items()}, "s")
    for o in (1, 2):
        on_disk = json.loads((tmp_path / "s" / f"ledger-{o}.json").read_text())
        assert [r["round"] for r in on_disk["rounds"]] == [1, 2]


def test_an_owner_stops_at_its_budget_and_a_node_cap_lowers_it():
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
    ledger = load_owner_ledger(ctx, 0, "s", agreed_release(cfg, sizes[0]), "record")
    assert ledger.releases == charged and ledger.epsilon() <= 2.0
    capped = _ctx({"max-epsilon": 0.5})
    with pytest.raises(InstructionRefused, match="budget 0.5"):
        for rnd in range(1, charged + 1):
            charge_owners(cfg, capped, sizes, {0: dataclasses.replace(step[0], server_round=rnd)}, "s")
    assert load_owner_ledger(capped, 0, "s", agreed_release(cfg, sizes[0], 0.5), "record").releases < charged


def test_nothing_is_charged_by_owners_under_central_noise_or_without_dp():
    sizes = {0: OwnerSize(100, 100)}
    for cfg in (parse_config({"noise-placement": "central"}), parse_config({"method": "fedavg"})):
        ctx = _ctx()
        charge_owners(cfg, ctx, sizes, {0: Instruction(1, 0.9, 99, 0.0)}, "s")  # not checked either
        assert not any(k.startswith("ledger.") for k in ctx.state.keys())


# ------------------------------------------------------------------ owner_state
def test_node_config_names_the_owners_a_node_hosts_and_its_data_dir():
    cfg = parse_config({"num-owners": 10})
    assert owner_state.my_owners(cfg, _ctx({"partition-id": 1, "num-partitions": 3})) == \
        protocol.hosted_owners(10, 1, 3)
    assert owner_state.my_owners(cfg, _ctx()) == list(range(10))
    for bad in ({"partition-id": 3, "num-partitions": 3}, {"partition-id": -1, "num-partitions": 3}):
        with pytest.raises(ValueError, match="partition-id"):
            owner_state.my_owners(cfg, _ctx(bad))
    ctx = _ctx({"data-dir": "/elsewhere"}, {"num-owners": 4})
    assert owner_state.node_job_config(ctx).data_dir == "/elsewhere"
    assert owner_state.node_job_config(_ctx({}, {"num-owners": 4, "data-dir": "/x"})).data_dir == "/x"


@dataclasses.dataclass
class _Data:
    owner_id: int
    x_train: np.ndarray


@pytest.fixture
def tiny_model(monkeypatch):
    """The seed CNN on 1x12x12 inputs, 3 classes (no data set read)."""
    monkeypatch.setattr(owner_state, "num_classes", lambda cfg: 3)
    owner_state._initial_model.cache_clear()
    yield _Data(owner_id=6, x_train=np.zeros((2, 1, 12, 12), np.float32))
    owner_state._initial_model.cache_clear()


def test_the_owner_model_is_the_broadcast_plus_its_own_personal_state(tiny_model, tmp_path):
    cfg = parse_config({"num-owners": 8})
    model, split = owner_state.new_model(cfg, tiny_model)
    assert split.personal and split.shared
    seeded = dict(get_arrays(model, split.personal))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a copy: the next model starts from the seeded values again
    again, _ = owner_state.new_model(cfg, tiny_model)
    _same(dict(get_arrays(again, split.personal)), seeded)

    ctx = _ctx({"state-dir": str(tmp_path)})
    shared = {n: np.full(a.shape, 0.25, a.dtype) for n, a in get_arrays(again, split.shared).items()}
    fresh, _ = owner_state.load_owner_model(cfg, ctx, tiny_model, protocol.to_record(shared), "s")
    _same(dict(get_arrays(fresh, split.personal)), seeded)  # no state yet: the seeded values
    _same(dict(get_arrays(fresh, split.shared)), shared)
    mine = {n: np.full(a.shape, -0.5, a.dtype) for n, a in seeded.items()}
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            if n in mine:
                p.copy_(torch.from_numpy(mine[n]))
    owner_state.save_personal(ctx, 6, fresh, split, "s", fit_on="x")
    assert trained_rounds(ctx, 6, "s") == 1 and personal_fit_on(ctx, 6, "s") == "x"
    for context in (ctx, _ctx({"state-dir": str(tmp_path)})):  # also after a restart, from disk
        loaded, _ = owner_state.load_owner_model(cfg, context, tiny_model, shared, "s")
        _same(dict(get_arrays(loaded, split.personal)), mine)
        _same(dict(get_arrays(loaded, split.shared)), shared)
    unchanged, _ = owner_state.load_owner_model(cfg, ctx, tiny_model, None, "s")
    _same(dict(get_arrays(unchanged, split.shared)), dict(get_arrays(again, split.shared)))


def test_public_personal_values_are_seeded_or_a_zero_head(tiny_model):
    cfg = parse_config({"num-owners": 8, "release-personal": "seeded", "personal-layers": r"^(conv1|fc1)\."})
    model, split = owner_state.new_model(cfg, tiny_model)
    seeded = owner_state.public_personal(cfg, tiny_model)
    _same(seeded, dict(get_arrays(model, split.personal)))
    seeded[next(iter(seeded))] += 1.0  # a fresh copy each time
    _same(owner_state.public_personal(cfg, tiny_model), dict(get_arrays(model, split.personal)))
    zero = owner_state.public_personal(dataclasses.replace(cfg, release_personal="zero-head"), tiny_model)
    head = tuple(model.HEAD_PREFIXES)
    assert head and any(n.startswith(head) for n in zero) and any(not n.startswith(head) for n in zero)
    for n, v in zero.items():
        assert v.shape == seeded[n].shape and v.dtype == seeded[n].dtype
        if n.startswith(head):
            assert not v.any()
        else:
            np.testing.assert_array_equal(v, seeded[n] if n != next(iter(seeded)) else v)
            assert v.any()


def test_the_initial_model_split_allows_no_personal_layer_only_outside_joint_dp(tiny_model):
    fedavg = parse_config({"num-owners": 8, "method": "fedavg"})
    _, split = owner_state.new_model(fedavg, tiny_model)
    assert split.personal == () or list(split.personal) == []
    model = build_model(fedavg.model, (1, 12, 12), 3, fedavg.norm, fedavg.seed)
    with pytest.raises(ValueError):
        split_parameters(model, "^nothing$")
    assert isinstance(protocol.to_record(_arrays()), ArrayRecord)


def test_an_evaluation_save_records_the_fit_but_no_trained_round(tiny_model):
    cfg = parse_config({"num-owners": 8})
    model, split = owner_state.new_model(cfg, tiny_model)
    ctx = _ctx()
    owner_state.save_personal(ctx, 6, model, split, fit_on="d1")
    owner_state.save_personal(ctx, 6, model, split, fit_on="d2", count_round=False)
    assert trained_rounds(ctx, 6) == 1 and personal_fit_on(ctx, 6) == "d2"


def test_owners_data_is_read_as_the_run_config_says(monkeypatch):
    """The node's data-dir, the seed and every partition setting reach the loaders."""
    seen = {}
    monkeypatch.setattr(owner_state, "load_partitions", lambda *a: seen.setdefault("partitions", a))
    monkeypatch.setattr(owner_state, "load_dataset",
                        lambda *a: seen.setdefault("dataset", a) and type("D", (), {"num_classes": 7})())
    cfg = parse_config({"num-owners": 5, "seed": 9, "data-dir": "/data/here", "classes-per-owner": 3,
                        "validation-fraction": 0.2})
    owner_state.owner_data(cfg)
    assert seen["partitions"] == (cfg.dataset, "/data/here", 5, 3, cfg.max_records, cfg.records_per_user, 9,
                                  cfg.partitioner, 0.2, cfg.validation_source)
    assert owner_state.num_classes(cfg) == 7 and seen["dataset"] == (cfg.dataset, "/data/here", 9)
