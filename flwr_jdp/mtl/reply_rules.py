"""What a DP-MTL task's replies may carry: the rules of the node's reply guard
(:mod:`flwr_jdp.reply_guard`) for :class:`~flwr_jdp.mtl.client.MTLClient`."""

from __future__ import annotations

import math
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord

from flwr_jdp.mtl import protocol as mtl_protocol
from flwr_jdp.reply_guard import Allowed, ReplyGuard, Rules

MTL_SETUP: Rules = {mtl_protocol.SETUP: Allowed(ConfigRecord, frozenset({
    mtl_protocol.TASKS, mtl_protocol.NUM_PARAMS, mtl_protocol.PARAM_NAMES, mtl_protocol.PARAM_SHAPES,
    mtl_protocol.NUM_PARTITIONS}))}


def mtl_guard(task_of: Callable[[Context], int]) -> ReplyGuard:
    """The guard of :class:`~flwr_jdp.mtl.client.MTLClient`: a train reply carries the
    node's task model ``w_k`` (``models`` with ``task.<k>`` only, as long as the
    broadcast mean) and ``metrics`` with ``tasks`` only."""

    def train_rules(msg: Message, context: Context) -> Rules:
        mean = msg.content.get(mtl_protocol.MEAN)
        size = math.prod(mean[mtl_protocol.MEAN].shape) if isinstance(mean, ArrayRecord) else -1
        return {mtl_protocol.MODELS: Allowed(ArrayRecord, shapes={mtl_protocol.task_key(task_of(context)): (size,)}),
                mtl_protocol.METRICS: Allowed(MetricRecord, frozenset({"tasks"}))}

    return ReplyGuard(train_rules, MTL_SETUP, "dp-mtl")


__all__ = ["MTL_SETUP", "mtl_guard"]
