"""What a joint-DP owner's replies may carry: the rules of the node's reply guard
(:mod:`flwr_jdp.reply_guard`) for :class:`~flwr_jdp.joint_dp.client.JointDPClient`."""

from __future__ import annotations

import re
from collections.abc import Callable
from logging import WARNING

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.common import log

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.secure_sum import inside_secure_sum
from flwr_jdp.reply_guard import AdmitFn, Allowed, ReplyGuard, Rules

#: The set-up reply of :class:`~flwr_jdp.joint_dp.client.JointDPClient` (merged by ``owners_mod``).
JOINT_DP_SETUP: Rules = {protocol.SETUP: Allowed(ConfigRecord, frozenset({
    protocol.OWNER_IDS, protocol.NUM_RECORDS, protocol.NUM_USERS, protocol.MAX_EPSILON,
    protocol.PARAM_NAMES, protocol.PARAM_SHAPES}))}


def joint_dp_guard(personal_rule: Callable[[Context], str], admit: AdmitFn | None = None,
                   secure_only: Callable[[Context], bool] | None = None) -> ReplyGuard:
    """The guard of :class:`~flwr_jdp.joint_dp.client.JointDPClient`. A train reply carries,
    per owner the instruction names (``owner.<o>`` / ``metrics.<o>``, or Flower's
    ``arrays`` / ``metrics`` for a single owner), an ArrayRecord with exactly the
    names and shapes of the broadcast shared parameters (whatever the release's
    kind: updated parameters, a clipped sum, a clipped update or field elements),
    none matching ``personal_rule(context)`` (the run's personal-layers rule), and a
    MetricRecord with ``num-examples`` only. ``admit``: see :class:`~flwr_jdp.reply_guard.ReplyGuard`.
    ``secure_only(context)`` (the run's noise is distributed): a train reply carries nothing
    outside flwr-jdp's secure sum (:func:`~flwr_jdp.joint_dp.secure_sum.inside_secure_sum`),
    where it is summed and masked before it leaves; the train handler refuses such a
    message already, this is the second line."""

    def train_rules(msg: Message, context: Context) -> Rules:
        if secure_only is not None and secure_only(context) and not inside_secure_sum():
            log(WARNING, "joint-dp: a train reply outside the secure sum under distributed noise; nothing of it "
                "leaves the node")
            return {}
        broadcast = msg.content.get(protocol.SHARED)
        cfg = msg.content.get(protocol.CONFIG)
        owners = [int(o) for o in cfg.get(protocol.OWNERS, [])] if isinstance(cfg, ConfigRecord) else []
        rule = personal_rule(context)
        personal = re.compile(rule) if rule else None
        shapes = {k: tuple(a.shape) for k, a in broadcast.items()
                  if personal is None or not personal.search(k)} if isinstance(broadcast, ArrayRecord) else {}
        release, count = Allowed(ArrayRecord, shapes=shapes), Allowed(MetricRecord, frozenset({protocol.NUM_EXAMPLES}))
        rules = {protocol.ARRAYS: release, protocol.METRICS: count} if len(owners) == 1 else {}
        for o in owners:
            rules[protocol.owner_key(o)], rules[protocol.metrics_key(o)] = release, count
        return rules

    return ReplyGuard(train_rules, JOINT_DP_SETUP, "joint-dp", admit)


__all__ = ["JOINT_DP_SETUP", "joint_dp_guard"]
