"""Decoupled personal parameters: an owner's shared release does not depend on its
personal state, so DP-SGD's per-unit sensitivity argument holds (record/user units).
Checked through the client half (JointDPClient) in flwr-jdp's own ClientApp; the
joint-DP paper's interleaved coupling is refused."""

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from apps.joint_dp.joint_dp import client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from apps.joint_dp.joint_dp.task import initial_model, loader, node_job_config, owner_data
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_store import load_personal_arrays, save_personal_arrays, shared_digest
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.params import get_arrays, split_parameters

from .helpers import run_inprocess

OWNER = 1


def _cfg(run_config, **extra):
    run_config.update({"method": "joint-dp", **extra})
    return parse_config(run_config)


def _context(run_config, owner=OWNER):
    """The context the own app's handlers see for ``owner``."""
    return Context(run_id=1, node_id=1000 + owner, node_config={"partition-id": owner, "num-partitions": 4},
                   state=RecordDict(), run_config=dict(run_config))


def _initial(cfg):
    """The server's initial arrays split into public personal values and shared ones."""
    rec = initial_arrays(cfg)
    split = split_parameters(initial_model(cfg), cfg.effective_personal_rule)
    return {n: rec[n].numpy() for n in split.personal}, {n: rec[n].numpy() for n in split.shared}


def _message(ctx, content, message_type):
    InProcessGrid(client_app.app, 1, ctx.run_config)  # stamps message identities
    return Message(RecordDict(content), dst_node_id=ctx.node_id, message_type=message_type)


def _set_up(ctx, public):
    reply = client_app.app(_message(ctx, {protocol.CONFIG: ConfigRecord(),
                                          protocol.PUBLIC_PERSONAL: protocol.to_record(public)},
                                    MessageType.QUERY), ctx)
    return reply


def _train_msg(ctx, shared, cfg, size):
    schedule = build_schedule(cfg, {OWNER: size})
    instruction = ConfigRecord({
        protocol.ROUND: 1, protocol.OWNERS: [OWNER], protocol.SAMPLE_RATES: [schedule.owner_rates[OWNER]],
        protocol.STEPS: [min(3, schedule.owner_steps[OWNER])], protocol.NOISE_MULTIPLIER: 1.0,
        protocol.SESSION: "s1"})
    return _message(ctx, {protocol.SHARED: protocol.to_record(shared), protocol.CONFIG: instruction},
                    MessageType.TRAIN)


def _round(run_config, public=None, personal=None):
    """One train round of the owner through the own app's handler on a fresh node: the
    set-up sends ``public`` (default: the server's public values), the owner starts
    from ``personal`` (default: none yet). Returns (release, the personal state it
    saved, the public values)."""
    ctx = _context(run_config)
    cfg = node_job_config(ctx)
    server_public, shared = _initial(cfg)
    public = server_public if public is None else public
    setup = _set_up(ctx, public)
    assert setup.has_content(), setup.error.reason
    if personal is not None:
        save_personal_arrays(ctx, OWNER, personal, "s1")
    rec = setup.content[protocol.SETUP]
    reply = client_app.app(_train_msg(ctx, shared, cfg, OwnerSize(rec[protocol.NUM_RECORDS][0],
                                                                  rec[protocol.NUM_USERS][0])), ctx)
    assert reply.has_content(), reply.error.reason
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    release = {k: reply.content["arrays"][k].numpy() for k in reply.content["arrays"].keys()}
    return release, load_personal_arrays(ctx, OWNER, "s1"), public


def _scrambled(public, seed):
    """Arbitrary other personal values (standing in for personal state trained on the
    owner's data)."""
    rng = np.random.default_rng(seed)
    return {n: v + rng.normal(size=v.shape).astype(v.dtype) for n, v in public.items()}


@pytest.mark.parametrize("release", ["seeded", "zero-head"])
@pytest.mark.parametrize("placement", ["local", "central"])
@pytest.mark.parametrize("unit", ["record", "user"])
def test_decoupled_release_ignores_personal_state(run_config, placement, unit, release):
    cfg = _cfg(run_config, **{"noise-placement": placement, "privacy-unit": unit,
                              "records-per-user": 3, "release-personal": release})
    assert cfg.decoupled
    public, shared = _initial(cfg)
    start_a, start_b = _scrambled(public, 1), _scrambled(public, 2)
    rel_a, kept_a, _ = _round(run_config, personal=start_a)
    rel_b, kept_b, _ = _round(run_config, personal=start_b)
    assert list(rel_a) == list(shared)
    for n in shared:
        np.testing.assert_array_equal(rel_a[n], rel_b[n])
    assert any(not np.array_equal(rel_a[n], shared[n]) for n in shared)  # a release happened
    # the owner keeps its own personal state, fitted from where it was (not the public values)
    for n in public:
        assert not np.array_equal(kept_a[n], kept_b[n]), n
        assert not np.array_equal(kept_a[n], public[n]), n
    assert any(not np.array_equal(kept_a[n], start_a[n]) for n in public)


def test_interleaved_coupling_is_refused(run_config):
    """The paper's Algorithm 1 takes the release's gradients through personal
    parameters fitted without noise, so its record-level guarantee does not hold:
    refused at start-up naming the key, by the own app before anything is trained or
    kept, and by the client half whatever the app's config function lets through."""
    with pytest.raises(ConfigError, match="'personal-coupling' must be 'decoupled'"):
        _cfg(dict(run_config), **{"personal-coupling": "interleaved"})
    with pytest.raises(ConfigError, match="personal-coupling"):
        run_inprocess(dict(run_config, **{"personal-coupling": "interleaved"}))

    bad = dict(run_config, **{"method": "joint-dp", "personal-coupling": "interleaved"})
    ctx = _context(bad)
    cfg = parse_config(run_config)
    public, shared = _initial(cfg)
    setup = _set_up(ctx, public)
    assert setup.has_error() and "personal-coupling" in setup.error.reason
    with pytest.raises(ConfigError, match="'personal-coupling' must be 'decoupled'"):  # Flower replies the error
        client_app.app(_train_msg(ctx, shared, cfg, OwnerSize(337, 337)), ctx)
    assert not [k for k in ctx.state.keys() if k.startswith(("personal.", "ledger."))]

    def interleaved(context):  # a user's config function that does not validate the key
        return dataclasses.replace(node_job_config(context), personal_coupling="interleaved")

    data = owner_data(cfg)[OWNER]
    jdp = JointDPClient(ClientApp(), model_fn=lambda: initial_model(cfg),
                        train_data=lambda context: loader(cfg, data, torch.Generator()), config_fn=interleaved)
    ctx = _context(run_config)
    with pytest.raises(ConfigError, match="'personal-coupling' must be 'decoupled'"):
        jdp.config(ctx)
    own = loader(cfg, data, torch.Generator().manual_seed(0))
    reply = jdp.train(_train_msg(ctx, shared, cfg, OwnerSize(len(data.y_train), len(data.y_train))), ctx,
                      initial_model(cfg), own, client_app._train_fn(cfg, own, torch.Generator()))
    assert reply.has_error() and "personal-coupling" in reply.error.reason
    assert not [k for k in ctx.state.keys() if k.startswith(("personal.", "ledger."))]


def test_decoupled_needs_public_values(run_config):
    """Without the set-up's public values (a node restarted after it) no release is
    computed: the reply names them and nothing is kept."""
    ctx = _context(dict(run_config, method="joint-dp"))
    cfg = node_job_config(ctx)
    _, shared = _initial(cfg)
    reply = client_app.app(_train_msg(ctx, shared, cfg, OwnerSize(337, 337)), ctx)
    assert reply.has_error() and "public initial personal values" in reply.error.reason
    assert load_personal_arrays(ctx, OWNER, "s1") is None


def test_owner_unit_is_not_decoupled(run_config):
    assert not _cfg(run_config, **{"privacy-unit": "owner"}).decoupled
    assert not _cfg(run_config, method="full-dp").decoupled


def test_the_personal_fit_trains_only_personal(run_config):
    """The own app's personal fit (``train`` on the owner's loader, through
    :meth:`JointDPClient.load`) moves the personal parameters only; the shared ones
    stay at the broadcast."""
    ctx = _context(dict(run_config, **{"method": "joint-dp", "local-epochs": 2}))
    cfg = node_job_config(ctx)
    public, shared = _initial(cfg)
    assert _set_up(ctx, public).has_content()
    own = loader(cfg, owner_data(cfg)[OWNER], torch.Generator().manual_seed(3))
    msg = _message(ctx, {protocol.SHARED: protocol.to_record(shared),
                         protocol.CONFIG: ConfigRecord({protocol.ROUND: 1, protocol.SESSION: "s1"})},
                   MessageType.EVALUATE)
    fit = client_app._train_fn(cfg, own, torch.Generator().manual_seed(4))
    model = client_app.jdp.load(initial_model(cfg), msg, ctx, fit=lambda m: fit(m, own))
    for n, v in get_arrays(model, tuple(shared)).items():
        np.testing.assert_array_equal(v, shared[n])
    fitted = get_arrays(model, tuple(public))
    assert any(not np.allclose(v, public[n]) for n, v in fitted.items())
    for n, v in load_personal_arrays(ctx, OWNER, "s1").items():
        np.testing.assert_array_equal(v, fitted[n])


def test_bad_coupling_names_the_key(run_config):
    run_config["personal-coupling"] = "tight"
    with pytest.raises(ConfigError, match="personal-coupling"):
        parse_config(run_config)


@pytest.mark.parametrize("placement", ["local", "central"])
def test_owners_end_fitted_on_the_final_broadcast(run_config, placement):
    """After a run, every owner's personal parameters were fitted (not the public
    init) against the final global shared parameters, the model it is evaluated with."""
    run_config.update({"noise-placement": placement, "num-rounds": 2})
    strategy, grid, result = run_inprocess(run_config, num_nodes=2)
    cfg = parse_config(run_config)
    public, _ = _initial(cfg)
    # result.arrays is the whole model (personal layers at their public values): the shared part
    digest = shared_digest({k: v.numpy() for k, v in result.arrays.items() if k not in public})
    fitted = 0
    for ctx in grid.contexts.values():
        for key in list(ctx.state.keys()):
            if key.startswith("personal.") and key.endswith(".meta"):
                assert ctx.state[key]["fit-on"] == digest
                assert int(ctx.state[key]["trained-rounds"]) == 2
                owner = int(key.split(".")[1])
                rec = ctx.state[f"personal.{owner}"]
                assert set(rec.keys()) == set(public)
                assert any(not np.allclose(rec[n].numpy(), public[n]) for n in public)
                fitted += 1
    assert fitted == cfg.num_owners


def test_zero_head_release_values(run_config):
    """``release-personal = zero-head``: personal head parameters are public zeros,
    personal parameters outside the head keep their seeded values."""
    cfg = _cfg(run_config, **{"personal-layers": r"^(conv1|fc1)\.", "release-personal": "zero-head"})
    seeded = _cfg(run_config, **{"release-personal": "seeded"})
    zero, init = _initial(cfg)[0], _initial(seeded)[0]
    assert set(zero) == {"conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias"} == set(init)
    for n in ("fc1.weight", "fc1.bias"):
        assert not np.any(zero[n]) and np.any(init[n])
    for n in ("conv1.weight", "conv1.bias"):
        np.testing.assert_array_equal(zero[n], init[n])


def test_zero_head_release_is_dp_sgd_on_a_zero_head_model(run_config):
    """The zero-head release equals the seeded release computed on a model whose
    seeded FC1 was replaced by zeros: only the public constant differs, so the
    release is the same DP-SGD mechanism (and ledger event) on the shared layers;
    and it differs from the seeded release (the key does act)."""
    zero_rc = dict(run_config, **{"method": "joint-dp", "release-personal": "zero-head"})
    seeded_rc = dict(run_config, **{"method": "joint-dp", "release-personal": "seeded"})
    rel_zero, _, zero_public = _round(zero_rc)
    rel_same, _, _ = _round(seeded_rc, public=zero_public)
    rel_seeded, _, seeded_public = _round(seeded_rc)
    assert any(not np.array_equal(zero_public[n], seeded_public[n]) for n in zero_public)
    for n in rel_zero:
        np.testing.assert_array_equal(rel_zero[n], rel_same[n])
    assert any(not np.array_equal(rel_zero[n], rel_seeded[n]) for n in rel_zero)


@pytest.mark.parametrize("extra,key", [({"method": "full-dp"}, "release-personal"),
                                       ({"privacy-unit": "owner"}, "release-personal"),
                                       ({"bogus": 1, "release-personal": "zeros"}, "release-personal"),
                                       ({"personal-coupling": "interleaved"}, "personal-coupling")])
def test_release_personal_outside_a_decoupled_release_names_the_key(run_config, extra, key):
    run_config.update({"method": "joint-dp", "release-personal": "zero-head", **extra})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_config(run_config)


def test_zero_head_reaches_the_clientapp_and_keeps_the_ledger(run_config, tmp_path):
    """Through the real ServerApp strategy and ClientApp: with the same noise seed, the
    zero-head run releases other shared parameters than the seeded one (the nodes read
    the key from the run config) and records exactly the same ledger events."""
    runs = {}
    for release in ("seeded", "zero-head"):
        cfg = dict(run_config, method="joint-dp", **{"release-personal": release,
                                                     "results-dir": str(tmp_path / release)})
        strategy, _, result = run_inprocess(cfg, num_nodes=2)
        runs[release] = (strategy, {k: v.numpy() for k, v in result.arrays.items()})
    (seeded, a), (zero, b) = runs["seeded"], runs["zero-head"]
    assert set(a) == set(b) and any(not np.array_equal(a[k], b[k]) for k in a)
    assert seeded.noise_multiplier == zero.noise_multiplier
    assert seeded.ledger.scopes == zero.ledger.scopes and seeded.ledger.scopes
    assert seeded.ledger.epsilon() == zero.ledger.epsilon()
