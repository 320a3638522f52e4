"""The legacy route: a Flower app whose ``client_fn`` returns a ``NumPyClient``
(examples/quickstart-numpyclient, written as Flower's examples write one) under joint
DP with ``numpy_client_app(client_fn)``, in process.

Checks: a run completes within the target epsilon and no personal value is in any
reply; the client's own ``fit`` is the train function of the DP pass and nothing it
returns is sent (the release is exactly that of the same code as a Message-API app
through ``JointDPClient``); ``fit`` and ``evaluate`` get the app's own config keys;
the evaluate reply carries the client's numeric metrics, its loss and num-examples;
a wrong attribute name fails at set-up naming it."""

from __future__ import annotations

import logging
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict

from flwr_jdp.client import JointDPClient, numpy_client_app, owners_mod
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.strategies import JointDP, load_results
from tests.test_owners_mod import _contains

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-numpyclient"
PERSONAL = {"fc2.weight", "fc2.bias"}


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from digits import client_app, task
    finally:
        sys.path.remove(str(EXAMPLE))
    return client_app, task


@pytest.fixture
def run_config(tmp_path):
    raw = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = flatten_dict(raw)
    cfg.update({"num-server-rounds": 2, "jdp.results-dir": str(tmp_path / "run"), "jdp.noise-seed": 1})
    return cfg


def _run(app: ClientApp, task, run_config: dict, nodes: int = 3, **start_kwargs):
    torch.manual_seed(0)  # the app's loaders shuffle with torch's global generator
    grid = InProcessGrid(app, nodes, run_config)
    strategy = JointDP.from_run_config(run_config, node_settle_s=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()),
                            num_rounds=run_config["num-server-rounds"], **start_kwargs)
    return strategy, grid, result


def test_the_numpyclient_app_trains_under_joint_dp_and_no_personal_value_leaves(example, run_config):
    client_app, task = example
    strategy, grid, result = _run(client_app.app, task, run_config)
    assert 0 < strategy.ledger.epsilon() <= 8.0
    assert len(strategy.ledger.rounds) == 2
    final = result.evaluate_metrics_clientapp[2]
    assert final["owners"] == 3 and final["accuracy"] > 0.2  # 10 classes: chance is 0.1
    assert final["loss"] > 0  # the client's evaluate loss, averaged over owners
    assert load_results(run_config["jdp.results-dir"])["status"] == "completed"
    stored, sent = [], []
    for ctx in grid.contexts.values():
        rec = ctx.state[f"personal.{ctx.node_config['partition-id']}"]
        assert set(rec.keys()) == PERSONAL
        stored += [a.ravel() for a in rec.to_numpy_ndarrays()]
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        for key, record in reply.content.items():
            if isinstance(record, ArrayRecord):
                assert key == "arrays" and not PERSONAL & set(record.keys())
                sent += [a.ravel() for a in record.to_numpy_ndarrays()]
    assert sent
    for value in stored:  # no personal value hides in anything sent, whole or as a run
        assert not any(_contains(arr, value[:8]) for arr in sent)


def _message_api_app(task, seen: list) -> ClientApp:
    """The same client as a Message-API app (README's three changes), for comparison."""
    app = ClientApp()

    def data(context):
        return task.load_data(context.node_config["partition-id"], context.node_config["num-partitions"])

    jdp = JointDPClient(app, model_fn=task.Net, train_data=lambda context: data(context)[0])

    def train_fn(net, loader, context):
        seen.append(type(net).__name__)
        task.train(net, loader, context.run_config["local-epochs"], context.run_config["learning-rate"],
                   torch.device("cpu"))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return jdp.train(msg, context, task.Net(), data(context)[0], lambda n, b: train_fn(n, b, context))

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = jdp.load(task.Net(), msg, context, fit=lambda n: train_fn(n, data(context)[0], context))
        loss, acc = task.test(model, data(context)[1], torch.device("cpu"))
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": acc, "loss": loss,
                                                             "num-examples": len(data(context)[1].dataset)})}),
                       reply_to=msg)

    return app


def test_fit_is_the_train_function_and_what_it_returns_is_not_sent(example, run_config, tmp_path, caplog):
    """The legacy route's releases equal, bit for bit, those of the same training code as
    a Message-API app (same seeds): the route adds nothing to the DP pass and sends
    nothing of fit's return, which here is a marker value that must appear nowhere."""
    client_app, task = example
    marker = np.float32(12345.678)
    calls: list[tuple[str, dict]] = []

    class Client(client_app.FlowerClient):
        def fit(self, parameters, config):
            calls.append((type(self.net).__name__, dict(config)))
            super().fit(parameters, config)
            return [np.full_like(p, marker) for p in parameters], 10**6, {"train_loss": 1.0}

        def evaluate(self, parameters, config):
            loss, n, metrics = super().evaluate(parameters, config)
            assert config == {"k": "e"}  # the app's own evaluate_config, no flwr-jdp key
            return loss, n, {**metrics, "note": "text metrics are not sent"}

    def client_fn(context):
        trainloader, valloader = task.load_data(context.node_config["partition-id"],
                                                context.node_config["num-partitions"])
        return Client(task.Net(), trainloader, valloader, context.run_config["local-epochs"],
                      context.run_config["learning-rate"]).to_client()

    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, legacy_grid, legacy = _run(numpy_client_app(client_fn), task, run_config, train_config=ConfigRecord(
            {"k": "t"}), evaluate_config=ConfigRecord({"k": "e"}))
    assert "metrics ['note'] are not numbers and are not sent" in caplog.text
    run_config["jdp.results-dir"] = str(tmp_path / "message-api")
    seen: list[str] = []
    _, api_grid, api = _run(_message_api_app(task, seen), task, run_config)
    assert [name for name, _ in calls] == seen  # fit ran on every model the train function gets
    assert all(cfg == {"k": "t"} for _, cfg in calls)  # the app's train_config, no flwr-jdp key
    for name in legacy.arrays.keys():
        np.testing.assert_array_equal(legacy.arrays[name].numpy(), api.arrays[name].numpy())
    legacy_arrays = [r.content["arrays"] for r in legacy_grid.sent if "arrays" in r.content]
    api_arrays = [r.content["arrays"] for r in api_grid.sent if "arrays" in r.content]
    assert len(legacy_arrays) == len(api_arrays) == 6
    for a, b in zip(legacy_arrays, api_arrays, strict=True):
        for x, y in zip(a.to_numpy_ndarrays(), b.to_numpy_ndarrays(), strict=True):
            np.testing.assert_array_equal(x, y)
            assert not np.any(x == marker)
    for reply in legacy_grid.sent:
        metrics = reply.content.get("metrics")
        if isinstance(metrics, MetricRecord) and "accuracy" in metrics:  # an evaluate reply
            assert set(metrics.keys()) == {"accuracy", "loss", "num-examples"}  # "note" left out
            assert metrics["num-examples"] == 120  # the client's validation split, not fit's 10**6
        elif isinstance(metrics, MetricRecord) and "num-examples" in metrics and "arrays" in reply.content:
            assert metrics["num-examples"] < 10**6 and "train_loss" not in metrics


def test_owners_mod_hosts_several_owners_per_node(example, run_config):
    client_app, task = example
    run_config.update({"jdp.num-owners": 4, "num-server-rounds": 1})
    strategy, _, result = _run(numpy_client_app(client_app.client_fn, mods=[owners_mod]), task, run_config,
                               nodes=2)
    assert sorted(strategy.owner_node) == [0, 1, 2, 3]
    assert result.evaluate_metrics_clientapp[1]["owners"] == 4


def test_a_wrong_attribute_name_fails_at_set_up_naming_it(example, run_config):
    client_app, task = example
    with pytest.raises(RuntimeError, match=r"no nn.Module in attribute 'model' \(its nn.Module attributes: "
                                           r"\['net'\]\): pass numpy_client_app\(client_fn, net=...\)"):
        _run(numpy_client_app(client_app.client_fn, net="model"), task, run_config)
    with pytest.raises(RuntimeError, match=r"no DataLoader in attribute 'loader' \(its DataLoader attributes: "
                                           r"\['trainloader', 'valloader'\]\)"):
        _run(numpy_client_app(client_app.client_fn, trainloader="loader"), task, run_config)
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()
