"""The Priv-AltMin ClientApp (its ServerApp: :mod:`priv_altmin.server_app`).

A SuperNode with ``partition-id = p`` of ``num-partitions = P`` hosts the user
blocks ``p, p + P, ...`` of the synthetic problem (so 50,000 users fit on, say,
50 SuperNodes of 1,000 users). It generates its users itself (deterministic in
the run config), keeps them and their ``v_j`` local, and only sends per-node sums
of user-level clipped statistics. Run it with ``flwr run apps/priv_altmin`` or
:func:`research.simulation.simulate` (``app="priv-altmin"``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.altmin.algorithm import client_statistics, evaluate_users
from flwr_jdp.altmin.config import parse_altmin_config
from flwr_jdp.altmin.problem import ProblemSpec, Users, node_blocks, users_of_blocks
from flwr_jdp.altmin.protocol import CONFIG, EMBEDDING, METRICS, STATS
from flwr_jdp.altmin.statistics import init_statistic

client = ClientApp()


@lru_cache(maxsize=4)
def _node_users(spec: ProblemSpec, partition_id: int, num_partitions: int) -> Users:
    return users_of_blocks(spec, node_blocks(spec, partition_id, num_partitions))


def hosted_users(context: Context) -> tuple[ProblemSpec, Users]:
    """The users this SuperNode hosts (generated once per process)."""
    spec, _, _ = parse_altmin_config(context.run_config)
    pid = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    return spec, _node_users(spec, pid, parts)


def _reply(msg: Message, stats: dict[str, np.ndarray], metrics: dict) -> Message:
    content = RecordDict({STATS: ArrayRecord({k: _array(v) for k, v in stats.items()}),
                          METRICS: MetricRecord(metrics)})
    return Message(content, reply_to=msg)


def _array(a: np.ndarray):  # noqa: ANN202
    from flwr.app import Array
    return Array(np.ascontiguousarray(a, dtype=np.float64))


def _embedding(msg: Message) -> np.ndarray:
    return list(msg.content[EMBEDDING].values())[0].numpy()


@client.train("init")
def init_stats(msg: Message, context: Context) -> Message:
    """Algorithm 3's clipped statistic, summed over this node's users."""
    spec, users = hosted_users(context)
    _, cfg, _ = parse_altmin_config(context.run_config)
    m = spec.samples_per_user
    total = init_statistic(users, cfg.zeta, cfg.init_clip(m), cfg.split()) if len(users) else np.zeros((spec.dim, spec.dim))
    return _reply(msg, {"m": total}, {"num-users": len(users)})


@client.train()
def epoch_stats(msg: Message, context: Context) -> Message:
    """This epoch's clipped ``A`` and ``b`` (or gradient), summed over the node's users."""
    spec, users = hosted_users(context)
    _, cfg, _ = parse_altmin_config(context.run_config)
    epoch = int(msg.content[CONFIG]["epoch"]) - 1
    dk = spec.dim * spec.rank
    if not len(users):
        return _reply(msg, {"a": np.zeros((dk, dk)), "b": np.zeros(dk)}, {"num-users": 0})
    sums = client_statistics(users, _embedding(msg), cfg, epoch, spec.num_users)
    # how many users were clipped is data-dependent and not DP: it is not sent
    return _reply(msg, {"a": sums.a, "b": sums.b}, {"num-users": sums.count})


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Users fit their final ``v_j`` locally; report the sum of excess MSEs."""
    spec, users = hosted_users(context)
    _, cfg, _ = parse_altmin_config(context.run_config)
    mse = evaluate_users(users, _embedding(msg), spec, cfg.split()) if len(users) else np.zeros(0)
    return Message(RecordDict({METRICS: MetricRecord({"mse-sum": float(np.sum(mse)), "num-users": len(users)})}),
                   reply_to=msg)
