"""The winsorized user-level mean ClientApp: each SuperNode hosts users ``p, p + P, ...``,
builds their records (:mod:`winsorized.task`), runs their local updates from the
broadcast global model and replies with one update per user. The app as a whole:
:mod:`winsorized`.
"""

from __future__ import annotations

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from flwr_jdp.records import hosted_owners
from flwr_jdp.winsorized.protocol import (
    ACCURACY,
    ARRAYS,
    CONFIG,
    LOSS,
    METRICS,
    MODEL,
    NUM_EXAMPLES,
    NUM_PARAMS,
    SETUP,
    USERS,
    user_key,
    user_metric_key,
)

from .task import UserData, local_update, parse_config

client = ClientApp()


# ---------------------------------------------------------------- ClientApp
def hosted_users(context: Context) -> list[int]:
    """The users this SuperNode hosts: ``partition-id, partition-id + P, ...``."""
    source, _ = parse_config(context.run_config)
    pid = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    return hosted_owners(source.num_users, pid, parts)


def _asked(msg: Message, context: Context) -> tuple[list[UserData], bool]:
    """The hosted users a request asks about, and whether it named them (a plain
    Flower request without ``users`` asks about the node's one user)."""
    source, _ = parse_config(context.run_config)
    hosted = source.users(tuple(hosted_users(context)))  # built once per process
    config = msg.content[CONFIG] if CONFIG in msg.content else ConfigRecord()
    if USERS not in config:
        if len(hosted) != 1:
            raise ValueError(f"this node hosts {len(hosted)} users: name them in config '{USERS}'")
        return list(hosted), False
    mine = {u.user_id: u for u in hosted}
    return [mine[int(k)] for k in config[USERS] if int(k) in mine], True


def _global_model(msg: Message) -> np.ndarray:
    return msg.content[ARRAYS][MODEL].numpy().astype(np.float64)


@client.query()
def setup(msg: Message, context: Context) -> Message:
    """Report the users this node hosts and its model size (public metadata);
    their records are built now, so a missing data set fails before any release."""
    source, _ = parse_config(context.run_config)
    hosted = hosted_users(context)
    users = source.users(tuple(hosted))
    num_params = source.model().num_params
    for user in users:
        if user.x_train.shape[1] != source.features:
            raise ValueError(f"user {user.user_id} has {user.x_train.shape[1]} features, "
                             f"the model expects {source.features}")
    return Message(RecordDict({SETUP: ConfigRecord({USERS: hosted, NUM_PARAMS: num_params})}), reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Each user asked: ``local-steps`` gradient steps from the global ``w``; the
    reply holds every user's new model and its number of records."""
    source, cfg = parse_config(context.run_config)
    model = source.model()
    w = _global_model(msg)
    users, named = _asked(msg, context)
    new = {u.user_id: local_update(model, w, u, cfg.local_steps, cfg.lr) for u in users}
    if not named:
        (u,) = users
        content = {ARRAYS: ArrayRecord({MODEL: Array(new[u.user_id])}),
                   METRICS: MetricRecord({NUM_EXAMPLES: len(u.y_train)})}
    else:
        content = {ARRAYS: ArrayRecord({user_key(k): Array(v) for k, v in new.items()}),
                   METRICS: MetricRecord({user_metric_key(u.user_id, NUM_EXAMPLES): len(u.y_train)
                                          for u in users})}
    return Message(RecordDict(content), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Each user asked measures the global ``w`` on its own test records."""
    source, _ = parse_config(context.run_config)
    model = source.model()
    w = _global_model(msg)
    users, named = _asked(msg, context)
    metrics: dict[str, float | int] = {}
    for u in users:
        row = {ACCURACY: model.accuracy(w, u.x_test, u.y_test), LOSS: model.loss(w, u.x_test, u.y_test),
               NUM_EXAMPLES: len(u.y_test)}
        metrics.update(row if not named else {user_metric_key(u.user_id, k): v for k, v in row.items()})
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)
