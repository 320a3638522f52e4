"""The drop-in client half (flwr_jdp/joint_dp/client.py) alone, written for mutation
testing (docs/mutation.md): the shared/personal split, the reply (shared release
only, the exact clipped release, the noise the owner adds), the personal state
loaded back each round and the refusals. A tiny model on a tiny loader, no Flower
run."""

import logging
import re

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import PUBLIC_KEY, JointDPClient, owner_id
from flwr_jdp.joint_dp.config import ConfigError, namespaced_config
from flwr_jdp.joint_dp.owner_store import load_personal_arrays, owner_generator, personal_key, trained_rounds
from flwr_jdp.params import split_parameters
from flwr_jdp.privacy import mechanisms
from flwr_jdp.training.user_loop import _SyntheticSet

RC = {"jdp.personal-layers": "^head\\.", "jdp.batch-size": 8, "jdp.local-epochs": 1, "jdp.num-rounds": 3,
      "jdp.target-epsilon": 50.0, "jdp.clipping-norm": 1.0, "jdp.accountant": "rdp"}
N = 40


class Wide(nn.Module):
    """Shared ``body`` (4 -> 64, 320 numbers), personal ``head`` (64 -> 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 64)
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _loader(n=N):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
                      batch_size=8)


def _sgd(lr=0.1):
    def fn(net, loader):
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return fn


def _node(rc, loader=None, node_id=7, node_config=None, **kwargs):
    app = ClientApp()
    loader = loader if loader is not None else _loader()
    jdp = JointDPClient(app, model_fn=Wide, train_data=lambda ctx: loader, **kwargs)
    ctx = Context(run_id=1, node_id=node_id, node_config={"partition-id": 0, "num-partitions": 1}
                  if node_config is None else node_config, state=RecordDict(), run_config=dict(RC, **rc))
    return app, jdp, ctx, loader


def _dry(loader) -> bool:  # noqa: ANN001
    """The DP pass's dry run (synthetic records) calls the train function too."""
    return isinstance(loader.dataset, _SyntheticSet)


def _net(seed=0):
    torch.manual_seed(seed)
    return Wide()


def _arrays(net, prefix):
    """Parameters whose name starts with ``prefix`` (also inside Opacus' wrapper)."""
    return {n.removeprefix("_module."): p.detach().numpy().copy() for n, p in net.named_parameters()
            if n.removeprefix("_module.").startswith(prefix)}


def _setup(app, ctx, public=None):
    InProcessGrid(app, 1, ctx.run_config)  # stamps message identities
    public = public if public is not None else _arrays(_net(), "head.")
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord(),
                                protocol.PUBLIC_PERSONAL: protocol.to_record(public)}),
                    dst_node_id=ctx.node_id, message_type=MessageType.QUERY)
    return app(query, ctx), public


def _instruction(ctx, shared, z, q, steps, rnd=1, owner=0):
    cfg = ConfigRecord({protocol.ROUND: rnd, protocol.OWNERS: [owner], protocol.SAMPLE_RATES: [q],
                        protocol.STEPS: [steps], protocol.NOISE_MULTIPLIER: z, protocol.SESSION: "s1"})
    return Message(RecordDict({protocol.SHARED: protocol.to_record(shared), protocol.CONFIG: cfg}),
                   dst_node_id=ctx.node_id, message_type=MessageType.TRAIN)


def _release(reply):
    assert reply.has_content(), reply.error.reason
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    return {k: reply.content["arrays"][k].numpy() for k in reply.content["arrays"].keys()}


def _norm(arrays):
    return float(np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in arrays.values())))


# ------------------------------------------------------------------ owner unit
def test_owner_unit_central_reply_is_the_shared_update_clipped_to_c_and_nothing_else():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "central"})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    for lr, clipped in ((5.0, True), (1e-4, False)):
        model = _net(2)
        reply = jdp.train(_instruction(ctx, shared, 1.0, 1.0, 1), ctx, model, loader, _sgd(lr))
        release = _release(reply)
        assert set(release) == {"body.weight", "body.bias"}
        delta = {n: model.state_dict()[n].numpy() - shared[n] for n in release}  # the trained model
        if clipped:
            assert _norm(release) == pytest.approx(1.0, rel=1e-5) and _norm(delta) > 1.0
            for n in release:
                np.testing.assert_allclose(release[n], delta[n] / _norm(delta), rtol=1e-4, atol=1e-7)
        else:
            for n in release:
                np.testing.assert_allclose(release[n], delta[n], rtol=1e-4, atol=1e-9)
        assert all(v.dtype == np.float32 for v in release.values())
        assert int(reply.content["metrics"][protocol.NUM_EXAMPLES]) == N


def test_owner_unit_local_noise_is_z_c_per_coordinate():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "local",
                                   "jdp.noise-seed": 5, "jdp.clipping-norm": 0.5})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    release = _release(jdp.train(_instruction(ctx, shared, 3.0, 1.0, 1), ctx, _net(2), loader, _sgd(1e-6)))
    values = np.concatenate([v.ravel() for v in release.values()])
    assert values.std() == pytest.approx(1.5, rel=0.25)  # z C; 320 values; the update itself is ~1e-6
    assert abs(values.mean()) < 0.3


def _noise_only(rc, rnd, partition=0, reseed=0):
    """The owner-unit local release of an owner whose train function changes nothing:
    the owner's noise alone (a fresh node, round ``rnd``)."""
    app, jdp, ctx, loader = _node(dict({"jdp.privacy-unit": "owner", "jdp.noise-placement": "local",
                                        "jdp.noise-seed": 5}, **rc),
                                  node_config={"partition-id": partition, "num-partitions": 4})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    model = _net(2)
    torch.manual_seed(reseed)  # the global RNG must not matter
    reply = jdp.train(_instruction(ctx, shared, 2.0, 1.0, 1, rnd=rnd, owner=partition), ctx, model, loader,
                      lambda m, ld: None)
    return np.concatenate([v.ravel() for v in _release(reply).values()])


def test_owner_noise_is_reproducible_under_a_noise_seed_and_fresh_per_round_and_owner():
    first = _noise_only({}, 1)
    np.testing.assert_array_equal(first, _noise_only({}, 1, reseed=99))
    assert first.std() == pytest.approx(2.0, rel=0.25)
    assert not np.allclose(first, _noise_only({}, 2))
    assert not np.allclose(first, _noise_only({}, 1, partition=1))


def test_owner_noise_seeds_do_not_repeat_over_many_rounds():
    cfg = namespaced_config(dict(RC, **{"jdp.privacy-unit": "owner", "jdp.noise-placement": "local",
                                        "jdp.noise-seed": 5}))
    model = _net(0)
    split = split_parameters(model, cfg.effective_personal_rule)
    draws = {tuple(np.round(JointDPClient._owner_release(cfg, model, split, _loader(), lambda m, ld: None, 1.0,
                                                         owner_generator(cfg, r, 0))["body.bias"], 6))
             for r in range(1, 61)}
    assert len(draws) == 60


def test_secure_noise_comes_from_the_os_csprng(monkeypatch):
    calls = []
    real = mechanisms.secure_gaussian

    def spy(shape, std):
        calls.append((shape, std))
        return real(shape, std)

    monkeypatch.setattr(mechanisms, "secure_gaussian", spy)
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "local",
                                   "jdp.secure-noise": True, "jdp.clipping-norm": 0.5})
    _setup(app, ctx)
    _release(jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 2.0, 1.0, 1), ctx, _net(2), loader,
                       lambda m, ld: None))
    assert sorted(calls) == [((64,), 1.0), ((64, 4), 1.0)]


def test_a_non_finite_owner_update_is_a_zero_update_not_an_error_reply():
    """Whether the owner replies must not depend on its data: a non-finite update is zero
    (central noise: the release is zero), and the model is put back as it came (the
    personal values kept are the loaded ones, finite)."""
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "central"})
    _setup(app, ctx)
    net = _net(2)
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 1.0, 1), ctx, net, loader,
                      _sgd(float("nan")))
    assert not reply.has_error(), reply.error.reason
    assert all(not a.any() for a in reply.content["arrays"].to_numpy_ndarrays())
    saved = load_personal_arrays(ctx, 0, "s1")
    assert saved and all(np.isfinite(a).all() for a in saved.values())
    assert all(np.array_equal(saved[n], p.detach().numpy()) for n, p in net.named_parameters() if n in saved)


# ------------------------------------------------------------------ record unit
def _per_sample_clipped_sum(shared, public, loader, clip):
    net = Wide()
    net.load_state_dict({**{k: torch.from_numpy(v) for k, v in shared.items()},
                         **{k: torch.from_numpy(v) for k, v in public.items()}})
    params = [net.body.weight, net.body.bias]
    total = [torch.zeros_like(p) for p in params]
    x, y = loader.dataset.tensors
    for i in range(len(y)):
        grads = torch.autograd.grad(nn.functional.cross_entropy(net(x[i:i + 1]), y[i:i + 1]), params)
        norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
        for t, g in zip(total, grads):
            t += g * min(1.0, clip / (norm + 1e-6))
    return {"body.weight": total[0].numpy(), "body.bias": total[1].numpy()}


def test_record_unit_central_reply_is_the_clipped_gradient_sum_at_the_public_personal_values():
    """q = 1: the batch is every record; the reply is the sum of per-record gradients
    clipped to C, taken with the personal parameters at their public values (not
    the owner's fitted ones) and without noise (the server adds it)."""
    clip = 0.05
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central",
                                   "jdp.clipping-norm": clip})
    _, public = _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    model = _net(2)
    release = _release(jdp.train(_instruction(ctx, shared, 1.0, 1.0, 1), ctx, model, loader, _sgd(0.5)))
    want = _per_sample_clipped_sum(shared, public, loader, clip)
    for n in want:
        np.testing.assert_allclose(release[n], want[n], rtol=1e-4, atol=1e-6)
    assert _norm(release) <= clip * N
    # the model the user handed in keeps the owner's fitted personal values, saved as its state
    saved = load_personal_arrays(ctx, 0, "s1")
    assert set(saved) == {"head.weight", "head.bias"}
    assert not np.allclose(saved["head.weight"], public["head.weight"])
    np.testing.assert_array_equal(saved["head.weight"], model.head.weight.detach().numpy())


def test_record_unit_local_release_has_the_owners_noise_and_no_personal_array():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "local",
                                   "jdp.noise-seed": 1, "jdp.clipping-norm": 1.0})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    z, q, steps, lr = 2.0, 0.2, 5, 1.0
    release = _release(jdp.train(_instruction(ctx, shared, z, q, steps), ctx, _net(2), loader, _sgd(lr)))
    assert set(release) == {"body.weight", "body.bias"}
    moved = np.concatenate([(release[n] - shared[n]).ravel() for n in release])
    expected = lr * z * 1.0 / (q * N) * np.sqrt(steps)  # the noise dominates: gradients are clipped to C = 1
    assert moved.std() == pytest.approx(expected, rel=0.3)
    saved = load_personal_arrays(ctx, 0, "s1")
    for value in saved.values():
        for arr in release.values():
            assert not (arr.size == value.size and np.allclose(arr.ravel(), value.ravel()))


def test_each_round_starts_from_the_personal_state_the_last_one_saved():
    """Round 2's personal fit starts from what round 1 saved in ``context.state``, not
    from the public initial values; ``load`` for evaluation hands out the same."""
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _, public = _setup(app, ctx)
    starts = []

    def fn(net, loader_):
        if not _dry(loader_):
            starts.append(_arrays(net, "head."))
        _sgd(0.5)(net, loader_)

    jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 1.0, 1, rnd=1), ctx, _net(2), loader, fn)
    after_one = load_personal_arrays(ctx, 0, "s1")
    assert trained_rounds(ctx, 0, "s1") == 1
    np.testing.assert_array_equal(starts[0]["head.weight"], public["head.weight"])
    jdp.train(_instruction(ctx, _arrays(_net(3), "body."), 1.0, 1.0, 1, rnd=2), ctx, _net(4), loader, fn)
    assert len(starts) == 4  # per round: the personal fit, then the private release
    np.testing.assert_array_equal(starts[2]["head.weight"], after_one["head.weight"])
    np.testing.assert_array_equal(starts[3]["head.weight"], public["head.weight"])  # the release: public values
    assert trained_rounds(ctx, 0, "s1") == 2

    after_two = load_personal_arrays(ctx, 0, "s1")
    shared = _arrays(_net(3), "body.")
    evaluated = jdp.load(_net(5), _instruction(ctx, shared, 1.0, 1.0, 1), ctx)
    np.testing.assert_array_equal(evaluated.head.weight.detach().numpy(), after_two["head.weight"])
    np.testing.assert_array_equal(evaluated.body.weight.detach().numpy(), shared["body.weight"])


def test_load_fits_the_personal_layers_once_per_broadcast_with_the_shared_ones_frozen():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _, public = _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    calls = []

    def fit(m):
        calls.append([p.requires_grad for p in m.body.parameters()])
        _sgd(0.5)(m, loader)

    model = jdp.load(_net(2), _instruction(ctx, shared, 1.0, 1.0, 1), ctx, fit=fit)
    assert calls == [[False, False]]  # the shared parameters frozen during the fit...
    assert all(p.requires_grad for p in model.parameters())  # ...and trainable again after
    np.testing.assert_array_equal(model.body.weight.detach().numpy(), shared["body.weight"])
    fitted = load_personal_arrays(ctx, 0, "s1")
    np.testing.assert_array_equal(model.head.weight.detach().numpy(), fitted["head.weight"])
    assert not np.allclose(fitted["head.weight"], public["head.weight"])
    assert trained_rounds(ctx, 0, "s1") == 0  # an evaluation fit is not a trained round
    jdp.load(_net(2), _instruction(ctx, shared, 1.0, 1.0, 1), ctx, fit=fit)
    assert len(calls) == 1  # same broadcast: not fitted again
    jdp.load(_net(2), _instruction(ctx, _arrays(_net(3), "body."), 1.0, 1.0, 1), ctx, fit=fit)
    assert len(calls) == 2  # a new broadcast: fitted on it
    owner = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "central"})
    _setup(owner[0], owner[2])
    owner[1].load(_net(2), _instruction(owner[2], shared, 1.0, 1.0, 1), owner[2], fit=fit)
    assert len(calls) == 2  # owner unit: the personal layers are trained with the rest


def test_a_fit_that_makes_personal_values_non_finite_keeps_the_previous_ones(caplog):
    """Whatever the data (a non-finite record): the round goes on with the previous
    personal values (said on the node), the release is the same as with a fine fit."""
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _, public = _setup(app, ctx)

    def fn(net, loader_):  # the fit (on the user's own loader) diverges, the release is fine
        _sgd(float("inf") if loader_ is loader else 0.1)(net, loader_)

    with caplog.at_level(logging.WARNING, logger="flwr"):
        reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 1.0, 1), ctx, _net(2), loader, fn)
    assert reply.has_content(), reply.error.reason
    assert any("the previous personal values are kept" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(load_personal_arrays(ctx, 0, "s1")["head.weight"], public["head.weight"])


# ------------------------------------------------------------------ set-up and refusals
def test_setup_reports_the_owner_its_sizes_and_model_and_keeps_the_public_values():
    users = [i // 4 for i in range(N)]
    app, _, ctx, _ = _node({"jdp.privacy-unit": "user", "jdp.records-per-user": 4},
                           node_config={"partition-id": 3, "num-partitions": 5}, user_ids=lambda c: users)
    setup, public = _setup(app, ctx)
    rec = setup.content[protocol.SETUP]
    assert list(rec[protocol.OWNER_IDS]) == [3]
    assert list(rec[protocol.NUM_RECORDS]) == [N] and list(rec[protocol.NUM_USERS]) == [10]
    assert list(rec[protocol.PARAM_NAMES]) == ["body.weight", "body.bias", "head.weight", "head.bias"]
    assert list(rec[protocol.PARAM_SHAPES]) == ["64x4", "64", "2x64", "2"]
    kept = ctx.state[PUBLIC_KEY]
    np.testing.assert_array_equal(kept["head.weight"].numpy(), public["head.weight"])


def test_owner_id_is_the_partition_id_else_the_node_id():
    ctx = Context(run_id=1, node_id=9, node_config={"partition-id": 2}, state=RecordDict(), run_config={})
    assert owner_id(ctx) == 2
    ctx = Context(run_id=1, node_id=9, node_config={}, state=RecordDict(), run_config={})
    assert owner_id(ctx) == 9


@pytest.mark.parametrize("kwargs,match", [
    ({}, "needs JointDPClient\\(user_ids"),
    ({"user_ids": lambda c: [0] * (N - 1)}, f"{N - 1} ids for {N} training records"),
])
def test_the_user_unit_needs_one_user_id_per_record(kwargs, match):
    app, _, ctx, _ = _node({"jdp.privacy-unit": "user"}, **kwargs)
    setup, _ = _setup(app, ctx)
    assert setup.has_error() and __import__("re").search(match, setup.error.reason)
    assert setup.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def test_user_ids_are_renumbered_to_0_to_k_minus_1():
    app, jdp, ctx, _ = _node({"jdp.privacy-unit": "user"}, user_ids=lambda c: [10 + 7 * (i % 5) for i in range(N)])
    units, k = jdp._units(jdp.config(ctx), ctx, N)
    assert k == 5 and sorted(set(units.tolist())) == [0, 1, 2, 3, 4]
    assert units.tolist()[:6] == [0, 1, 2, 3, 4, 0]
    _, record, rctx, _ = _node({"jdp.privacy-unit": "record"})
    units, k = record._units(record.config(rctx), rctx, 6)
    assert k == 6 and units.tolist() == list(range(6))


def test_the_interleaved_coupling_is_refused():
    app, jdp, ctx, _ = _node({"jdp.personal-coupling": "interleaved"})
    with pytest.raises(ConfigError, match="must be 'decoupled'"):
        jdp.config(ctx)
    owner = _node({"jdp.personal-coupling": "interleaved", "jdp.privacy-unit": "owner"})
    with pytest.raises(ConfigError, match="jdp.personal-coupling' must be 'decoupled'"):
        owner[1].config(owner[2])  # refused for every unit: there is one coupling


def test_a_broadcast_that_does_not_match_the_model_is_refused():
    app, jdp, ctx, loader = _node({})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    shared["extra"] = np.zeros(2, np.float32)
    reply = jdp.train(_instruction(ctx, shared, 1.0, 0.2, 5), ctx, _net(2), loader, _sgd())
    assert reply.has_error() and "does not match" in reply.error.reason and "extra" in reply.error.reason


def test_public_values_missing_after_a_restart_are_named():
    app, jdp, ctx, loader = _node({})
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 5), ctx, _net(2), loader, _sgd())
    assert reply.has_error() and reply.error.reason == (
        "the public initial personal values from the set-up are missing (the node restarted after the "
        "set-up?): restart the run")
    _setup(app, ctx, public={"head.weight": np.zeros((2, 64), np.float32)})
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 5), ctx, _net(2), loader, _sgd())
    assert reply.has_error() and "head.bias" in reply.error.reason


class WithBuffer(Wide):
    """A buffer the forward pass updates in training mode (a running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x):
        if self.training:
            self.stat.add_(x.detach().mean(0))
        return super().forward(x)


class WithConstantBuffer(Wide):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return super().forward(x * self.scale)


def test_buffers_the_forward_pass_changes_are_refused_under_the_record_unit_only():
    app, jdp, ctx, loader = _node({})
    _setup(app, ctx)
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 5), ctx, WithBuffer(), loader,
                      _sgd())
    assert reply.has_error() and "changes its buffers ['stat']" in reply.error.reason
    app, jdp, ctx, loader = _node({})
    _setup(app, ctx)
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 5), ctx, WithConstantBuffer(), loader,
                      _sgd())
    assert reply.has_content(), reply.error.reason
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "central"})
    _setup(app, ctx)
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 1.0, 1), ctx, WithBuffer(), loader,
                      _sgd())
    assert reply.has_content()


def test_a_refused_instruction_trains_nothing_and_keeps_no_state():
    """The train function runs on no owner data (only the DP pass's dry run on synthetic
    records, which comes before the charge) and nothing is kept."""
    app, jdp, ctx, loader = _node({})
    _setup(app, ctx)
    calls = []

    def fn(m, ld):
        if _dry(ld):  # the dry run: synthetic records only
            return _sgd()(m, ld)
        calls.append(1)

    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 0.0, 0.2, 5), ctx, _net(2), loader, fn)
    assert reply.has_error() and reply.error.reason.startswith("refused: ")
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert calls == [] and personal_key(0) not in ctx.state
    bad_rule = _node({"jdp.personal-layers": "^nothing\\."})
    _setup(bad_rule[0], bad_rule[2])
    reply = bad_rule[1].train(_instruction(bad_rule[2], _arrays(_net(1), "body."), 1.0, 0.2, 5), bad_rule[2],
                              _net(2), loader, _sgd())
    assert reply.has_error() and "jdp.personal-layers" in reply.error.reason
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def test_setup_without_public_values_keeps_none():
    app, _, ctx, _ = _node({})
    InProcessGrid(app, 1, ctx.run_config)
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7, message_type=MessageType.QUERY)
    assert app(query, ctx).has_content() and PUBLIC_KEY not in ctx.state
    assert not isinstance(ctx.state.get(PUBLIC_KEY), ArrayRecord)


# ------------------------------------------------------------------ the node's state-dir
def test_personal_state_is_kept_in_the_sessions_folder_and_the_owners_ledger_beside_it(tmp_path):
    node = {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path)}
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "local"}, node_config=node)
    _setup(app, ctx)
    starts = []

    def fn(net, loader_):
        if not _dry(loader_):
            starts.append(_arrays(net, "head."))
        _sgd(0.5)(net, loader_)

    _release(jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 2.0, 1.0, 1, rnd=1), ctx, _net(2), loader, fn))
    saved = load_personal_arrays(ctx, 0, "s1")
    assert sorted(p.name for p in (tmp_path / "s1").iterdir()) == ["personal-0.npz"]
    ledger_file = tmp_path / "owners" / "ledger-0.json"  # not keyed by the session
    assert ledger_file.is_file()
    # the node restarts (a fresh context.state, the same state-dir): the owner continues
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "owner", "jdp.noise-placement": "local"}, node_config=node)
    _release(jdp.train(_instruction(ctx, _arrays(_net(3), "body."), 2.0, 1.0, 1, rnd=2), ctx, _net(4), loader, fn))
    np.testing.assert_array_equal(starts[1]["head.weight"], saved["head.weight"])
    assert trained_rounds(ctx, 0, "s1") == 2
    assert '"round": 2' in ledger_file.read_text()


def test_an_evaluation_fit_is_kept_on_disk_and_not_repeated_after_a_restart(tmp_path):
    node = {"partition-id": 0, "num-partitions": 1, "state-dir": str(tmp_path)}
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"},
                                  node_config=node)
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    calls = []

    def fit(m):
        calls.append(1)
        _sgd(0.5)(m, loader)

    fitted = jdp.load(_net(2), _instruction(ctx, shared, 1.0, 1.0, 1), ctx, fit=fit)
    assert (tmp_path / "s1" / "personal-0.npz").is_file()
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"},
                                  node_config=node)
    again = jdp.load(_net(5), _instruction(ctx, shared, 1.0, 1.0, 1), ctx, fit=fit)
    assert calls == [1]
    np.testing.assert_array_equal(again.head.weight.detach().numpy(), fitted.head.weight.detach().numpy())


def test_user_ids_are_asked_with_the_nodes_context():
    per_partition = {0: [i // 4 for i in range(N)], 1: [i // 2 for i in range(N)]}
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "user", "jdp.records-per-user": 4},
                                  user_ids=lambda c: per_partition[int(c.node_config["partition-id"])])
    setup, _ = _setup(app, ctx)
    assert list(setup.content[protocol.SETUP][protocol.NUM_USERS]) == [10]
    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 2.0, 0.2, 5), ctx, _net(2), loader, _sgd())
    assert reply.has_content(), reply.error.reason


# ------------------------------------------------------------------ the private round's settings
def test_record_noise_is_reproducible_under_a_noise_seed_whatever_the_global_rng():
    def release(reseed):
        app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "local",
                                       "jdp.noise-seed": 3})
        _setup(app, ctx)
        shared, model = _arrays(_net(1), "body."), _net(2)
        torch.manual_seed(reseed)
        return _release(jdp.train(_instruction(ctx, shared, 2.0, 0.2, 5), ctx, model, loader, _sgd()))

    a, b = release(0), release(1)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])


def test_the_users_loop_draws_secure_noise_when_asked(monkeypatch):
    calls = []
    real = mechanisms.secure_gaussian
    monkeypatch.setattr(mechanisms, "secure_gaussian", lambda shape, std: calls.append(std) or real(shape, std))
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "local",
                                   "jdp.secure-noise": True})
    _setup(app, ctx)
    _release(jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 2.0, 0.2, 5), ctx, _net(2), loader, _sgd()))
    assert calls and set(calls) == {2.0}  # z C per step, every step


def test_a_sum_reduced_loss_gives_the_same_per_record_gradients():
    """The user's loss sums over the batch: each record's term is used all the same;
    the release (q = 1, central, C large enough that nothing is clipped) is the sum of
    per-record gradients."""
    app = ClientApp()
    loader = _loader()
    jdp = JointDPClient(app, model_fn=Wide, train_data=lambda ctx: loader)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1}, state=RecordDict(),
                  run_config=dict(RC, **{"jdp.privacy-unit": "record", "jdp.noise-placement": "central",
                                         "jdp.clipping-norm": 1e6}))
    _, public = _setup(app, ctx)
    shared = _arrays(_net(1), "body.")

    def summed(net, loader_):
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
        for x, y in loader_:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y, reduction="sum").backward()
            opt.step()

    release = _release(jdp.train(_instruction(ctx, shared, 1.0, 1.0, 1), ctx, _net(2), loader, summed))
    want = _per_sample_clipped_sum(shared, public, loader, 1e6)
    for n in want:
        np.testing.assert_allclose(release[n], want[n], rtol=1e-4, atol=1e-6)


def test_central_noise_takes_one_batch_whatever_the_instruction_says():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _setup(app, ctx)
    batches = []

    def fn(net, loader_):
        if not _dry(loader_):
            batches.append(len(loader_))
        _sgd()(net, loader_)

    _release(jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 3), ctx, _net(2), loader, fn))
    assert batches == [5, 1]  # the personal fit on the user's loader, then one private batch


def test_a_central_round_without_a_step_is_refused():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _setup(app, ctx)

    def fn(net, loader_):
        if loader_ is loader:
            _sgd()(net, loader_)  # the personal fit; no step in the private round (nor its dry run)

    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 1.0, 0.2, 1), ctx, _net(2), loader, fn)
    assert reply.has_error() and "computed no torch loss" in reply.error.reason


def test_a_non_finite_release_is_an_error_reply():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "local"})
    _setup(app, ctx)

    def fn(net, loader_):
        _sgd(0.1 if loader_ is loader else float("inf"))(net, loader_)  # a fine fit, a diverging release

    reply = jdp.train(_instruction(ctx, _arrays(_net(1), "body."), 2.0, 0.2, 5), ctx, _net(2), loader, fn)
    assert reply.has_error() and "the release has non-finite values in ['body." in reply.error.reason
    assert personal_key(0) not in ctx.state


def test_the_personal_fit_is_not_repeated_on_the_same_broadcast():
    app, jdp, ctx, loader = _node({"jdp.privacy-unit": "record", "jdp.noise-placement": "central"})
    _setup(app, ctx)
    shared = _arrays(_net(1), "body.")
    calls = []

    def fn(net, loader_):
        if not _dry(loader_):
            calls.append(len(loader_))
        _sgd()(net, loader_)

    for rnd in (1, 2):
        _release(jdp.train(_instruction(ctx, shared, 1.0, 1.0, 1, rnd=rnd), ctx, _net(2), loader, fn))
    assert calls == [5, 1, 1]  # round 2: the same broadcast, the personal layers already fitted on it


class WithScalar(Wide):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.0))


def test_the_server_accepts_the_shapes_the_client_reports_also_for_a_scalar():
    from flwr_jdp.joint_dp.validation import spec_of
    from flwr_jdp.strategies.joint_dp import JointDP

    app = ClientApp()
    JointDPClient(app, model_fn=WithScalar, train_data=lambda ctx: _loader())
    ctx = _node({})[2]
    setup, _ = _setup(app, ctx)
    rec = setup.content[protocol.SETUP]
    assert "scalar" in list(rec[protocol.PARAM_SHAPES])
    server = JointDP(personal_layers=r"^fc\.")
    server.model_spec = spec_of(ArrayRecord(dict(WithScalar().named_parameters())))
    server._check_model(list(rec[protocol.PARAM_NAMES]), list(rec[protocol.PARAM_SHAPES]), 7)


def test_set_up_refuses_a_batchnorm_model_and_names_a_model_fn_it_cannot_call():
    """Both fail at set-up, before any owner ledger is charged."""
    class WithBN(Wide):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

    class NeedsClasses(Wide):
        def __init__(self, num_classes: int) -> None:  # a required argument that is not the Context
            super().__init__()
            self.head = nn.Linear(64, num_classes)

    for model_fn, match in ((WithBN, "BatchNorm1d, which mixes the records"), (NeedsClasses, "model_fn could not build the model")):
        app = ClientApp()
        JointDPClient(app, model_fn=model_fn, train_data=lambda ctx: _loader())
        ctx = _node({})[2]
        reply, _ = _setup(app, ctx)
        assert reply.has_error() and re.search(match, reply.error.reason), reply.error.reason


def test_a_train_instruction_not_addressed_to_this_owner_is_refused_not_raised():
    app, jdp, ctx, loader = _node({})
    _setup(app, ctx)
    instruction = _instruction(ctx, _arrays(_net(), "body."), 1.0, 0.5, 2, owner=5)  # not this node's owner 0
    reply = jdp.train(instruction, ctx, _net(), loader, _sgd())
    assert reply.has_error() and "not addressed to owners [0]" in reply.error.reason
