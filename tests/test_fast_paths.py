"""Speed-ups that must not change a single number: the no-grad pooling path, the
written-out SGD step, the per-process model template, the frozen personal layers of
a DP-SGD release and the public personal values swapped into the owner's model for
its release instead of a copy (flwr_jdp/joint_dp/release.py); and the set-up's waits
and retries."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from apps.joint_dp.joint_dp import client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from apps.joint_dp.joint_dp.task import initial_model, loader, node_job_config, owner_data
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_store import (
    load_personal_arrays,
    owner_generator,
    save_personal_arrays,
    shared_arrays,
    shared_digest,
)
from flwr_jdp.joint_dp.protocol import to_record
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.models.pooling import MaxPool2x2
from flwr_jdp.params import get_arrays, set_arrays, split_parameters
from flwr_jdp.training import train_plain
from flwr_jdp.training.user_loop import private_training
from tests.helpers import own_app_owner


@pytest.mark.parametrize("shape", [(3, 4, 28, 28), (2, 8, 14, 14), (2, 3, 7, 7), (1, 2, 5, 6)])
def test_maxpool_matches_torch_with_and_without_grad(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    x[0, 0, 0, :2] = 1.0  # a tie inside one window
    ref = torch.nn.MaxPool2d(2)
    with torch.no_grad():
        assert torch.equal(MaxPool2x2()(x), ref(x))
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_a, out_b = MaxPool2x2()(a), ref(b)
    assert torch.equal(out_a, out_b)
    weights = torch.randn(out_a.shape, generator=gen)
    (out_a * weights).sum().backward()
    (out_b * weights).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_train_plain_is_torch_sgd():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    twin = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=37)
    train_plain(model, list(model.parameters()), x, y, epochs=3, batch_size=8, lr=0.1,
                generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(3):
        order = torch.randperm(len(yt), generator=gen)
        for start in range(0, len(yt), 8):
            idx = order[start : start + 8]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(twin(xt[idx]), yt[idx]).backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_initial_model_copies_are_independent(run_config):
    cfg = parse_config({**run_config, "method": "joint-dp"})
    data = owner_data(cfg)[0]
    first = initial_model(cfg)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    second = initial_model(cfg)
    assert all(not torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True))
    from flwr_jdp.models import build_model
    fresh = build_model(cfg.model, data.x_train.shape[1:], 10, cfg.norm, cfg.seed)
    for p, q in zip(second.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_shared_digest_same_for_record_and_arrays(run_config):
    cfg = parse_config({**run_config, "method": "joint-dp"})
    model = initial_model(cfg)
    split = split_parameters(model, cfg.effective_personal_rule)
    arrays = get_arrays(model, split.shared)
    record = to_record(arrays)
    assert shared_digest(record) == shared_digest(arrays) == shared_digest(shared_arrays(record))
    assert shared_digest(None) == shared_digest({})


class _JoiningGrid:
    """A grid whose nodes connect one per ``get_node_ids`` call, up to ``total``."""

    def __init__(self, total):
        self.total, self.calls = total, 0

    def get_node_ids(self):
        self.calls += 1
        return list(range(min(self.total, self.calls)))


@pytest.mark.parametrize("total,owners,settle", [
    (4, 4, 60.0),  # as many nodes as owners: no more can come, stop at once
    (2, 8, 0.3),   # fewer nodes than owners: stop once the count has settled
    (3, 3, 0.0),   # settle 0: no wait at all
])
def test_wait_for_nodes(run_config, total, owners, settle):
    from flwr_jdp.strategies import JointDP

    strategy = JointDP(parse_config({**run_config, "num-owners": owners}), node_settle_s=settle)
    grid = _JoiningGrid(total)
    strategy._wait_for_nodes(grid, deadline=float("inf"), poll=0.01)
    if settle == 0:
        assert grid.calls == 0
    elif total >= owners:
        assert grid.calls == owners  # returned on the call that saw the last node
    else:
        assert grid.calls > total + 1  # kept polling after the last node, then stopped


def _dp_setup(unit):
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import split_parameters

    torch.manual_seed(3)
    model = SeedCNN(1, 28, 10)
    split = split_parameters(model, r"^fc1\.")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(24, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=24)
    users = np.repeat(np.arange(8), 3) if unit == "user" else None
    return model, split, x, y, users


@pytest.mark.parametrize("unit", ["record", "user"])
def test_frozen_personal_layers_change_no_released_number(unit, monkeypatch):
    """The decoupled DP-SGD release and the central clipped sum take the personal
    parameters out of autograd (Opacus then skips their per-sample gradients);
    the shared parameters and sums must equal those of the unfrozen computation
    bit for bit, and the personal parameters' flags must be restored."""
    import contextlib

    from flwr_jdp.training import dp_sgd

    def release(model, split, x, y, users):
        gen = torch.Generator().manual_seed(7)
        dp_sgd.train_dp_sgd(model, split, x, y, user_ids=users, noise_multiplier=1.3,
                            clipping_norm=0.5, sample_rate=0.5, steps=4, lr=0.1,
                            personal_lr=0.0, generator=gen)
        sums, _ = dp_sgd.clipped_gradient_sum(model, split, x, y, user_ids=users, clipping_norm=0.5,
                                              sample_rate=0.5, generator=gen)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, sums

    model, split, x, y, users = _dp_setup(unit)
    twin = copy.deepcopy(model)
    fast_state, fast_sums = release(model, split, x, y, users)
    assert all(p.requires_grad for p in model.parameters())
    monkeypatch.setattr(dp_sgd, "_frozen", lambda params: contextlib.nullcontext())
    ref_state, ref_sums = release(twin, split, x, y, users)
    for name in ref_state:
        assert torch.equal(fast_state[name], ref_state[name]), name
    for a, b in zip(fast_sums, ref_sums, strict=True):
        assert np.array_equal(a, b)
    for name in split.personal:  # decoupled: personal parameters untouched
        assert torch.equal(fast_state[name], dict(_dp_setup(unit)[0].state_dict())[name])


def _owner_node(run_config, owner):
    """The own app's set-up for ``owner`` (as the server sends it); returns the
    context, the public personal values and the shared broadcast."""
    ctx, cfg, rec, split = own_app_owner(run_config, owner, 4)
    public = {n: rec[n].numpy() for n in split.personal}
    shared = {n: rec[n].numpy() for n in split.shared}
    InProcessGrid(client_app.app, 1, ctx.run_config)  # stamps message identities
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: to_record(public)}),
                    dst_node_id=ctx.node_id, message_type=MessageType.QUERY)
    setup = client_app.app(query, ctx)
    assert setup.has_content(), setup.error.reason
    return ctx, public, shared


@pytest.mark.parametrize("placement,unit", [("local", "record"), ("local", "user"), ("central", "record")])
def test_release_on_swapped_public_personal_equals_release_on_a_copy(run_config, placement, unit):
    """The decoupled release is computed on the owner's model with the public personal
    values swapped in (:func:`~flwr_jdp.joint_dp.release.public_personal_swapped`),
    instead of on a copy: the arrays the client half releases must be the copy's bit
    for bit, and the owner's model (values, flags, training mode) and its saved
    personal state must come out as they went in."""
    run_config.update({"method": "joint-dp", "noise-placement": placement, "privacy-unit": unit,
                       "records-per-user": 3})
    owner = 1
    ctx, public, shared = _owner_node(run_config, owner)
    cfg = node_job_config(ctx)
    data = owner_data(cfg)[owner]
    model = initial_model(cfg)
    split = split_parameters(model, cfg.effective_personal_rule)
    # personal state unlike the public values, already fitted on this broadcast (so
    # the round fits nothing and only the release touches the model)
    mine = {n: v + np.float32(1.0) for n, v in public.items()}
    save_personal_arrays(ctx, owner, mine, "s1", fit_on=shared_digest(shared))
    users = np.unique(data.user_ids, return_inverse=True)[1] if unit == "user" else np.arange(len(data.y_train))
    schedule = build_schedule(cfg, {owner: OwnerSize(len(data.y_train), int(users.max()) + 1)})
    q, steps = schedule.owner_rates[owner], min(3, schedule.owner_steps[owner])
    instruction = ConfigRecord({protocol.ROUND: 1, protocol.OWNERS: [owner], protocol.SAMPLE_RATES: [q],
                                protocol.STEPS: [steps], protocol.NOISE_MULTIPLIER: 1.0, protocol.SESSION: "s1"})
    msg = Message(RecordDict({protocol.SHARED: to_record(shared), protocol.CONFIG: instruction}),
                  dst_node_id=ctx.node_id, message_type=MessageType.TRAIN)
    own = loader(cfg, data, torch.Generator().manual_seed(0))
    train_fn = client_app._train_fn(cfg, own, torch.Generator().manual_seed(1))
    model.eval()
    reply = client_app.jdp.train(msg, ctx, model, own, train_fn)
    assert reply.has_content(), reply.error.reason
    fast = {k: reply.content["arrays"][k].numpy() for k in reply.content["arrays"].keys()}

    copy_ = initial_model(cfg)  # the copy: broadcast shared values, public personal values, frozen
    set_arrays(copy_, shared)
    set_arrays(copy_, public)
    for n, p in copy_.named_parameters():
        p.requires_grad_(n in split.shared)
    central = placement == "central"
    with private_training(copy_, own, unit_of_record=torch.from_numpy(users.astype(np.int64)),
                          num_units=int(users.max()) + 1, sample_rate=q, steps=1 if central else steps,
                          noise_multiplier=1.0, clipping_norm=cfg.clipping_norm,
                          generator=owner_generator(cfg, 1, owner), capture=central) as (private, ploader, record):
        train_fn(private, ploader)
    if central:
        ref = {n: s.detach().numpy().astype(np.float32) for n, s in zip(split.shared, record.clipped_sum, strict=True)}
    else:
        ref = get_arrays(copy_, split.shared)
    assert list(fast) == list(ref) == list(split.shared)
    for n in split.shared:
        assert np.array_equal(fast[n], ref[n]), n
    assert any(not np.array_equal(fast[n], shared[n]) for n in split.shared)  # a release happened
    after = get_arrays(model, split.shared + split.personal)
    for n in split.shared:
        assert np.array_equal(after[n], shared[n]), n
    for n in split.personal:
        assert np.array_equal(after[n], mine[n]), n
        assert np.array_equal(load_personal_arrays(ctx, owner, "s1")[n], mine[n]), n
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m.training for m in model.modules())


class _SetupGrid:
    """Two connected nodes hosting owners {0, 1} and {2, 3} with the seed CNN;
    ``silent`` nodes drop the first ``silent[n]`` set-up queries sent to them (busy or
    still starting)."""

    def __init__(self, silent, model):
        from types import SimpleNamespace

        self.silent, self.asked = dict(silent), []
        self._ns = SimpleNamespace
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = ["x".join(str(d) for d in p.shape) for _, p in model.named_parameters()]

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.asked.append(node)
            if self.silent.get(node, 0) > 0:
                self.silent[node] -= 1
                continue
            owners = [0, 1] if node == 1 else [2, 3]
            rec = {protocol.OWNER_IDS: owners, protocol.NUM_RECORDS: [10, 10], protocol.NUM_USERS: [10, 10],
                   protocol.PARAM_NAMES: self.names, protocol.PARAM_SHAPES: self.shapes}
            replies.append(self._ns(has_error=lambda: False, metadata=self._ns(src_node_id=node),
                                    content={protocol.SETUP: rec}))
        return replies


def test_setup_asks_a_silent_node_again_and_names_it_if_it_never_answers(run_config, monkeypatch):
    """A node that misses the set-up query is asked again before the deadline; one that
    never answers is reported as silent (not as a 'num-owners' mismatch), and a real
    mismatch, where every node answered, still names the key."""
    from types import SimpleNamespace

    import flwr_jdp.strategies.joint_dp.nodes as module
    from flwr_jdp.joint_dp.config import ConfigError
    from flwr_jdp.strategies import JointDP

    # outside a Flower run a Message cannot be built; the grid only reads its address
    monkeypatch.setattr(module, "Message", lambda content, dst_node_id, message_type:
                        SimpleNamespace(metadata=SimpleNamespace(dst_node_id=dst_node_id)))

    cfg = parse_config({**run_config, "num-owners": 4})
    model, arrays = initial_model(cfg), initial_arrays(cfg)
    grid = _SetupGrid({2: 1}, model)
    JointDP(cfg, node_settle_s=0).setup(grid, timeout=30.0, initial_arrays=arrays)
    assert grid.asked == [1, 2, 2]  # node 2 asked again, node 1 not

    with pytest.raises(RuntimeError, match=r"1 of 2 connected nodes did not answer the set-up query within 1.5 s \(nodes \[2\]\)"):
        JointDP(cfg, node_settle_s=0).setup(_SetupGrid({2: 10**6}, model), timeout=1.5, initial_arrays=arrays)

    with pytest.raises(ConfigError, match=r"'num-owners'=5 but no node hosts owners \[4\]"):
        JointDP(parse_config({**run_config, "num-owners": 5}), node_settle_s=0).setup(
            _SetupGrid({}, model), timeout=1.5, initial_arrays=arrays)
