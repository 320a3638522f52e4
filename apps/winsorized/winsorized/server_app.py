"""The winsorized user-level mean ServerApp: asks every SuperNode which users it
hosts, calibrates the two noise multipliers and runs
:class:`~flwr_jdp.strategies.DifferentialPrivacyWinsorizedMean` around Flower's
``FedAvg`` over :class:`UserGrid` (one node per user), charging a ledger before every
release. The app as a whole: :mod:`winsorized`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import numpy as np
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
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.config_check import ConfigError, run_folder
from flwr_jdp.strategies import DifferentialPrivacyWinsorizedMean
from flwr_jdp.winsorized.protocol import (
    ACCURACY,
    CONFIG,
    MODEL,
    NUM_PARAMS,
    SERVER_ROUND,
    SETUP,
    USERS,
    parse_user_key,
)

from .task import UserSource, WinsorizedConfig, parse_config

server = ServerApp()


#: How long the server waits for every user to be reported by some node.
SETUP_TIMEOUT = 300.0


# ---------------------------------------------------------------- server side
class UserGrid(Grid):
    """The Grid a strategy drives: one node per user (node id = user id).

    ``send_and_receive`` packs the messages of one type to the users of one
    SuperNode into one message (the first message's records, ``config['users']``
    added; messages of one type to one SuperNode's users must share their content,
    as ``FedAvg``'s do) and splits that SuperNode's reply into one reply per user:
    entry ``user.k`` of each ArrayRecord becomes ``{w: ...}`` and metrics
    ``user.k.<name>`` become ``<name>``. A user whose entry is missing, or whose
    SuperNode replied with an error, gets an error reply; a SuperNode that does not
    reply leaves its users without one.
    """

    def __init__(self, grid: Grid, node_users: dict[int, list[int]]) -> None:
        self.grid = grid
        self.home = {int(u): int(node) for node, users in node_users.items() for u in users}

    def set_run(self, run_id: int) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.home)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("UserGrid only sends and receives (send_and_receive)")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("UserGrid only sends and receives (send_and_receive)")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        groups: dict[tuple[int, str], list[Message]] = {}
        for msg in messages:
            user = msg.metadata.dst_node_id
            if user not in self.home:
                raise ValueError(f"user {user} is hosted by no SuperNode")
            groups.setdefault((self.home[user], msg.metadata.message_type), []).append(msg)
        packed = []
        for (node, kind), group in groups.items():
            content = group[0].content
            if any(m.content is not content for m in group[1:]):
                raise ValueError(f"{kind} messages to the users of node {node} differ: UserGrid sends "
                                 "one content per SuperNode")
            records = {k: v for k, v in content.items() if k != CONFIG}
            config = dict(content[CONFIG]) if CONFIG in content else {}
            records[CONFIG] = ConfigRecord({**config, USERS: [m.metadata.dst_node_id for m in group]})
            packed.append(Message(RecordDict(records), dst_node_id=node, message_type=kind))
        replies = {(r.metadata.src_node_id, r.metadata.message_type): r
                   for r in self.grid.send_and_receive(packed, timeout=timeout)}
        out = []
        for key, group in groups.items():
            reply = replies.get(key)
            if reply is not None:
                per_user = self._per_user(reply)
                out += [self._reply(m, reply, per_user.get(m.metadata.dst_node_id, {})) for m in group]
        return out

    @staticmethod
    def _per_user(reply: Message) -> dict[int, dict[str, ArrayRecord | MetricRecord]]:
        """The records of each user in a SuperNode's ``reply``: entry ``user.k`` of
        each ArrayRecord as ``{w: ...}``, metrics ``user.k.<name>`` as ``<name>``."""
        if reply.has_error():
            return {}
        found: dict[int, dict[str, dict]] = {}
        kinds: dict[str, type] = {}
        for name, rec in reply.content.array_records.items():
            kinds[name] = ArrayRecord
            for key in rec.keys():
                parsed = parse_user_key(key)
                if parsed is not None and not parsed[1]:
                    found.setdefault(parsed[0], {}).setdefault(name, {})[MODEL] = rec[key]
        for name, rec in reply.content.metric_records.items():
            kinds[name] = MetricRecord
            for key, value in rec.items():
                parsed = parse_user_key(key)
                if parsed is not None and parsed[1]:
                    found.setdefault(parsed[0], {}).setdefault(name, {})[parsed[1]] = value
        return {user: {name: kinds[name](entries) for name, entries in recs.items()}
                for user, recs in found.items()}

    @staticmethod
    def _reply(instruction: Message, reply: Message, records: dict[str, ArrayRecord | MetricRecord]) -> Message:
        """User ``instruction.dst_node_id``'s reply: its ``records`` from its SuperNode's ``reply``."""
        node = reply.metadata.src_node_id
        if reply.has_error():
            return Message(Error(reply.error.code, f"node {node}: {reply.error.reason}"), reply_to=instruction)
        has_arrays = any(isinstance(r, ArrayRecord) for r in records.values())
        has_metrics = any(isinstance(r, MetricRecord) for r in records.values())
        if not has_metrics or (instruction.metadata.message_type == MessageType.TRAIN and not has_arrays):
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 f"node {node} sent no reply for user {instruction.metadata.dst_node_id}"),
                           reply_to=instruction)
        return Message(RecordDict(dict(records)), reply_to=instruction)


def discover_users(grid: Grid, source: UserSource, timeout: float | None = None) -> dict[int, list[int]]:
    """Ask every SuperNode which users it hosts (each user at exactly one node);
    fails, before any release, unless all ``num-users`` users are hosted within
    ``timeout`` seconds (default :data:`SETUP_TIMEOUT`)."""
    from flwr_jdp.node_query import query_nodes

    n, num_params = source.num_users, source.model().num_params
    node_users: dict[int, list[int]] = {}
    seen: set[int] = set()

    def handle(reply: Message) -> None:
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise RuntimeError(f"node {node} failed at set-up: {reply.error.reason}")
        if SETUP not in reply.content:
            raise RuntimeError(f"node {node} sent a set-up reply without a '{SETUP}' record")
        rec = reply.content[SETUP]
        ids = [int(k) for k in rec.get(USERS, [])]
        bad = [k for k in ids if not 0 <= k < n or k in seen]
        if bad:
            raise RuntimeError(f"node {node} reports users {bad[:5]} out of range [0, {n}) or hosted twice")
        if int(rec.get(NUM_PARAMS, num_params)) != num_params:
            raise RuntimeError(f"node {node}'s model has {rec[NUM_PARAMS]} parameters, the server's {num_params}")
        seen.update(ids)
        if ids:
            node_users[node] = ids

    _, silent = query_nodes(
        grid, lambda node: Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 0})}), dst_node_id=node,
                                   message_type=MessageType.QUERY),
        handle, lambda: len(seen) == n, time.time() + (SETUP_TIMEOUT if timeout is None else timeout))
    if len(seen) != n:
        raise RuntimeError(f"{n - len(seen)} of num-users={n} users are hosted by no responding SuperNode "
                           f"(nodes that never answered: {silent[:10]}); every round needs all of them")
    return node_users


def calibrated_estimator(cfg: WinsorizedConfig):  # noqa: ANN201
    """The :class:`~flwr_jdp.winsorized.estimator.WinsorizedMean` whose ``rounds``
    estimates reach ``target-epsilon`` at ``delta``: range and mean noise
    multipliers ``s / sqrt(range-share)`` and ``s / sqrt(1 - range-share)`` (the
    two Gaussians compose to one of multiplier ``s``), ``s`` the smallest that
    meets the target."""
    import dp_accounting as dpa

    from flwr_jdp.privacy.calibration import calibrate
    from flwr_jdp.winsorized.estimator import WinsorizedMean

    def make(s: float) -> WinsorizedMean:
        return WinsorizedMean(cfg.bound, cfg.tau, s / math.sqrt(cfg.range_share),
                              s / math.sqrt(1.0 - cfg.range_share), secure=cfg.secure_noise)

    s = calibrate(cfg.target_epsilon, cfg.delta,
                  lambda z: dpa.SelfComposedDpEvent(make(z).event(), cfg.rounds))
    return make(s)


def run_server(grid: Grid, context: Context):  # noqa: ANN201
    """The ServerApp's work; returns ``(strategy, Flower Result)`` (for tests)."""
    try:
        source, cfg = parse_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
    from flwr.serverapp.strategy import FedAvg

    from flwr_jdp.privacy.ledger import PrivacyLedger

    out = Path(run_folder(cfg.results_dir, str(context.run_id)))
    if (out / "ledger.json").exists():
        raise ConfigError(f"run-config key 'results-dir' must name a folder without a ledger (this app does "
                          f"not resume), got {str(out)!r}, which holds {out / 'ledger.json'}")
    n = source.num_users
    node_users = discover_users(grid, source)
    estimator = calibrated_estimator(cfg)
    log(INFO, "winsorized user-level mean: %d users on %d SuperNodes, %d rounds calibrated to epsilon %.4g "
        "at delta %.3g: noise multipliers range %.4g, mean %.4g; results in %s", n, len(node_users),
        cfg.rounds, cfg.target_epsilon, cfg.delta, estimator.range_noise, estimator.mean_noise, out.resolve())
    fedavg = FedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n,
                    min_available_nodes=n)
    ledger = PrivacyLedger(delta=cfg.delta, unit="user", budget=cfg.target_epsilon)
    strategy = DifferentialPrivacyWinsorizedMean(fedavg, estimator, n, ledger=ledger,
                                                 ledger_path=out / "ledger.json", noise_seed=cfg.noise_seed)
    initial = ArrayRecord({MODEL: Array(np.zeros(source.model().num_params))})
    result = strategy.start(UserGrid(grid, node_users), initial_arrays=initial, num_rounds=cfg.rounds)
    final = result.arrays[MODEL].numpy()
    np.save(out / "model.npy", final)
    summary = {"status": strategy.status, "epsilon": ledger.epsilon(), "delta": cfg.delta,
               "target_epsilon": cfg.target_epsilon, "num_users": n, "supernodes": len(node_users),
               "noise": {"range": estimator.range_noise, "mean": estimator.mean_noise},
               "users": asdict(source), "settings": asdict(cfg), "history": strategy.history,
               "dropped": strategy.dropped}
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=float))
    last = strategy.history[-1].get("evaluate", {}) if strategy.history else {}
    log(INFO, "winsorized user-level mean: %s after %d rounds, accuracy %.4f, epsilon %.4f (target %.4g, "
        "delta %.3g); results in %s", strategy.status, len(strategy.history), last.get(ACCURACY, float("nan")),
        ledger.epsilon(), cfg.target_epsilon, cfg.delta, out.resolve())
    return strategy, result


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Federated softmax regression under user-level DP, as the run config says."""
    run_server(grid, context)
