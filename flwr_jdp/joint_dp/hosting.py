"""Several owners on one SuperNode: :data:`owners_mod` and :func:`hosting_mod`.

Each of the app's handlers runs once per owner a message is for, with a context whose
``partition-id`` is the owner; the replies are merged under per-owner keys."""

from __future__ import annotations

from collections.abc import Callable
from logging import ERROR, WARNING

from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import NAMESPACE
from flwr_jdp.records import hosted_owners


def _owner_context(context: Context, owner: int, num_owners: int) -> Context:
    """``context`` as the handlers of owner ``owner`` see it: its ``partition-id`` is the
    owner, ``num-partitions`` the number of owners; the node's state is shared (every
    record the client half keeps in it is keyed by owner)."""
    node_config = {**context.node_config, "partition-id": owner, "num-partitions": num_owners}
    return Context(run_id=context.run_id, node_id=context.node_id, node_config=node_config,
                   state=context.state, run_config=context.run_config, series_id=context.series_id)


def _merged_setup(msg: Message, replies: list[tuple[int, Message]]) -> Message:
    """The set-up replies of a node's owners as one. Under its policy a node's owners
    charge one ledger, so each reports an equal share of the node's cap
    (``max-epsilon / k`` for ``k`` hosted owners): an honest server then plans every
    owner's noise for a share, and the node's ledger, which checks the composition of
    all their releases against the whole cap, is not run out mid-run."""
    errors = [f"owner {o}: {r.error.reason}" for o, r in replies if r.has_error()]
    if errors:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="; ".join(errors)), reply_to=msg)
    merged: dict[str, list] = {protocol.OWNER_IDS: [], protocol.NUM_RECORDS: [], protocol.NUM_USERS: []}
    if all(protocol.MAX_EPSILON in r.content[protocol.SETUP] for _, r in replies):
        merged[protocol.MAX_EPSILON] = []
    rec = ConfigRecord()
    for _, reply in replies:
        one = reply.content[protocol.SETUP]
        for key, values in merged.items():
            values.extend(one[key])
        for key in (protocol.PARAM_NAMES, protocol.PARAM_SHAPES):
            if key in one and key not in rec:
                rec[key] = one[key]
    if protocol.MAX_EPSILON in merged:
        merged[protocol.MAX_EPSILON] = [float(cap) / len(replies) for cap in merged[protocol.MAX_EPSILON]]
    for key, values in merged.items():
        rec[key] = values
    return Message(RecordDict({protocol.SETUP: rec}), reply_to=msg)


def hosting_mod(num_owners_key: str = f"{NAMESPACE}.num-owners", *,
                standalone_hosts_all: bool = False) -> Callable[[Message, Context, Callable], Message]:
    """A :func:`owners_mod` that reads the number of owners from run-config key
    ``num_owners_key``. With ``standalone_hosts_all`` a node without a
    ``partition-id`` hosts every owner (one SuperNode for the whole run), else its
    messages pass through."""

    def mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        num_owners = int(context.run_config.get(num_owners_key, 0) or 0)
        pid, parts = context.node_config.get("partition-id"), context.node_config.get("num-partitions")
        standalone = pid is None and standalone_hosts_all
        if standalone:
            pid, parts = 0, 1
        if not num_owners or pid is None or parts is None or (int(parts) == num_owners and not standalone):
            return call_next(msg, context)
        return _hosted(msg, context, call_next, num_owners, int(pid), int(parts), num_owners_key)

    mod.__name__ = mod.__qualname__ = "owners_mod"
    return mod


def _hosted(msg: Message, context: Context, call_next: Callable[[Message, Context], Message],
            num_owners: int, pid: int, parts: int, key: str) -> Message:
    if not 0 <= pid < parts:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             reason=f"node config partition-id={pid} not in [0, num-partitions={parts})"),
                       reply_to=msg)
    hosted = hosted_owners(num_owners, pid, parts)
    kind = msg.metadata.message_type.split(".")[0]
    if kind == MessageType.QUERY:
        return _merged_setup(msg, [(o, call_next(msg, _owner_context(context, o, num_owners))) for o in hosted])
    cfg_rec = msg.content.get(protocol.CONFIG)
    wanted = [int(o) for o in (cfg_rec.get(protocol.OWNERS, []) if isinstance(cfg_rec, ConfigRecord) else [])]
    owners = [o for o in wanted if o in set(hosted)]
    if not owners:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             reason=f"none of the owners {wanted[:10]} of this {kind} message is hosted here "
                                    f"(hosts {hosted[:10]}; check '{key}' and the node's "
                                    "'partition-id' / 'num-partitions')"), reply_to=msg)
    merged, errors = RecordDict(), []
    for o in owners:
        try:
            reply = call_next(msg, _owner_context(context, o, num_owners))
        except Exception as err:  # noqa: BLE001 - one owner's failure must not lose the others' replies
            log(ERROR, "owners_mod: owner %d's handler raised %s: %s", o, type(err).__name__, err)
            errors.append(f"owner {o}: {type(err).__name__} (its message is in the node's log, not sent)")
            continue
        if reply.has_error():
            errors.append(f"owner {o}: {reply.error.reason}")
            continue
        for key, record in reply.content.items():
            if key == protocol.ARRAYS:
                merged[protocol.owner_key(o)] = record
            elif key == protocol.METRICS:
                merged[protocol.metrics_key(o)] = record
            else:
                log(WARNING, "owners_mod: record %r of owner %d's %s reply not sent (only 'arrays' and "
                    "'metrics' are kept per owner)", key, o, kind)
    if errors and len(errors) == len(owners):
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="; ".join(errors)), reply_to=msg)
    for reason in errors:
        log(WARNING, "owners_mod: left out of the %s reply: %s", kind, reason)
    return Message(merged, reply_to=msg)


owners_mod = hosting_mod()
owners_mod.__doc__ = """Flower mod: one SuperNode hosts several owners (``ClientApp(mods=[owners_mod])``).

With ``jdp.num-owners`` = N in the run config, the node with ``partition-id`` p of
``num-partitions`` P hosts the owners o < N with ``o % P == p``: each of the app's
handlers (set-up, train, evaluate) is called once per owner the message is for,
with a context whose ``partition-id`` is the owner and ``num-partitions`` is N, so
an app written for one owner per node (its ``load_data(partition-id,
num-partitions)``) runs unchanged; the replies are merged, each owner's
``arrays`` and ``metrics`` under its own key (``owner.<o>``, ``metrics.<o>``).
Under a node's policy every owner it hosts charges the node's one ledger (the node
cannot verify that the run's partition of its data is disjoint,
:mod:`flwr_jdp.privacy.guard`), and each reports ``max-epsilon / k`` at set-up for
``k`` hosted owners, so that an honest server plans for the node's cap.
An owner whose handler fails is left out of the reply with a logged reason (the
server drops it for the round); if every owner fails, the error is the reply.
Without ``jdp.num-owners``, or with one owner per node, messages pass through.
Simulating many owners on a few SuperNodes saves Flower's per-node cost.
"""


__all__ = ["hosting_mod", "owners_mod"]
