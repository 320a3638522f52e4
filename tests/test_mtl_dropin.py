"""DP-MTL on a user's own torch app: examples/quickstart-mtl (its own Net, data
loaders, train and test) under DPMeanRegularizedMTL.from_run_config and MTLClient,
in process.

Checks: the example trains with the ledger charging each noisy mean; every reply
carries only the task's own ball-projected model (train), its metrics (evaluate) or
its public set-up report; the regularizer's gradient ``lambda (w - w~)`` reaches the
user's optimizer; a model that does not match ``initial_arrays``, a wrong number of
tasks and a node failing at set-up each fail before any privacy is spent."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.mtl import protocol
from flwr_jdp.mtl.client import STATE_PREFIX, MTLClient, flatten, load_flat, mean_regularized
from flwr_jdp.mtl.config import namespaced_mtl_config
from flwr_jdp.strategies import DPMeanRegularizedMTL

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-mtl"


def _ours(name: str) -> bool:
    return name == "quickstart" or name.startswith("quickstart.")


@pytest.fixture(scope="module")
def example():
    """The example's modules; another example's ``quickstart`` package (same name)
    is put back afterwards."""
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if _ours(k)}
    sys.path.insert(0, str(EXAMPLE))
    try:
        from quickstart import client_app, task
    finally:
        sys.path.remove(str(EXAMPLE))
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    return client_app, task


@pytest.fixture
def run_config(tmp_path, fashion_mnist_dir):
    raw = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = flatten_dict(raw)
    cfg.update({"data-dir": str(fashion_mnist_dir), "num-records": 1200, "num-server-rounds": 2,
                "jdp.rounds": 2, "jdp.results-dir": str(tmp_path / "run")})
    return cfg


def _start(example, run_config, nodes=3, initial=None, **start_kwargs):
    client_app, task = example
    grid = InProcessGrid(client_app.app, nodes, run_config)
    strategy = DPMeanRegularizedMTL.from_run_config(run_config)
    initial = initial if initial is not None else ArrayRecord(task.Net().state_dict())
    kwargs = {"num_rounds": run_config["num-server-rounds"],
              "train_config": ConfigRecord({"lr": run_config["learning-rate"]}), "timeout": 30.0}
    kwargs.update(start_kwargs)
    result = strategy.start(grid=grid, initial_arrays=initial, **kwargs)
    return strategy, grid, result


def test_the_example_trains_and_only_projected_task_models_reach_the_aggregator(example, run_config):
    _, task = example
    seen = []

    def evaluate_fn(rnd, arrays):
        net = task.Net()
        net.load_state_dict(arrays.to_torch_state_dict())  # the noisy mean, as the user's model
        seen.append(rnd)

    strategy, grid, result = _start(example, run_config, evaluate_fn=evaluate_fn)
    radius = float(run_config["jdp.radius"])
    assert strategy.num_tasks == 3 and strategy.num_params == sum(p.numel() for p in task.Net().parameters())
    assert [r["round"] for r in strategy.ledger.rounds] == [1, 2]  # each noisy mean charged
    assert 0 < strategy.ledger.epsilon() <= float(run_config["jdp.target-epsilon"])
    assert seen == [0, 1, 2]
    final = result.evaluate_metrics_clientapp[2]
    assert final["tasks"] == 3 and final["num-examples"] == 240 and 0 <= final["eval_acc"] <= 1
    assert strategy.history[-1]["task_metrics"]["eval_acc"] == pytest.approx(final["eval_acc"])

    stored = {ctx.node_config["partition-id"]: ctx.state[STATE_PREFIX + str(ctx.node_config["partition-id"])]["w"].numpy()
              for ctx in grid.contexts.values()}
    trains = 0
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        keys = set(reply.content.keys())
        if protocol.MODELS in keys:  # train: the task's own projected w_k, nothing else
            trains += 1
            assert keys == {protocol.MODELS, protocol.METRICS}
            models = reply.content[protocol.MODELS]
            (key,) = models.keys()
            k = protocol.parse_task_key(key)
            assert reply.metadata.src_node_id == 1000 + k  # node i hosts task i (partition-id)
            w = models[key].numpy()
            assert w.shape == (strategy.num_params,) and np.linalg.norm(w) <= radius * (1 + 1e-9)
            assert dict(reply.content[protocol.METRICS]) == {"tasks": 1}
        elif protocol.SETUP in keys:
            assert keys == {protocol.SETUP}
        else:  # evaluate: the user's test metrics
            assert keys == {protocol.METRICS}
            assert set(reply.content[protocol.METRICS].keys()) == {"eval_loss", "eval_acc", "num-examples"}
    assert trains == 6
    last = {protocol.parse_task_key(k): a.numpy() for r in grid.sent if protocol.MODELS in r.content
            for k, a in r.content[protocol.MODELS].items()}  # each task's last model sent
    assert sorted(last) == [0, 1, 2]
    for k, w in last.items():  # what the task keeps is what it sent last
        np.testing.assert_array_equal(stored[k], w)


def test_a_model_that_does_not_match_initial_arrays_fails_before_any_spending(example, run_config):
    _, task = example
    wrong = dict(task.Net().state_dict())
    wrong["fc3.weight"] = torch.zeros(5, 84)
    with pytest.raises(ConfigError, match=r"has 44426 parameters, initial_arrays hold 44006 values"):
        _start(example, run_config, initial=ArrayRecord(wrong))
    swapped = dict(task.Net().state_dict())  # same count, another order
    swapped = {k: swapped[k] for k in sorted(swapped)}
    with pytest.raises(ConfigError, match="do not match the ClientApp's model"):
        _start(example, run_config, initial=ArrayRecord(swapped))
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()


def test_the_number_of_tasks_and_set_up_errors_fail_before_any_spending(example, run_config):
    run_config["jdp.num-tasks"] = 4
    with pytest.raises(ConfigError, match="num-tasks'=4.*num-partitions=3"):
        _start(example, run_config)
    run_config["jdp.num-tasks"] = 3
    run_config["num-records"] = 3  # one record per node: no training record, the user's loader fails
    with pytest.raises(ConfigError, match=r"failed at set-up: task \d: train_data\(context\) raised ValueError"):
        _start(example, run_config)
    with pytest.raises(ConfigError, match="rounds"):
        _start(example, dict(run_config, **{"num-records": 1200}), num_rounds=3)  # noise is for 2
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()


def test_namespaced_keys_are_checked_and_named():
    with pytest.raises(ConfigError, match="jdp.radius"):
        namespaced_mtl_config({"jdp.radius": -1.0})
    with pytest.raises(ConfigError, match="unknown run-config key 'jdp.epsilon'"):
        namespaced_mtl_config({"jdp.epsilon": 1.0})
    with pytest.raises(ConfigError, match="'jdp.local-steps' is a key of the numpy DP-MTL app"):
        namespaced_mtl_config({"jdp.local-steps": 3})
    num_tasks, cfg, extras = namespaced_mtl_config({"lr": 5.0, "jdp.lambda": 0.5, "jdp.num-tasks": 4})
    assert (num_tasks, cfg.lam, extras["results-dir"]) == (4, 0.5, "")


# ------------------------------------------------------------ the client half alone
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _loader(n=16):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
                      batch_size=8)


def _zero_loss_step(lr):
    """One SGD step on a loss that is zero (its gradient too): only the regularizer moves."""
    def fn(net, loader):
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        x, _ = next(iter(loader))
        opt.zero_grad()
        (0.0 * net(x).sum()).backward()
        opt.step()
    return fn


def test_the_regularizer_gradient_moves_parameters_towards_the_mean():
    torch.manual_seed(0)
    net, lam, lr = Tiny(), 0.7, 0.3
    w = flatten(net)
    mean = np.random.default_rng(1).normal(size=w.size)
    with mean_regularized(net, mean, lam) as record:
        _zero_loss_step(lr)(net, _loader())
        other = nn.Linear(2, 2)  # another model's optimizer is left alone
        before = other.weight.detach().clone()
        opt = torch.optim.SGD(other.parameters(), lr=1.0)
        other(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert record.steps == 1
    np.testing.assert_allclose(flatten(net), w - lr * lam * (w - mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(other.weight.detach(), before - 1.0, atol=1e-6)  # the plain gradient
    # A parameter the loss did not touch (grad None) still gets the regularizer's gradient.
    net2 = Tiny()
    w2 = flatten(net2)
    with mean_regularized(net2, mean, lam):
        opt = torch.optim.SGD(net2.parameters(), lr=lr)
        opt.step()
    np.testing.assert_allclose(flatten(net2), w2 - lr * lam * (w2 - mean), rtol=1e-5, atol=1e-6)
    # Outside the context the hook is gone.
    w2 = flatten(net2)
    opt.zero_grad()
    opt.step()
    np.testing.assert_array_equal(flatten(net2), w2)


def _node(run_config):
    app = ClientApp()
    mtl = MTLClient(app, model_fn=Tiny, train_data=lambda ctx: _loader())
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 2},
                  state=RecordDict(), run_config=run_config)
    InProcessGrid(app, 1, run_config)  # stamps message identities
    return app, mtl, ctx


def _instruction(mean, kind=MessageType.TRAIN, tasks=(1,)):
    cfg = ConfigRecord({protocol.ROUND: 1, protocol.TASKS: list(tasks)})
    return Message(RecordDict({protocol.CONFIG: cfg,
                               protocol.MEAN: ArrayRecord({protocol.MEAN: Array(np.asarray(mean, dtype=np.float64))})}),
                   dst_node_id=7, message_type=kind)


def test_train_applies_the_regularizer_projects_stores_and_sends_only_w_k():
    rc = {"jdp.lambda": 0.5, "jdp.radius": 100.0}
    app, mtl, ctx = _node(rc)
    setup = app(Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7,
                        message_type=MessageType.QUERY), ctx)
    rec = setup.content[protocol.SETUP]
    assert list(rec[protocol.TASKS]) == [1] and rec[protocol.NUM_PARAMS] == 23 and rec[protocol.NUM_PARTITIONS] == 2
    torch.manual_seed(0)
    w0 = flatten(Tiny())
    mean = np.random.default_rng(2).normal(size=w0.size)
    ctx.state[STATE_PREFIX + "1"] = ArrayRecord({"w": Array(w0)})  # the task's w_k from an earlier round
    reply = mtl.train(_instruction(mean), ctx, Tiny(), _loader(), _zero_loss_step(0.2))
    assert reply.has_content(), reply.error.reason
    sent = reply.content[protocol.MODELS][protocol.task_key(1)].numpy()
    np.testing.assert_allclose(sent, w0 - 0.2 * 0.5 * (w0 - mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ctx.state[STATE_PREFIX + "1"]["w"].numpy(), sent)
    # A small ball: the whole flattened model is projected onto ||w|| <= B.
    app, mtl, ctx = _node({"jdp.lambda": 0.0, "jdp.radius": 0.5})
    reply = mtl.train(_instruction(mean), ctx, Tiny(), _loader(), _zero_loss_step(0.2))
    sent = reply.content[protocol.MODELS][protocol.task_key(1)].numpy()
    assert np.linalg.norm(sent) == pytest.approx(0.5)
    np.testing.assert_allclose(sent, mean * 0.5 / np.linalg.norm(mean), rtol=1e-5)  # first round: w_k = w~
    # Another task's instruction, a wrong-sized mean, a non-finite result: error replies, nothing stored.
    assert mtl.train(_instruction(mean, tasks=(0,)), ctx, Tiny(), _loader(), _zero_loss_step(0.2)).has_error()
    assert mtl.train(_instruction(mean[:-1]), ctx, Tiny(), _loader(), _zero_loss_step(0.2)).has_error()
    before = ctx.state[STATE_PREFIX + "1"]["w"].numpy().copy()
    bad = mtl.train(_instruction(mean), ctx, Tiny(), _loader(), _zero_loss_step(float("nan")))
    assert bad.has_error() and "non-finite" in bad.error.reason
    np.testing.assert_array_equal(ctx.state[STATE_PREFIX + "1"]["w"].numpy(), before)


def test_load_gives_w_k_or_a_fine_tuned_copy_that_is_not_stored():
    app, mtl, ctx = _node({"jdp.lambda": 0.5})
    w = flatten(Tiny())
    mean = np.zeros_like(w)
    np.testing.assert_array_equal(flatten(mtl.load(Tiny(), _instruction(mean, MessageType.EVALUATE), ctx)), mean)
    ctx.state[STATE_PREFIX + "1"] = ArrayRecord({"w": Array(w)})
    loaded = mtl.load(Tiny(), _instruction(mean, MessageType.EVALUATE), ctx)
    np.testing.assert_allclose(flatten(loaded), w, rtol=1e-6)
    tuned = mtl.load(Tiny(), _instruction(mean, MessageType.EVALUATE), ctx,
                     fit=lambda m: _zero_loss_step(0.2)(m, _loader()))
    np.testing.assert_allclose(flatten(tuned), w - 0.2 * 0.5 * w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ctx.state[STATE_PREFIX + "1"]["w"].numpy(), w)  # w_k unchanged
    assert load_flat(Tiny(), w) is not None


def test_an_empty_training_set_is_named_at_set_up():
    app = ClientApp()
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)))
    MTLClient(app, model_fn=Tiny, train_data=lambda ctx: empty)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    InProcessGrid(app, 1, {})
    reply = app(Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7,
                        message_type=MessageType.QUERY), ctx)
    assert reply.has_error() and "task 0: the training data set is empty" in reply.error.reason


def test_a_privacy_key_outside_the_jdp_table_is_refused_not_ignored():
    from flwr_jdp.mtl.config import namespaced_mtl_config

    with pytest.raises(ConfigError, match=r"'target-epsilon' is set outside .*reads 'jdp.target-epsilon'"):
        namespaced_mtl_config({"target-epsilon": 1.0})
    with pytest.raises(ConfigError, match=r"'radius'=5.0 and 'jdp.radius'=1.0 differ"):
        namespaced_mtl_config({"radius": 5.0, "jdp.radius": 1.0})
