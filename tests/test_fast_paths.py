"""Speed-ups that must not change a single number: the no-grad pooling path, the
personal-head fit on cached trunk features, the written-out SGD step and the
per-process model template."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_round import _head_only, fit_personal
from flwr_jdp.joint_dp.owner_state import new_model, owner_data, shared_arrays, shared_digest
from flwr_jdp.joint_dp.protocol import to_record
from flwr_jdp.models.pooling import MaxPool2x2
from flwr_jdp.params import get_arrays
from flwr_jdp.training import train_plain


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


@pytest.mark.parametrize("rule,head_only", [(r"^fc1\.", True), (r"^(conv1|fc1)\.", False)])
def test_fit_personal_on_cached_features_equals_full_model(run_config, rule, head_only):
    cfg = parse_config({**run_config, "method": "joint-dp", "personal-layers": rule,
                        "local-epochs": 2, "batch-size": 7})
    data = owner_data(cfg)[1]
    model, split = new_model(cfg, data)
    assert _head_only(model, split) is head_only
    twin = copy.deepcopy(model)
    fit_personal(model, split, data, cfg, torch.Generator().manual_seed(5))
    params = dict(twin.named_parameters())
    train_plain(twin, [params[n] for n in split.personal], data.x_train, data.y_train,
                epochs=2, batch_size=7, lr=cfg.personal_learning_rate,
                generator=torch.Generator().manual_seed(5))
    after, ref = get_arrays(model, split.personal), get_arrays(twin, split.personal)
    for n in split.personal:
        np.testing.assert_allclose(after[n], ref[n], rtol=0, atol=1e-6)
    assert any(not np.array_equal(after[n], get_arrays(new_model(cfg, data)[0], split.personal)[n])
               for n in split.personal)  # the fit did move the personal parameters
    for n in split.shared:  # shared parameters untouched
        np.testing.assert_array_equal(get_arrays(model, (n,))[n], get_arrays(twin, (n,))[n])


def test_new_model_copies_are_independent(run_config):
    cfg = parse_config({**run_config, "method": "joint-dp"})
    data = owner_data(cfg)[0]
    first, split = new_model(cfg, data)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    second, _ = new_model(cfg, data)
    assert all(not torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True))
    from flwr_jdp.models import build_model
    fresh = build_model(cfg.model, data.x_train.shape[1:], 10, cfg.norm, cfg.seed)
    for p, q in zip(second.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_shared_digest_same_for_record_and_arrays(run_config):
    cfg = parse_config({**run_config, "method": "joint-dp"})
    model, split = new_model(cfg, owner_data(cfg)[0])
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


def test_fit_personal_with_no_records_is_a_no_op(run_config):
    import dataclasses

    cfg = parse_config({**run_config, "method": "joint-dp"})
    data = owner_data(cfg)[0]
    empty = dataclasses.replace(data, x_train=data.x_train[:0], y_train=data.y_train[:0])
    model, split = new_model(cfg, data)
    before = get_arrays(model, split.personal)
    assert np.isnan(fit_personal(model, split, empty, cfg, torch.Generator().manual_seed(0)))
    for n, v in get_arrays(model, split.personal).items():
        np.testing.assert_array_equal(v, before[n])


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


@pytest.mark.parametrize("placement,unit", [("local", "record"), ("local", "user"), ("central", "record")])
def test_release_on_swapped_public_personal_equals_release_on_a_copy(run_config, placement, unit):
    """The decoupled release is computed on the owner's model with the public personal
    values swapped in, instead of on a copy (:func:`release_model`): the released
    arrays must be the copy's bit for bit, and the owner's model (values, flags,
    training mode) must come out as it went in."""
    from flwr_jdp.joint_dp.owner_round import OwnerPlan, _decoupled_release, release_model, train_owner_round
    from flwr_jdp.joint_dp.owner_state import public_personal
    from flwr_jdp.privacy.mechanisms import torch_generator

    run_config.update({"method": "joint-dp", "noise-placement": placement, "privacy-unit": unit,
                       "records-per-user": 3})
    cfg = parse_config(run_config)
    data = owner_data(cfg)[1]
    model, split = new_model(cfg, data)
    with torch.no_grad():  # personal state unlike the public values
        for n, p in model.named_parameters():
            if n in split.personal:
                p.add_(1.0)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    public = public_personal(cfg, data)
    plan = OwnerPlan(sample_rate=0.5, steps=3, noise_multiplier=1.0)
    fast, _ = train_owner_round(model, split, data, cfg, plan, torch_generator(5), public)
    ref, _ = _decoupled_release(release_model(copy.deepcopy(model), split, public), split, data,
                                cfg, plan, torch_generator(5))
    assert list(fast) == list(ref) == list(split.shared)
    for n in split.shared:
        assert np.array_equal(fast[n], ref[n]), n
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert not any(m.training for m in model.modules())


class _SetupGrid:
    """Two connected nodes hosting owners {0, 1} and {2, 3}; ``silent`` nodes drop the
    first ``silent[n]`` set-up queries sent to them (busy or still starting)."""

    def __init__(self, silent):
        from types import SimpleNamespace

        self.silent, self.asked = dict(silent), []
        self._ns = SimpleNamespace

    def get_node_ids(self):
        return [1, 2]

    def send_and_receive(self, messages, timeout=None):
        from flwr_jdp.joint_dp import protocol

        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            self.asked.append(node)
            if self.silent.get(node, 0) > 0:
                self.silent[node] -= 1
                continue
            owners = [0, 1] if node == 1 else [2, 3]
            rec = {protocol.OWNER_IDS: owners, protocol.NUM_RECORDS: [10, 10], protocol.NUM_USERS: [10, 10],
                   protocol.IMAGE_SHAPE: [1, 28, 28], protocol.NUM_CLASSES: 10}
            replies.append(self._ns(has_error=lambda: False, metadata=self._ns(src_node_id=node),
                                    content={protocol.SETUP: rec}))
        return replies


def test_setup_asks_a_silent_node_again_and_names_it_if_it_never_answers(run_config, monkeypatch):
    """A node that misses the set-up query is asked again before the deadline; one that
    never answers is reported as silent (not as a 'num-owners' mismatch), and a real
    mismatch, where every node answered, still names the key."""
    from types import SimpleNamespace

    from flwr_jdp.strategies import JointDP

    import flwr_jdp.joint_dp.strategy as module
    from flwr_jdp.joint_dp.config import ConfigError

    # outside a Flower run a Message cannot be built; the grid only reads its address
    monkeypatch.setattr(module, "Message", lambda content, dst_node_id, message_type:
                        SimpleNamespace(metadata=SimpleNamespace(dst_node_id=dst_node_id)))

    cfg = parse_config({**run_config, "num-owners": 4})
    grid = _SetupGrid({2: 1})
    JointDP(cfg, node_settle_s=0).setup(grid, timeout=30.0)
    assert grid.asked == [1, 2, 2]  # node 2 asked again, node 1 not

    with pytest.raises(RuntimeError, match=r"1 of 2 connected nodes did not answer the set-up query within 1.5 s \(nodes \[2\]\)"):
        JointDP(cfg, node_settle_s=0).setup(_SetupGrid({2: 10**6}), timeout=1.5)

    with pytest.raises(ConfigError, match=r"'num-owners'=5 but no node hosts owners \[4\]"):
        JointDP(parse_config({**run_config, "num-owners": 5}), node_settle_s=0).setup(
            _SetupGrid({}), timeout=1.5)


def test_preload_opacus_imports_it_once_in_a_background_thread():
    """The set-up query's preload: one non-daemon thread per process, after which
    the first use finds the module (checked in a fresh process, where Opacus is not
    imported yet)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from flwr_jdp.training import dp_sgd\n"
        "assert 'opacus' not in sys.modules\n"
        "dp_sgd.preload_opacus()\n"
        "thread = dp_sgd._preload\n"
        "assert thread is not None and not thread.daemon\n"
        "dp_sgd.preload_opacus()\n"
        "assert dp_sgd._preload is thread\n"
        "from opacus import GradSampleModule\n"
        "thread.join()\n"
        "assert GradSampleModule.__module__.startswith('opacus.')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
