"""The DP-MTL ClientApp (its ServerApp: :mod:`dp_mtl.server_app`).

A SuperNode with ``partition-id = p`` of ``num-partitions = P`` hosts tasks
``p, p + P, ...``. It builds their data itself (synthetic tasks from the run
config, or the project's label-skew owners of a real data set, once per
process), keeps every task's model ``w_k`` in ``context.state``, and sends only
the ball-projected ``w_k`` of the tasks the server sampled. Personalized models
(fine-tuned against ``w~``) are computed for evaluation and never sent. Run it
with ``flwr run apps/dp_mtl`` or :func:`research.simulation.simulate`
(``app="dp-mtl"``).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.mtl.algorithm import evaluate_task, task_round
from flwr_jdp.mtl.config import parse_mtl_config
from flwr_jdp.mtl.protocol import CONFIG, MEAN, METRICS, MODELS, SETUP, TASKS, task_key
from flwr_jdp.records import hosted_owners

client = ClientApp()
STATE_PREFIX = "dp-mtl.task."


def _hosted(context: Context) -> list[int]:
    source, _, _ = parse_mtl_config(context.run_config)
    pid = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    return hosted_owners(source.num_tasks, pid, parts)


def _hosted_tasks(context: Context):  # noqa: ANN202
    """This node's tasks, built once per process (the hosted set is stable, so the
    per-process cache is hit every round, whatever subset is sampled)."""
    source, _, _ = parse_mtl_config(context.run_config)
    return {t.task_id: t for t in source.tasks(tuple(_hosted(context)))}


def _load_w(context: Context, task_id: int, num_params: int) -> np.ndarray:
    rec = context.state.get(STATE_PREFIX + str(task_id))
    if rec is None:
        return np.zeros(num_params)  # w_k^0 = 0 (data-free)
    return rec["w"].numpy()


def _mean(msg: Message) -> np.ndarray:
    return msg.content[MEAN][MEAN].numpy()


@client.query()
def setup(msg: Message, context: Context) -> Message:
    """Report the task ids this node hosts (public metadata)."""
    return Message(RecordDict({SETUP: ConfigRecord({TASKS: _hosted(context)})}), reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    """``E`` projected gradient steps for each requested task hosted here; reply
    with the projected ``w_k``; keep them in ``context.state``."""
    source, cfg, _ = parse_mtl_config(context.run_config)
    model = source.model()
    hosted = _hosted_tasks(context)
    wanted = [int(k) for k in msg.content[CONFIG].get(TASKS, []) if int(k) in hosted]
    mean = _mean(msg)
    out = {}
    for task in (hosted[k] for k in wanted):
        w = task_round(_load_w(context, task.task_id, model.num_params), mean, task, model, cfg)
        context.state[STATE_PREFIX + str(task.task_id)] = ArrayRecord({"w": Array(w)})
        out[task_key(task.task_id)] = Array(np.ascontiguousarray(w, dtype=np.float64))
    return Message(RecordDict({MODELS: ArrayRecord(out), METRICS: MetricRecord({"tasks": len(out)})}),
                   reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Each hosted task fine-tunes a copy against ``w~`` and measures its
    personalized model on its own test data; the node replies with sums."""
    source, cfg, _ = parse_mtl_config(context.run_config)
    model = source.model()
    mean = _mean(msg)
    sums = {"excess-sum": 0.0, "loss-sum": 0.0, "accuracy-sum": 0.0,
            "excess-count": 0, "loss-count": 0, "accuracy-count": 0}
    for task in _hosted_tasks(context).values():
        row = evaluate_task(_load_w(context, task.task_id, model.num_params), mean, task, model, cfg)
        for key, value in row.items():
            if np.isfinite(value):
                sums[f"{key}-sum"] += float(value)
                sums[f"{key}-count"] += 1
    return Message(RecordDict({METRICS: MetricRecord(sums)}), reply_to=msg)
