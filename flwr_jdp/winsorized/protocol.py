"""Message keys of the winsorized user-level mean Flower App (server:
:class:`flwr_jdp.strategies.winsorized.DifferentialPrivacyWinsorizedMean` around
Flower's ``FedAvg``, run by the winsorized app, ``apps/winsorized``).

A SuperNode may host several users (user ``k`` lives on the node with
``partition-id = k mod num-partitions``), so a node's messages carry every user it
is asked about, each under :func:`user_key`:

- ``query`` (once, before any release): the node replies ``setup`` =
  ``ConfigRecord({users: [k, ...], num-params: p})``: the users it hosts and its
  model's parameter count (public metadata).
- ``train``: the server sends ``arrays`` = ``ArrayRecord({w: global model})`` and
  ``config`` = ``ConfigRecord({server-round: t, users: [k, ...]})``; the node
  replies ``arrays`` = ``ArrayRecord({user.k: w_k, ...})`` (each user's model after
  its local steps) and ``metrics`` = ``MetricRecord({user.k.num-examples: m_k, ...})``.
- ``evaluate``: the same request; the node replies ``metrics`` with
  ``user.k.accuracy``, ``user.k.loss`` and ``user.k.num-examples`` (the user's test
  records) for every user asked.

On the server these replies are split into one standard Flower reply per user
(``arrays`` = ``{w: w_k}``, ``metrics`` = ``{num-examples: m_k}``; evaluate:
``{accuracy, loss, num-examples}``), so ``FedAvg`` and the DP wrapper see one
client per user.
"""

from __future__ import annotations

#: Flower's standard record names (``FedAvg``'s ``arrayrecord_key`` / ``configrecord_key``).
ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"
#: The set-up reply's record and its entries.
SETUP, USERS, NUM_PARAMS = "setup", "users", "num-params"
#: The name of the global model's one array (the flat softmax-regression parameters).
MODEL = "w"
#: Metric names of one user.
NUM_EXAMPLES, ACCURACY, LOSS = "num-examples", "accuracy", "loss"
#: FedAvg's round key in ``config``.
SERVER_ROUND = "server-round"


def user_key(user: int) -> str:
    """The entry of user ``user`` in a node's reply (``user.12``)."""
    return f"user.{int(user)}"


def user_metric_key(user: int, name: str) -> str:
    """Metric ``name`` of user ``user`` in a node's reply (``user.12.accuracy``)."""
    return f"{user_key(user)}.{name}"


def parse_user_key(key: str) -> tuple[int, str] | None:
    """``(user, rest)`` of ``user.<k>`` (rest ``""``) or ``user.<k>.<name>``; else None."""
    head, _, tail = key.partition(".")
    number, _, rest = tail.partition(".")
    if head != "user" or not number.isdigit():
        return None
    return int(number), rest


__all__ = ["ACCURACY", "ARRAYS", "CONFIG", "LOSS", "METRICS", "MODEL", "NUM_EXAMPLES", "NUM_PARAMS",
           "SERVER_ROUND", "SETUP", "USERS", "parse_user_key", "user_key", "user_metric_key"]
