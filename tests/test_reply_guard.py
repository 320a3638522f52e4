"""Nothing but the release leaves the node, whatever the user's handlers return.

A user-style ClientApp whose evaluate handler replies with the model's arrays
(personal layers included) and whose train handler sneaks the personal values into
extra records (an ArrayRecord, a ConfigRecord, metric lists) and the training loss
into its metrics, run under the real :class:`JointDP` strategy on an in-process grid:
no personal parameter leaves a node by name or by value, the round goes on, and what
does leave is bit for bit what the honest app sends. Then the same for DP-MTL's
client half, and the guard's rules one by one.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient, owner_id, owners_mod
from flwr_jdp.joint_dp.reply_rules import joint_dp_guard
from flwr_jdp.mtl import protocol as mtl_protocol
from flwr_jdp.mtl.client import MTLClient, flatten
from flwr_jdp.reply_guard import Allowed, filter_content
from flwr_jdp.strategies import JointDP
from tests.test_distributed_noise import Probe, _data, _initial, _rc, _train_fn
from tests.test_owners_mod import _contains

PERSONAL = ("head.weight", "head.bias")


def _personal(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters() if n in PERSONAL}


def user_app(sneak: bool, attempted: list[np.ndarray], mods: list | None = None) -> ClientApp:
    """The user's ClientApp. With ``sneak`` its handlers try to send the personal
    parameters (and the training loss) next to what the client half built; every
    personal value they try to send is appended to ``attempted``."""
    app = ClientApp(mods=mods or [])
    jdp = JointDPClient(app, model_fn=Probe, train_data=lambda ctx: _data(owner_id(ctx)))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Probe()
        reply = jdp.train(msg, context, model, _data(owner_id(context)), _train_fn)
        if sneak and reply.has_content():
            personal = _personal(model)
            attempted.extend(personal.values())
            x, y = _data(owner_id(context)).dataset.tensors
            loss = float(torch.nn.functional.cross_entropy(model(x), y).detach())
            reply.content["personal"] = ArrayRecord(model.state_dict())
            reply.content["debug"] = ConfigRecord({"head": personal["head.weight"].ravel().tolist(), "note": "x"})
            reply.content["metrics"]["train-loss"] = loss
            reply.content["metrics"]["head"] = personal["head.bias"].ravel().tolist()
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = jdp.load(Probe(), msg, context)
        x, y = _data(owner_id(context)).dataset.tensors
        acc = float((model(x).argmax(1) == y).float().mean())
        content = RecordDict({"metrics": MetricRecord({"accuracy": acc, "num-examples": len(y)})})
        if sneak:
            attempted.extend(_personal(model).values())
            content["arrays"] = ArrayRecord(model.state_dict())
            content["config"] = ConfigRecord({"w": _personal(model)["head.weight"].ravel().tolist()})
        return Message(content, reply_to=msg)

    return app


def _numbers(record: object) -> list[np.ndarray]:
    """Every number a record carries, as flat arrays (bytes, e.g. SecAgg+ keys, skipped)."""
    if isinstance(record, ArrayRecord):
        return [a.numpy().ravel().astype(np.float64) for a in record.values()]
    out = []
    for value in record.values():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append(np.asarray([value], dtype=np.float64))
        elif isinstance(value, list) and value and isinstance(value[0], int | float):
            out.append(np.asarray(value, dtype=np.float64))
    return out


def _run(rc: dict, nodes: int, sneak: bool, mods: list | None = None):  # noqa: ANN202
    attempted: list[np.ndarray] = []
    flwr_logger = logging.getLogger("flwr")
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines(logging.WARNING)
    flwr_logger.addHandler(handler)
    try:
        grid = InProcessGrid(user_app(sneak, attempted, mods), nodes, rc, errors_as_replies=True)
        result = JointDP.from_run_config(rc, node_settle_s=0.0).start(grid=grid, initial_arrays=_initial())
    finally:
        flwr_logger.removeHandler(handler)
    return grid, result, attempted, [line for line in lines if "reply_guard" in line]


def _same(a: Message, b: Message) -> None:
    """Two replies are the same, bit for bit."""
    assert a.has_error() == b.has_error()
    if a.has_error():
        assert a.error.reason == b.error.reason
        return
    assert list(a.content.keys()) == list(b.content.keys())
    for name, ra in a.content.items():
        rb = b.content[name]
        assert type(ra) is type(rb)
        if isinstance(ra, ArrayRecord):
            assert list(ra.keys()) == list(rb.keys())
            for k in ra.keys():
                assert ra[k].dtype == rb[k].dtype and ra[k].shape == rb[k].shape and ra[k].data == rb[k].data, k
        else:
            assert dict(ra) == dict(rb), name


CASES = {  # placement, nodes, owners, hosted by owners_mod
    "local": ("local", 3, 3, False),
    "central": ("central", 3, 3, False),
    "owner-unit": ("central", 3, 3, False),
    "owners_mod": ("local", 2, 4, True),
    "distributed": ("distributed", 3, 3, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_personal_parameter_leaves_and_the_honest_reply_is_unchanged(case):
    placement, nodes, owners, hosted = CASES[case]
    rc = _rc(owners, **{"noise-placement": placement, "num-rounds": 2, "target-epsilon": 50.0, "accountant": "rdp"})
    if case == "owner-unit":
        rc["jdp.privacy-unit"] = "owner"
    mods = [owners_mod] if hosted else None
    honest_grid, honest, _, honest_lines = _run(rc, nodes, sneak=False, mods=mods)
    grid, result, attempted, lines = _run(rc, nodes, sneak=True, mods=mods)

    # the sneaky handlers did try, and nothing of it left: no personal name, no personal value
    assert attempted and grid.sent
    sent = []
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        kind = reply.metadata.message_type
        for name, record in reply.content.items():
            assert name not in ("personal", "debug", "config"), (kind, name)
            if isinstance(record, ArrayRecord):
                assert kind == MessageType.TRAIN and not set(PERSONAL) & set(record.keys()), (kind, name)
            if isinstance(record, MetricRecord):
                assert not {"train-loss", "head"} & set(record.keys()), name
            sent += _numbers(record)
    for value in attempted:  # not whole, not as a run of 4 values anywhere
        assert not any(_contains(arr, value.ravel()[:4].astype(np.float64)) for arr in sent)

    # what left is what the honest app sends, bit for bit; the run is the honest run
    assert len(grid.sent) == len(honest_grid.sent)
    if placement != "distributed":  # (SecAgg+ masks with fresh keys: compared through the sum below)
        for a, b in zip(grid.sent, honest_grid.sent, strict=True):
            _same(a, b)
    for k in honest.arrays.keys():
        assert result.arrays[k].data == honest.arrays[k].data, k
    assert result.evaluate_metrics_clientapp == honest.evaluate_metrics_clientapp  # evaluation still works
    assert result.evaluate_metrics_clientapp[2]["accuracy"] > 0

    # one line per reply that had something removed, naming records and keys, never values
    assert not honest_lines
    assert lines and all(line.count("reply_guard") == 1 for line in lines)
    joined = "\n".join(lines)
    for name in ("train-loss", "'head'") + (() if hosted else ("'personal'", "'debug'", "'config'")):
        assert name in joined  # (owners_mod keeps only each owner's arrays and metrics, and says so)
    assert "ArrayRecord 'arrays'" in joined or "ArrayRecord 'owner." in joined  # the evaluate reply's arrays
    for value in attempted:
        assert f"{float(value.ravel()[0]):.4f}"[:-1] not in joined


def _instruction(kind: str, content: RecordDict) -> Message:
    return Message(content, dst_node_id=7, message_type=kind)


@pytest.fixture
def stamped():
    InProcessGrid(None, 0, {})  # the task identity messages are stamped with


def test_each_rule_of_the_joint_dp_guard(stamped):
    guard = joint_dp_guard(lambda ctx: r"^head\.")
    ctx = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    shared = {"body.weight": np.ones((2, 3), np.float32), "body.bias": np.ones(2, np.float32)}
    cfg = ConfigRecord({protocol.OWNERS: [0], protocol.ROUND: 1})
    train = _instruction(MessageType.TRAIN, RecordDict({protocol.SHARED: protocol.to_record(shared),
                                                        protocol.CONFIG: cfg}))

    def through(msg: Message, reply_content: RecordDict) -> Message:
        return guard(msg, ctx, lambda m, c: Message(reply_content, reply_to=m))

    # the honest release passes as the same object, records and all
    honest = RecordDict({"arrays": protocol.to_record(shared), "metrics": MetricRecord({"num-examples": 5})})
    records = dict(honest.items())
    reply = through(train, honest)
    assert reply.content is honest and all(reply.content[k] is v for k, v in records.items())
    # field elements (distributed) have another dtype, same names and shapes: the release too
    ints = RecordDict({"arrays": protocol.to_record({k: v.astype(np.int64) for k, v in shared.items()}),
                       "metrics": MetricRecord({"num-examples": 5})})
    assert through(train, ints).content is ints
    # a release with a personal name, a missing or reshaped parameter: not a release, removed whole
    for arrays in ({**shared, "head.weight": np.ones(2, np.float32)}, {"body.weight": shared["body.weight"]},
                   {**shared, "body.bias": np.ones(3, np.float32)}):
        reply = through(train, RecordDict({"arrays": protocol.to_record(arrays),
                                           "metrics": MetricRecord({"num-examples": 5})}))
        assert list(reply.content.keys()) == ["metrics"]
    # another owner's record, or an owner key when the node hosts one owner under Flower's keys
    reply = through(train, RecordDict({"owner.1": protocol.to_record(shared), "metrics.1": MetricRecord({"num-examples": 1})}))
    assert list(reply.content.keys()) == []
    # a personal name in the broadcast itself is not allowed back (the run's personal-layers rule)
    bad = _instruction(MessageType.TRAIN, RecordDict({protocol.SHARED: protocol.to_record(
        {**shared, "head.bias": np.ones(2, np.float32)}), protocol.CONFIG: cfg}))
    reply = through(bad, RecordDict({"arrays": protocol.to_record({**shared, "head.bias": np.ones(2, np.float32)})}))
    assert list(reply.content.keys()) == []
    # evaluate: MetricRecords of numbers only; a metric's own record is kept, its lists removed
    ev = _instruction(MessageType.EVALUATE, RecordDict({protocol.CONFIG: cfg}))
    mine = MetricRecord({"accuracy": 0.5, "w": [1.0, 2.0]})
    reply = through(ev, RecordDict({"metrics": mine, "arrays": protocol.to_record(shared), "c": ConfigRecord()}))
    assert list(reply.content.keys()) == ["metrics"] and dict(reply.content["metrics"]) == {"accuracy": 0.5}
    assert dict(mine) == {"accuracy": 0.5, "w": [1.0, 2.0]}  # the app's own record is not modified
    # set-up: the set-up fields only
    query = _instruction(MessageType.QUERY, RecordDict({protocol.CONFIG: ConfigRecord()}))
    setup = ConfigRecord({protocol.OWNER_IDS: [0], protocol.NUM_RECORDS: [5], protocol.NUM_USERS: [5],
                          protocol.MAX_EPSILON: [0.0], protocol.PARAM_NAMES: ["a"], protocol.PARAM_SHAPES: ["2"]})
    reply = through(query, RecordDict({protocol.SETUP: setup}))
    assert reply.content[protocol.SETUP] is setup
    reply = through(query, RecordDict({protocol.SETUP: ConfigRecord({**setup, "labels": [1, 2]}),
                                       "x": protocol.to_record(shared)}))
    assert list(reply.content.keys()) == [protocol.SETUP] and "labels" not in reply.content[protocol.SETUP]
    # a SecAgg+ stage: Flower's records as its mod builds them, nothing else
    secagg = _instruction(MessageType.TRAIN, RecordDict({protocol.SHARED: protocol.to_record(shared),
                                                         protocol.CONFIG: cfg, RECORD_KEY_CONFIGS: ConfigRecord()}))
    stage = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({"masked": [b"\x00\x01"]}),
                        "fitres.parameters": ArrayRecord(), "fitres.num_examples": MetricRecord({"num_examples": 1})})
    assert through(secagg, stage).content is stage
    reply = through(secagg, RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(), "arrays": protocol.to_record(shared)}))
    assert list(reply.content.keys()) == [RECORD_KEY_CONFIGS]
    # an error reply passes as it is
    err = guard(ev, ctx, lambda m, c: Message(Error(code=0, reason="r"), reply_to=m))
    assert err.has_error() and err.error.reason == "r"


def test_filter_content_names_what_it_removes_never_values():
    content = RecordDict({"metrics": MetricRecord({"num-examples": 3, "loss": 0.123456}),
                          "extra": ArrayRecord({"head.weight": Array(np.full(2, 7.654321))})})
    out, dropped = filter_content(content, {"metrics": Allowed(MetricRecord, frozenset({"num-examples"}))})
    assert dict(out["metrics"]) == {"num-examples": 3} and "extra" not in out
    text = "; ".join(dropped)
    assert "'extra'" in text and "loss" in text and "0.123" not in text and "7.65" not in text


# ---------------------------------------------------------------------------- DP-MTL
class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc = torch.nn.Linear(4, 3)


def _mtl_loader():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g),
                                                                      torch.randint(0, 3, (16,), generator=g)),
                                       batch_size=8)


def _mtl_train(net, loader):  # noqa: ANN001
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net.fc(x), y).backward()
        opt.step()


def _mtl_app(sneak: bool, attempted: list[np.ndarray]) -> ClientApp:
    app = ClientApp()
    mtl = MTLClient(app, model_fn=Tiny, train_data=lambda ctx: _mtl_loader())

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = mtl.train(msg, context, Tiny(), _mtl_loader(), _mtl_train)
        if sneak:
            tuned = mtl.load(Tiny(), msg, context, fit=lambda m: _mtl_train(m, _mtl_loader()))  # personalized
            attempted.append(flatten(tuned))
            reply.content["personal"] = ArrayRecord(tuned.state_dict())
            reply.content["tuned"] = ConfigRecord({"w": flatten(tuned).tolist()})
            reply.content[mtl_protocol.METRICS]["train-loss"] = 0.25
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        tuned = mtl.load(Tiny(), msg, context, fit=lambda m: _mtl_train(m, _mtl_loader()))
        content = RecordDict({"metrics": MetricRecord({"accuracy": 0.5, "num-examples": 16})})
        if sneak:
            attempted.append(flatten(tuned))
            content["arrays"] = ArrayRecord(tuned.state_dict())
        return Message(content, reply_to=msg)

    return app


def test_mtl_replies_carry_the_task_model_and_metrics_only(stamped):
    rc = {"jdp.lambda": 0.5, "jdp.radius": 100.0}
    mean = np.random.default_rng(2).normal(size=flatten(Tiny()).size)
    sent = {}
    for sneak in (False, True):
        attempted: list[np.ndarray] = []
        app = _mtl_app(sneak, attempted)
        ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 2},
                      state=RecordDict(), run_config=rc)
        replies = []
        for kind in (MessageType.TRAIN, MessageType.EVALUATE):
            msg = _instruction(kind, RecordDict({
                mtl_protocol.CONFIG: ConfigRecord({mtl_protocol.ROUND: 1, mtl_protocol.TASKS: [1]}),
                mtl_protocol.MEAN: ArrayRecord({mtl_protocol.MEAN: Array(mean)})}))
            replies.append(app(msg, ctx))
        sent[sneak] = (replies, attempted)
    (train, evaluate), attempted = sent[True]
    assert attempted
    assert list(train.content.keys()) == [mtl_protocol.MODELS, mtl_protocol.METRICS]
    assert list(train.content[mtl_protocol.MODELS].keys()) == ["task.1"]
    assert dict(train.content[mtl_protocol.METRICS]) == {"tasks": 1}
    assert list(evaluate.content.keys()) == ["metrics"]
    for reply in (train, evaluate):  # nothing of the personalized model left
        for record in reply.content.values():
            for arr in _numbers(record):
                for value in attempted:
                    assert not _contains(arr, value[:4])
    (honest_train, honest_eval), _ = sent[False]  # and the rest is the honest replies, bit for bit
    _same(honest_train, train)
    _same(honest_eval, evaluate)
    # a models record with another task's model in it is not w_k: removed whole
    guard_app = _mtl_app(False, [])
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                  run_config=rc)
    msg = _instruction(MessageType.TRAIN, RecordDict({
        mtl_protocol.CONFIG: ConfigRecord({mtl_protocol.ROUND: 1, mtl_protocol.TASKS: [1]}),
        mtl_protocol.MEAN: ArrayRecord({mtl_protocol.MEAN: Array(mean)})}))
    guard = guard_app._mods[0]
    reply = guard(msg, ctx, lambda m, c: Message(RecordDict({mtl_protocol.MODELS: ArrayRecord(
        {"task.1": Array(mean), "task.0": Array(mean)}), mtl_protocol.METRICS: MetricRecord({"tasks": 2})}),
        reply_to=m))
    assert list(reply.content.keys()) == [mtl_protocol.METRICS]
