"""The winsorized user-level mean Flower App: ``server`` (ServerApp) and ``client`` (ClientApp).

Federated softmax regression under **user-level** DP with a trusted aggregator:
every round each of ``num-users`` users takes ``local-steps`` full-batch gradient
steps from the global model ``w`` on its own records, and the server releases the
winsorized private mean of the users' updates
(:class:`~flwr_jdp.winsorized.strategy.DifferentialPrivacyWinsorizedMean` around
Flower's ``FedAvg``; Levy et al., "Learning with User-Level Privacy"). Its two
noise multipliers are calibrated before round 1 so that ``rounds`` releases reach
``target-epsilon`` at ``delta`` (replace-one user, ``n = num-users`` public); every
round is charged to a :class:`~flwr_jdp.privacy.ledger.PrivacyLedger` before its
messages leave the server.

Users and nodes. A SuperNode with ``partition-id = p`` of ``num-partitions = P``
hosts users ``p, p + P, ...`` (one user per node when ``num-users = P``) and
builds their records itself: synthetic (the default; no data needed) or a real
data set's balanced partition (``fashion-mnist`` / ``mnist`` from ``data-dir``,
or scikit-learn's ``digits``). The server asks every node once which users it
hosts, then drives the strategy over :class:`UserGrid`, a Grid with one node per
user, which packs the messages of the users of one SuperNode into one message and
splits its reply into one standard Flower reply per user (``arrays = {w: w_k}``,
``metrics = {num-examples: m_k}``): ``FedAvg`` and the DP wrapper see one client
per user, the transport one message per SuperNode. Wire format:
:mod:`flwr_jdp.winsorized.protocol`.

Evaluation: each user measures the global model on its own test records; the
accuracy and loss logged per round are their means over users (FedAvg's
``num-examples``-weighted average). They are computed on held-out records, outside
the training-data guarantee, as in Flower's own examples.

Run it with ``flwr run examples/winsorized --stream``. Run-config keys (every key
has a default; a bad value fails at start-up naming the key and its range):

- users and data: ``num-users``, ``dataset`` (``synthetic`` | ``digits`` |
  ``fashion-mnist`` | ``mnist``), ``data-seed``; synthetic: ``samples-per-user``,
  ``test-samples`` (per user), ``dim``, ``classes``, ``separation``; real:
  ``data-dir``, ``classes-per-user``, ``max-records`` (0 = all), ``pool``
  (average-pool images over ``pool x pool`` blocks);
- training: ``rounds`` (T, also the horizon the noise is calibrated for),
  ``local-steps`` (E), ``lr``;
- privacy: ``target-epsilon``, ``delta``, ``bound`` (B: the histogram's range
  ``[-B, B]`` per coordinate after the rotation, about the largest update norm),
  ``tau`` (the L2 radius the users' updates concentrate in around their mean; B and
  tau only set the noise and the accuracy: values outside are clipped, so the
  guarantee holds whatever the data), ``range-share`` (the
  range step's share of the budget, in ``1/z^2``), ``noise-seed`` (-1: seeded from
  the OS CSPRNG), ``secure-noise`` (noise drawn from the OS CSPRNG itself);
- ``results-dir`` (``""``: a new folder ``results/<date-time>-<run>``): the ledger
  (``ledger.json``, written before every release), ``results.json`` and the final
  model (``model.npy``). The app does not resume: a folder that already holds a
  ledger is refused.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
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
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.config_check import ConfigError, need, parse_dataclass, run_folder
from flwr_jdp.models.linear import LinearModel
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
    SERVER_ROUND,
    SETUP,
    USERS,
    parse_user_key,
    user_key,
    user_metric_key,
)

server = ServerApp()
client = ClientApp()

DATASETS = ("synthetic", "digits", "fashion-mnist", "mnist")
#: Side of the (square) images of the real data sets, and their number of classes.
IMAGE_SIDE = {"digits": 8, "fashion-mnist": 28, "mnist": 28}
REAL_CLASSES = 10
#: How long the server waits for every user to be reported by some node.
SETUP_TIMEOUT = 300.0


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class UserData:
    """One user's records (flattened features, integer labels as floats)."""

    user_id: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class UserSource:
    """Where the users' records come from (hashable: a node builds its users once)."""

    dataset: str = "synthetic"
    num_users: int = 1000
    samples_per_user: int = 50
    test_samples: int = 50
    dim: int = 10
    classes: int = 4
    separation: float = 1.5
    data_dir: str = ""
    classes_per_user: int = 10
    max_records: int = 0
    pool: int = 2
    data_seed: int = 0

    def __post_init__(self) -> None:
        need(self.dataset in DATASETS, "dataset", f"one of {DATASETS}", self.dataset)
        need(self.num_users >= 2, "num-users", ">= 2", self.num_users)
        need(self.samples_per_user >= 1, "samples-per-user", ">= 1", self.samples_per_user)
        need(self.test_samples >= 1, "test-samples", ">= 1", self.test_samples)
        need(self.dim >= 1, "dim", ">= 1", self.dim)
        need(self.classes >= 2, "classes", ">= 2", self.classes)
        need(math.isfinite(self.separation) and self.separation >= 0, "separation", "finite and >= 0",
             self.separation)
        need(1 <= self.classes_per_user <= REAL_CLASSES, "classes-per-user", f"in [1, {REAL_CLASSES}]",
             self.classes_per_user)
        need(self.max_records >= 0, "max-records", ">= 0 (0 = all)", self.max_records)
        need(self.pool >= 1, "pool", ">= 1", self.pool)

    @property
    def features(self) -> int:
        if self.dataset == "synthetic":
            return self.dim
        side = IMAGE_SIDE[self.dataset]
        return (side // self.pool) ** 2 if self.pool > 1 else side * side

    @property
    def num_classes(self) -> int:
        return self.classes if self.dataset == "synthetic" else REAL_CLASSES

    def model(self) -> LinearModel:
        """Softmax regression with a bias on the flattened, unit-norm records."""
        return LinearModel("softmax", self.features, self.num_classes, bias=True)

    def users(self, user_ids: tuple[int, ...]) -> tuple[UserData, ...]:
        """The users ``user_ids`` (built once per process)."""
        return _users(self, tuple(int(k) for k in user_ids))


@dataclass(frozen=True)
class WinsorizedConfig:
    """Training and privacy settings of a run."""

    rounds: int = 5
    local_steps: int = 5
    lr: float = 0.5
    target_epsilon: float = 2.0
    delta: float = 1e-5
    bound: float = 1.0
    tau: float = 0.5
    range_share: float = 0.25
    noise_seed: int = -1
    secure_noise: bool = False
    results_dir: str = ""

    def __post_init__(self) -> None:
        need(self.rounds >= 1, "rounds", ">= 1", self.rounds)
        need(self.local_steps >= 1, "local-steps", ">= 1", self.local_steps)
        need(math.isfinite(self.lr) and self.lr > 0, "lr", "finite and > 0", self.lr)
        need(math.isfinite(self.target_epsilon) and self.target_epsilon > 0, "target-epsilon",
             "finite and > 0", self.target_epsilon)
        need(0 < self.delta < 1, "delta", "in (0, 1)", self.delta)
        need(math.isfinite(self.bound) and self.bound > 0, "bound", "finite and > 0", self.bound)
        need(math.isfinite(self.tau) and self.tau > 0, "tau", "finite and > 0", self.tau)
        need(0 < self.range_share < 1, "range-share", "in (0, 1)", self.range_share)
        need(self.noise_seed >= -1, "noise-seed", ">= -1 (-1: seeded from the OS CSPRNG)", self.noise_seed)
        need(not (self.secure_noise and self.noise_seed >= 0), "noise-seed",
             "-1 when secure-noise = true (secure noise cannot be seeded)", self.noise_seed)


def parse_config(run_config: dict[str, Any]) -> tuple[UserSource, WinsorizedConfig]:
    """``(users, settings)`` from a Flower run config; a bad value raises
    :class:`~flwr_jdp.config_check.ConfigError` naming its key and range."""
    return parse_dataclass(UserSource, run_config), parse_dataclass(WinsorizedConfig, run_config)


# ---------------------------------------------------------------- users' data
def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _synthetic_user(source: UserSource, user_id: int) -> UserData:
    """Gaussian classes around ``separation``-long random means (one distribution
    for every user), records scaled to unit norm; deterministic in ``(data-seed, user)``."""
    g = np.random.default_rng([source.data_seed, 0x5EED]).standard_normal((source.classes, source.dim))
    means = source.separation * g / np.linalg.norm(g, axis=1, keepdims=True)
    rng = np.random.default_rng([source.data_seed, user_id, 1])

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, source.classes, count)
        return _unit_rows(means[y] + rng.standard_normal((count, source.dim))), y.astype(float)

    x, y = draw(source.samples_per_user)
    xt, yt = draw(source.test_samples)
    return UserData(user_id, x, y, xt, yt)


def _flat(x: np.ndarray, pool: int) -> np.ndarray:
    """Images average-pooled over ``pool x pool`` blocks, flattened, unit norm
    (public per-record transforms)."""
    x = x.astype(np.float64)
    if pool > 1:
        h, w = (x.shape[-2] // pool) * pool, (x.shape[-1] // pool) * pool
        x = x[..., :h, :w].reshape(*x.shape[:-2], h // pool, pool, w // pool, pool).mean(axis=(-3, -1))
    return _unit_rows(x.reshape(len(x), -1))


@functools.lru_cache(maxsize=64)  # one entry per SuperNode a process runs
def _users(source: UserSource, user_ids: tuple[int, ...]) -> tuple[UserData, ...]:
    if source.dataset == "synthetic":
        return tuple(_synthetic_user(source, k) for k in user_ids)
    from flwr_jdp.data.partition import load_partitions

    owners = load_partitions(source.dataset, source.data_dir, source.num_users, source.classes_per_user,
                             source.max_records, 1, source.data_seed)
    return tuple(UserData(k, _flat(owners[k].x_train, source.pool), owners[k].y_train.astype(float),
                          _flat(owners[k].x_test, source.pool), owners[k].y_test.astype(float))
                 for k in user_ids)


def local_update(model: LinearModel, w: np.ndarray, user: UserData, steps: int, lr: float) -> np.ndarray:
    """``steps`` full-batch gradient steps of size ``lr`` from ``w`` on the user's records."""
    w = np.array(w, dtype=np.float64, copy=True)
    for _ in range(steps):
        w -= lr * model.loss_grad(w, user.x_train, user.y_train)[1]
    return w


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
    from flwr_jdp.winsorized.strategy import DifferentialPrivacyWinsorizedMean  # the server side only

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


__all__ = ["DATASETS", "UserData", "UserGrid", "UserSource", "WinsorizedConfig", "calibrated_estimator",
           "client", "discover_users", "hosted_users", "local_update", "parse_config", "run_server", "server"]
