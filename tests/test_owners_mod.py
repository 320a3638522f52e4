"""``owners_mod``: one SuperNode hosts several owners, the app's handlers unchanged.

The quickstart example's own handlers (written for one owner per node) run behind
``ClientApp(mods=[owners_mod])`` on 2 nodes for 5 owners: every owner is set up,
trained and evaluated with its own data partition and personal state, each reply
carries every hosted owner's release under its own key and no personal value, and a
failing owner is left out with its reason while the others train.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict
from flwr.common.constant import ErrorCode

from flwr_jdp.client import JointDPClient, owners_mod
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.strategies import JointDP

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-pytorch"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from quickstart import client_app, task
    finally:
        sys.path.remove(str(EXAMPLE))
    return client_app, task


def _hosting_app(example) -> ClientApp:
    """The example's handlers, unchanged, on a ClientApp with ``owners_mod``."""
    client_app, task = example
    app = ClientApp(mods=[owners_mod])
    JointDPClient(app, model_fn=task.Net, train_data=lambda context: client_app._data(context)[0])
    app.train()(client_app.train)
    app.evaluate()(client_app.evaluate)
    return app


@pytest.fixture
def run_config(tmp_path, fashion_mnist_dir):
    raw = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = flatten_dict(raw)
    cfg.update({"data-dir": str(fashion_mnist_dir), "num-records": 1500, "num-server-rounds": 2,
                "jdp.num-rounds": 2, "jdp.num-owners": 5, "jdp.results-dir": str(tmp_path / "run"),
                "jdp.noise-seed": 1})
    return cfg


def test_two_nodes_host_five_owners_with_the_apps_own_handlers(example, run_config):
    _, task = example
    torch.manual_seed(0)
    grid = InProcessGrid(_hosting_app(example), 2, run_config)
    strategy = JointDP.from_run_config(run_config, node_settle_s=0.0)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=2,
                            train_config=ConfigRecord({"lr": run_config["learning-rate"]}))
    nodes = sorted(grid.contexts)
    assert strategy.owner_node == {0: nodes[0], 1: nodes[1], 2: nodes[0], 3: nodes[1], 4: nodes[0]}
    assert {o: s.num_records for o, s in strategy.sizes.items()} == {o: 240 for o in range(5)}  # 80% of 300
    assert result.evaluate_metrics_clientapp[2]["owners"] == 5
    assert 0 < strategy.ledger.epsilon() <= 8.0
    personal_names = {"fc3.weight", "fc3.bias"}
    stored = {}
    for node, ctx in grid.contexts.items():
        for o in (0, 2, 4) if node == nodes[0] else (1, 3):
            rec = ctx.state[f"personal.{o}"]
            assert set(rec.keys()) == personal_names
            stored[o] = [a.ravel() for a in rec.to_numpy_ndarrays()]
    assert not np.allclose(stored[0][1], stored[2][1])  # each owner its own personal layer
    for node, ctx in grid.contexts.items():  # local noise: each owner charged its own ledger
        owners = (0, 2, 4) if node == nodes[0] else (1, 3)
        assert {k for k in ctx.state.keys() if k.startswith("ledger.")} == {f"ledger.{o}" for o in owners}
    trained = [r for r in grid.sent if r.has_content() and any(k.startswith("owner.") for k in r.content.keys())]
    assert len(trained) == 2 * 2  # two nodes, two rounds
    sent = []
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        for key, record in reply.content.items():
            if isinstance(record, ArrayRecord):
                assert key.startswith("owner.")
                assert not personal_names & set(record.keys())
                sent += [a.ravel() for a in record.to_numpy_ndarrays()]
    for values in stored.values():
        for value in values:  # no personal array appears, whole or as a run, in anything sent
            assert not any(_contains(arr, value[:8]) for arr in sent)


def _contains(arr: np.ndarray, run: np.ndarray) -> bool:
    """``run`` appears as consecutive values of ``arr``."""
    if len(run) > len(arr):
        return False
    starts = np.flatnonzero(arr[: len(arr) - len(run) + 1] == run[0])
    return any(np.array_equal(arr[i: i + len(run)], run) for i in starts)


def test_contains_finds_a_run():
    assert _contains(np.arange(10.0), np.array([3.0, 4.0, 5.0]))
    assert not _contains(np.arange(10.0), np.array([3.0, 5.0]))


def _ctx(run_config: dict, pid: int = 0, parts: int = 2) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": pid, "num-partitions": parts},
                   state=RecordDict(), run_config=run_config)


def _train_msg(owners: list[int]) -> Message:
    rec = ConfigRecord({protocol.OWNERS: owners, protocol.ROUND: 1})
    return Message(RecordDict({"config": rec}), dst_node_id=7, message_type=MessageType.TRAIN)


def test_a_failing_owner_is_left_out_with_its_reason_and_all_failing_is_the_error(caplog):
    seen = []

    def handler(msg: Message, context: Context) -> Message:
        o = context.node_config["partition-id"]
        seen.append((o, context.node_config["num-partitions"]))
        if o == 2:
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="empty loader"), reply_to=msg)
        return Message(RecordDict({"arrays": protocol.to_record({"w": np.zeros(2, np.float32)}),
                                   "metrics": ConfigRecord({"num-examples": 3}), "extra": ConfigRecord()}),
                       reply_to=msg)

    cfg = {"jdp.num-owners": 5}
    reply = owners_mod(_train_msg([0, 1, 2, 3, 4]), _ctx(cfg), handler)
    assert seen == [(0, 5), (2, 5), (4, 5)]  # only the hosted owners, each as its own partition
    assert sorted(reply.content.keys()) == ["metrics.0", "metrics.4", "owner.0", "owner.4"]
    assert any("owner 2: empty loader" in r.getMessage() for r in caplog.records)
    assert any("'extra'" in r.getMessage() for r in caplog.records)
    reply = owners_mod(_train_msg([2]), _ctx(cfg), handler)
    assert reply.has_error() and "owner 2: empty loader" in reply.error.reason
    reply = owners_mod(_train_msg([1, 3]), _ctx(cfg), handler)  # node 0 hosts 0, 2, 4
    assert reply.has_error() and "none of the owners [1, 3]" in reply.error.reason

    def raises_for_4(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 4:
            raise ValueError("the user's loader yields nothing")
        return handler(msg, context)

    reply = owners_mod(_train_msg([0, 4]), _ctx(cfg), raises_for_4)
    assert sorted(reply.content.keys()) == ["metrics.0", "owner.0"]
    # the message (it may hold data) stays in the node's log; the reply names the type only
    assert any("owner 4's handler raised ValueError: the user's loader yields nothing" in r.getMessage()
               for r in caplog.records)
    reply = owners_mod(_train_msg([4]), _ctx(cfg), raises_for_4)
    assert reply.has_error() and "owner 4: ValueError" in reply.error.reason
    assert "yields nothing" not in reply.error.reason


def test_without_num_owners_or_with_one_owner_per_node_messages_pass_through():
    calls = []

    def handler(msg: Message, context: Context) -> Message:
        calls.append(context)
        return Message(RecordDict(), reply_to=msg)

    for cfg, parts in (({}, 2), ({"jdp.num-owners": 2}, 2)):
        ctx = _ctx(cfg, parts=parts)
        owners_mod(_train_msg([0]), ctx, handler)
        assert calls[-1] is ctx
