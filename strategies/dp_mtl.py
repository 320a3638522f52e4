"""DPMeanRegularizedMTL: DP mean-regularized multi-task learning (Algorithm 1 of
Hu, Wu and Smith) as a Flower Message-API strategy.

Privacy guarantee: task-level (epsilon, delta)-joint DP. The unit is one task's
(owner's) whole data set, neighbouring by ``replace-one`` (default, the JDP
definition) or ``add-remove``. Every released mean ``w~^t`` is a Gaussian release
of sensitivity ``2B/(qm)`` (replace-one) or ``B/(qm)`` (add/remove) with noise std
``sigma`` per coordinate (see :mod:`flwr_jdp.mtl.noise`); the ledger (one
``server`` scope) charges each release *before* the tasks are asked, in the
calibration mode's terms (``paper``: Theorem 1's RDP; ``tight``: the exact event,
PLD, with amplification by Poisson task sampling when ``fraction-train < 1``).

Trust model: the aggregator (this strategy) is trusted and sees each sampled
task's ball-projected ``w_k``; other tasks only ever receive the noisy means.
Each task keeps ``w_k`` in its SuperNode's ``context.state``, and its
personalized model (fine-tuned against the final ``w~``) never leaves it.

Rounds
- ``query`` (once): each SuperNode reports the task ids it hosts;
- ``train`` (rounds 1..T): each node gets ``w~`` and *only its own* sampled task
  ids (the sample stays hidden from other tasks, as amplification requires),
  runs ``E`` projected gradient steps per task and replies with the ``w_k``;
- ``evaluate`` (every round): nodes fine-tune copies against ``w~`` and report
  summed test metrics of the personalized models (a benchmark metric of the
  tasks' own test data, not covered by DP).

A reply that is an error, lacks a record, names a task that was not asked (or
twice), or carries a model of the wrong shape, non-finite, or outside the ball
is dropped with a logged reason: that task is then absent from the sum, which
the sensitivity covers. Results, ledger and the current mean are written after
every round (``results-dir``): the ledger right after each charge, the new mean
before it is sent to anyone. A restarted server with ``resume`` continues after
the last round whose mean it had computed, with that mean and the epsilon it had
spent; a round that was charged but crashed before its mean existed released
nothing, so its charge covers its rerun.

A user's own torch app (:class:`flwr_jdp.mtl.client.MTLClient` on the ClientApp)
builds the strategy with :meth:`DPMeanRegularizedMTL.from_run_config` (``jdp.*``
keys) and calls ``start(grid, initial_arrays=ArrayRecord(Net().state_dict()),
...)``: ``w_k`` is the whole model flattened, ``num_params`` its size, and the
initial mean ``w~^0`` the flattened ``initial_arrays`` (public, data-free). Each
node hosts one task (its ``partition-id``); at set-up it reports its model's
parameter count, names and shapes, which must match ``initial_arrays`` (else the
run fails before any privacy is spent). ``train_config`` / ``evaluate_config``
reach the ClientApps in the instruction's ``config`` record; evaluate replies
(``metrics`` with ``num-examples`` and whatever the user's ``test`` reports) are
averaged weighted by ``num-examples``; ``evaluate_fn`` gets the noisy mean in the
layout of ``initial_arrays``.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted

from flwr_jdp.checkpoint import Checkpoint
from flwr_jdp.config_check import ConfigError, run_folder
from flwr_jdp.mtl import health
from flwr_jdp.mtl.algorithm import MeanServer, MTLConfig
from flwr_jdp.mtl.config import namespaced_mtl_config
from flwr_jdp.mtl.noise import MeanRelease, paper_sigma, tight_sigma
from flwr_jdp.mtl.protocol import (  # noqa: E402 - the keys, re-exported
    CONFIG,
    MEAN,
    METRICS,
    MODELS,
    NUM_EXAMPLES,
    NUM_PARAMS,
    NUM_PARTITIONS,
    PARAM_NAMES,
    PARAM_SHAPES,
    ROUND,
    SETUP,
    TASKS,
    parse_task_key,
    task_key,
)
from flwr_jdp.node_query import query_nodes
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.mechanisms import numpy_rng
from flwr_jdp.strategies.accounted import AccountedStrategy, RunFailed

#: Relative slack on the ball check (float32/float64 round-off of a projected model).
BALL_SLACK = 1e-6


class DPMeanRegularizedMTL(AccountedStrategy):
    """Algorithm 1: broadcast ``w~``, tasks take projected steps, release a noisy mean.

    The numpy app builds it as ``DPMeanRegularizedMTL(num_tasks, num_params, cfg, ...)``;
    a user's torch app as ``DPMeanRegularizedMTL.from_run_config(context.run_config)``
    and ``start(grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=...,
    train_config=..., evaluate_config=..., evaluate_fn=...)`` (see the module docstring)."""

    def __init__(self, num_tasks: int, num_params: int | None, cfg: MTLConfig, results_dir: str | Path = "",
                 noise_seed: int = -1, run_config: dict | None = None, resume: bool = True,
                 max_skipped_rounds: int | None = None) -> None:
        """``num_tasks`` 0: one task per node, as many as the nodes' ``num-partitions``
        (learnt at set-up, before the noise is calibrated). ``num_params`` ``None``:
        the size of ``start()``'s ``initial_arrays`` (a user's model)."""
        self.num_tasks, self.num_params, self.cfg = num_tasks, num_params, cfg
        self._rng = numpy_rng(None if noise_seed < 0 else noise_seed)
        self.release: MeanRelease | None = None
        self.server: MeanServer | None = None
        if num_tasks:
            self._plan(num_tasks)
        self.ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant, unit="task",
                                    budget=cfg.target_epsilon if cfg.private else None,
                                    neighbouring=cfg.neighbouring)
        self.mean = np.zeros(num_params or 0)
        #: ``initial_arrays``' layout ``(name, shape, dtype)`` (a user's model), else ``None``.
        self.layout: list[tuple[str, tuple[int, ...], str]] | None = None
        self.key_prefix = ""  # "jdp." when configured by from_run_config
        if max_skipped_rounds is not None:
            self.max_skipped_rounds = int(max_skipped_rounds)
        self.node_tasks: dict[int, list[int]] = {}
        self.history: list[dict] = []
        self.dropped: list[str] = []
        self.status = "running"
        self.resume = resume
        self._asked: dict[int, set[int]] = {}
        self._charged: set[int] = set()
        self._t0 = time.time()
        self._report: dict | None = None
        self.checkpoint = Checkpoint(Path(results_dir), dict(run_config or {})) if results_dir else None

    @classmethod
    def from_run_config(cls, run_config: dict, **kwargs: object) -> DPMeanRegularizedMTL:
        """A strategy configured by the ``jdp.*`` keys of a user's run config
        (``[tool.flwr.app.config.jdp]`` in pyproject.toml, flattened by Flower to
        ``jdp.<key>``; see :func:`flwr_jdp.mtl.config.namespaced_mtl_config`). The
        number of parameters comes from ``start(initial_arrays=...)``. ``kwargs`` as
        for the constructor (``resume``, ``max_skipped_rounds``)."""
        num_tasks, cfg, extras = namespaced_mtl_config(run_config)
        results_dir = extras["results-dir"] or run_folder("", secrets.token_hex(8))
        settings: dict = {"resume": extras["resume"], "max_skipped_rounds": extras["max-skipped-rounds"]}
        settings.update(kwargs)
        strategy = cls(num_tasks, None, cfg, results_dir, extras["noise-seed"], dict(run_config), **settings)
        strategy.key_prefix = "jdp."
        return strategy

    def _plan(self, num_tasks: int) -> None:
        """The release (noise calibrated for ``num_tasks``) and the aggregator."""
        cfg = self.cfg
        self.num_tasks = num_tasks
        if cfg.private:
            self.release = cfg.release(num_tasks)
        else:
            self.release = MeanRelease(cfg.radius, num_tasks, cfg.fraction_train, 0.0, cfg.neighbouring)
        self.server = MeanServer(self.release, self._rng)
        self._report = None

    # ------------------------------------------------------------ helpers
    def _drop(self, reply: Message, reason: str) -> None:
        msg = f"node {reply.metadata.src_node_id}: {reason}"
        self.dropped.append(msg)
        log(WARNING, "Dropped reply from %s", msg)

    def _mean_record(self) -> ArrayRecord:
        return ArrayRecord({MEAN: Array(np.ascontiguousarray(self.mean, dtype=np.float64))})

    def calibration_report(self) -> dict:
        """The noise of both calibrations for this run's setting, side by side."""
        if self._report is None:
            self._report = self._calibrations()
        return self._report

    def _calibrations(self) -> dict:
        if not self.cfg.private:
            return {}
        c = self.cfg
        paper = paper_sigma(c.target_epsilon, c.delta, c.radius, c.rounds, self.num_tasks)
        tight = tight_sigma(c.target_epsilon, c.delta, c.radius, c.rounds, self.num_tasks,
                            c.fraction_train, c.neighbouring, c.accountant)
        return {"paper_sigma": paper, "tight_sigma": tight, "ratio": paper / tight}

    # ------------------------------------------------------------- setup
    def discover(self, grid: Grid, timeout: float) -> None:
        """Ask every node which tasks it hosts; keep each task at one node. Nodes
        may still be joining or busy: new and silent nodes are queried until every
        task is hosted or ``timeout`` passes (then the run goes on without the missing
        tasks, and the warning names the nodes that never answered)."""
        seen: set[int] = set()

        def handle(reply: Message) -> None:
            node = reply.metadata.src_node_id
            if self.layout is not None and reply.has_error():  # a user's app: fail now, not at the timeout
                raise ConfigError(f"node {node} failed at set-up: {reply.error.reason}")
            if reply.has_error() or SETUP not in reply.content:
                self._drop(reply, "setup reply without a 'setup' record")
                return
            self._check_reported_model(reply.content[SETUP], node)
            ids = [int(k) for k in reply.content[SETUP].get(TASKS, [])]
            bad = [k for k in ids if not 0 <= k < self.num_tasks or k in seen]
            if bad:
                self._drop(reply, f"task ids {bad[:5]} out of range or hosted twice")
                return
            seen.update(ids)
            self.node_tasks[reply.metadata.src_node_id] = ids

        _, silent = query_nodes(
            grid,
            lambda n: Message(RecordDict({CONFIG: ConfigRecord({ROUND: 0})}), dst_node_id=n,
                              message_type=MessageType.QUERY),
            handle, lambda: bool(self.num_tasks) and len(seen) == self.num_tasks, time.time() + timeout)
        if not self.num_tasks:
            raise ConfigError(f"run-config key '{self.key_prefix}num-tasks' is 0 (one task per node) but no "
                              f"node reported its 'num-partitions' within {timeout:.0f}s: set "
                              f"{self.key_prefix}num-tasks")
        missing = self.num_tasks - len(seen)
        if missing:
            log(WARNING, "%d of %d tasks are hosted by no responding node%s", missing, self.num_tasks,
                f" (nodes {silent[:10]} never answered)" if silent else "")

    def _check_reported_model(self, rec: ConfigRecord, node: int) -> None:
        """A drop-in node's report against ``num-tasks`` and ``initial_arrays``
        (raises :class:`ConfigError` naming the mismatch; nothing is spent yet)."""
        count = rec.get(NUM_PARAMS)
        if count is not None and self.num_params is not None and int(count) != self.num_params:
            raise ConfigError(
                f"the ClientApp's model (node {node}) has {int(count)} parameters, initial_arrays hold "
                f"{self.num_params} values: pass the ClientApp's model, e.g. ArrayRecord(Net().state_dict())"
                + ("; buffers such as BatchNorm statistics are not part of w_k: pass only parameters"
                   if self.layout and any("running" in n or "num_batches" in n for n, _, _ in self.layout) else ""))
        names, shapes = rec.get(PARAM_NAMES), rec.get(PARAM_SHAPES)
        if self.layout is not None and names is not None and shapes is not None and len(self.layout) > 1:
            given = [(n, "x".join(str(d) for d in shape) or "scalar") for n, shape, _ in self.layout]
            reported = list(zip(names, shapes, strict=False))
            if given != reported:
                diff = next(((g, r) for g, r in zip(given, reported, strict=False) if g != r), (given, reported))
                raise ConfigError(f"initial_arrays do not match the ClientApp's model (node {node}), in "
                                  f"named_parameters order: {diff[0]} here, {diff[1]} in the ClientApp")
        parts = rec.get(NUM_PARTITIONS)
        if parts is not None:
            if not self.num_tasks:
                if int(parts) < 2:
                    raise ConfigError(f"node {node} reports num-partitions={parts}: DP-MTL needs >= 2 tasks")
                self._plan(int(parts))
            elif int(parts) != self.num_tasks:
                raise ConfigError(f"run-config key '{self.key_prefix}num-tasks'={self.num_tasks}, but node "
                                  f"{node} is one of num-partitions={parts} nodes (one task per node): set "
                                  f"{self.key_prefix}num-tasks={parts}, or 0 to take it from the nodes")

    # ------------------------------------------------------------- rounds
    def _instruction_config(self, config: ConfigRecord, server_round: int, **ours: object) -> ConfigRecord:
        """The user's ``train_config`` / ``evaluate_config`` plus the round's keys."""
        clash = sorted(set(config.keys()) & {ROUND, TASKS})
        if clash:
            raise ConfigError(f"train_config / evaluate_config keys {clash} are DP-MTL's own; rename them")
        return ConfigRecord({**dict(config), ROUND: server_round, **ours})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Charge the round's noisy mean (unless it was charged before a crash and
        its mean never computed: that charge covers its rerun), then Poisson-sample
        tasks; each node gets ``w~``, its own sampled ids and ``config`` (``train_config``)."""
        self._instruction_config(config, server_round)  # a clash fails before the charge
        if self.cfg.private and server_round not in self._charged:
            event = self.release.event()
            if self.ledger.would_exceed({SERVER_SCOPE: event}):
                raise PrivacyBudgetExhausted(f"round {server_round} would exceed epsilon "
                                             f"{self.cfg.target_epsilon}")
            self.ledger.record_round(server_round, {SERVER_SCOPE: event}, note="noisy mean")
            self._charged.add(server_round)
        out = []
        for node, ids in self.node_tasks.items():
            chosen = self.server.sample(ids)
            if chosen:
                content = RecordDict({CONFIG: self._instruction_config(config, server_round, **{TASKS: chosen}),
                                      MEAN: arrays})
                out.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        self._asked = {m.metadata.dst_node_id: set(m.content[CONFIG][TASKS]) for m in out}
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        asked: dict[int, set[int]] | None = None) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Sum the valid, in-ball task models; release the noisy mean."""
        total = np.zeros(self.num_params)
        got: set[int] = set()
        for reply in replies:
            if reply.has_error():
                self._drop(reply, f"error reply: {reply.error.reason}")
                continue
            if MODELS not in reply.content:
                self._drop(reply, "missing 'models' record")
                continue
            allowed = (asked if asked is not None else self._asked).get(reply.metadata.src_node_id)
            for key, arr in reply.content[MODELS].items():
                k = parse_task_key(key)
                w = arr.numpy()
                reason = None
                if k is None or (allowed is not None and k not in allowed) or k in got:
                    reason = f"model '{key}' was not asked for (or sent twice)"
                elif w.shape != (self.num_params,) or not np.all(np.isfinite(w)):
                    reason = f"model '{key}' has shape {w.shape} (expected ({self.num_params},)) or non-finite values"
                elif float(np.linalg.norm(w)) > self.cfg.radius * (1 + BALL_SLACK):
                    reason = f"model '{key}' has norm {np.linalg.norm(w):.4g} > radius {self.cfg.radius}"
                if reason:
                    self._drop(reply, reason)
                    continue
                got.add(k)
                total += w
        self.mean = self.server.noisy_mean(total)
        # The round is done once its mean exists: saved (by the loop) before it is sent,
        # so a restart continues after it and never releases a second, uncharged mean.
        self.history.append({"round": server_round, "tasks": len(got), "epsilon": self.epsilon_spent()})
        return self._mean_record(), MetricRecord({"tasks": len(got)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return [Message(RecordDict({CONFIG: self._instruction_config(config, server_round), MEAN: arrays}),
                        dst_node_id=node, message_type=MessageType.EVALUATE) for node in self.node_tasks]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The numpy app's summed metrics; a user's app's metrics (``num-examples``
        and whatever its ``test`` reports) averaged weighted by ``num-examples``."""
        sums = {"excess": 0.0, "loss": 0.0, "accuracy": 0.0}
        counts = {"excess": 0, "loss": 0, "accuracy": 0}
        weighted: dict[str, float] = {}
        examples, tasks = 0, 0
        for reply in replies:
            if reply.has_error() or METRICS not in reply.content:
                self._drop(reply, "evaluation reply without metrics"
                           + (f": {reply.error.reason}" if reply.has_error() else ""))
                continue
            rec = reply.content[METRICS]
            if self.layout is not None and NUM_EXAMPLES not in rec:
                self._drop(reply, f"evaluation metrics without '{NUM_EXAMPLES}' (the weight of the task's "
                           "metrics): add it to the evaluate reply's MetricRecord")
                continue
            if NUM_EXAMPLES in rec:
                n = rec[NUM_EXAMPLES]
                if not isinstance(n, int | float) or not n >= 0:
                    self._drop(reply, f"evaluation reply with num-examples {n!r}")
                    continue
                examples, tasks = examples + n, tasks + 1
                for key, value in rec.items():
                    if key != NUM_EXAMPLES and isinstance(value, int | float):
                        weighted[key] = weighted.get(key, 0.0) + float(n) * float(value)
                continue
            for key in sums:
                n = int(rec.get(f"{key}-count", 0))
                if n > 0:
                    sums[key] += float(rec[f"{key}-sum"])
                    counts[key] += n
        if tasks:
            return MetricRecord({k: (v / examples if examples else float("nan")) for k, v in weighted.items()}
                                | {"tasks": tasks, NUM_EXAMPLES: examples})
        if not any(counts.values()):
            return None
        return MetricRecord({k: (sums[k] / counts[k] if counts[k] else float("nan")) for k in sums}
                            | {"tasks": counts["loss"]})

    def summary(self) -> None:
        """Log the configuration, the noise and both calibrations."""
        report = self.calibration_report()
        log(INFO, "DP-MTL: %d tasks, %d parameters, lambda=%g, B=%g, T=%d, E=%d, q=%g | %s | "
            "calibration %s: sigma=%.4g (noise multiplier %.3f; paper %.4g, tight %.4g) | unit: one task "
            "(%s) | target epsilon %s at delta %.3g", self.num_tasks, self.num_params, self.cfg.lam,
            self.cfg.radius, self.cfg.rounds, self.cfg.local_steps, self.cfg.fraction_train,
            "private" if self.cfg.private else "NON-PRIVATE", self.cfg.calibration, self.release.sigma,
            self.release.noise_multiplier, report.get("paper_sigma", 0.0), report.get("tight_sigma", 0.0),
            self.cfg.neighbouring, self.cfg.target_epsilon, self.cfg.delta)
        health.warn_if_noise_dominates(self.release, self.num_params, self.cfg, self.key_prefix)

    # ---------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Resume, discover the tasks, save before round 1. ``num_rounds`` must equal
        ``rounds`` (T, the horizon sigma is calibrated for). ``initial_arrays`` is the
        public initial mean ``w~^0`` (default 0): one array of ``num_params`` values,
        or a user's model (``ArrayRecord(Net().state_dict())``), flattened in its
        order, whose size is then ``num_params`` and which every node's reported
        model must match. Anything wrong fails here, before any privacy is spent."""
        if num_rounds is not None and num_rounds != self.cfg.rounds:
            raise ConfigError(f"start(num_rounds={num_rounds}) differs from run-config "
                              f"'{self.key_prefix}rounds'={self.cfg.rounds}, the horizon sigma is "
                              f"calibrated for: set {self.key_prefix}rounds={num_rounds}")
        self._t0 = time.time()
        initial = self._initial_mean(initial_arrays)
        first = self._maybe_resume()
        if initial is not None and first == 1:
            self.mean = initial
        if self.mean.shape != (self.num_params,):
            raise ConfigError(f"the resumed mean has {self.mean.size} values, the model {self.num_params}")
        summarized = self.release is not None and self.layout is None
        if summarized:
            self.summary()
        self.discover(grid, timeout)
        if not summarized:
            self.summary()  # after set-up: the number of tasks may have come from the nodes
        self._charged = {int(r["round"]) for r in self.ledger.rounds}
        if first == 1 and not self.history:
            self.save(self._mean_record(), "running")  # resumable from round 1 on
        return self._mean_record(), range(first, self.cfg.rounds + 1)

    def _initial_mean(self, initial_arrays: ArrayRecord | None) -> np.ndarray | None:
        if initial_arrays is None:
            if self.num_params is None:
                raise ConfigError("DPMeanRegularizedMTL needs the model: start(grid, initial_arrays="
                                  "ArrayRecord(Net().state_dict()), ...) with the ClientApp's model")
            return None
        names = list(initial_arrays.keys())
        values = [np.asarray(initial_arrays[n].numpy()) for n in names]
        flat = np.concatenate([v.ravel() for v in values]).astype(np.float64) if values else np.zeros(0)
        if len(values) == 1 and values[0].shape == (self.num_params,):
            return flat  # the initial mean itself (numpy app)
        if self.num_params is not None and flat.size != self.num_params:
            raise ConfigError(f"initial_arrays hold {flat.size} values, not {self.num_params} (num_params)")
        if not flat.size or not np.all(np.isfinite(flat)):
            raise ConfigError("initial_arrays are empty or non-finite")
        self.layout = [(n, tuple(v.shape), str(v.dtype)) for n, v in zip(names, values, strict=True)]
        self.num_params = int(flat.size)
        return flat

    def model_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """A mean record (as broadcast, and in ``Result.arrays``) in the layout of the
        user's ``initial_arrays`` (names, shapes, dtypes), e.g. for
        ``net.load_state_dict(strategy.model_arrays(result.arrays).to_torch_state_dict())``."""
        flat = arrays[MEAN].numpy().ravel()
        if self.layout is None:
            return arrays
        out, offset = {}, 0
        for name, shape, dtype in self.layout:
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = Array(np.ascontiguousarray(flat[offset: offset + n].reshape(shape).astype(dtype)))
            offset += n
        return ArrayRecord(out)

    def evaluate_fn_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """``evaluate_fn`` gets the noisy mean ``w~`` as the user's model (:meth:`model_arrays`)."""
        return self.model_arrays(arrays)

    def result_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """``Result.arrays``: the noisy mean ``w~`` as the user's model, said in one log line."""
        if self.layout is not None:
            log(INFO, "Result arrays: the noisy mean of the tasks' models (every parameter); each task's own "
                "model stays on its node (MTLClient.load)")
        return self.evaluate_fn_arrays(arrays)

    def save(self, arrays: ArrayRecord, status: str) -> None:
        failed = health.ended_on_skipped_round(self.history, status)  # its last mean is noise only
        self.status = "failed" if failed else status
        self._save(time.time() - self._t0)
        if failed:
            raise _skipped_run_failed(self.history, self.epsilon_spent(), self.failure_reasons())

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self.cfg.private else math.inf

    def failure_reasons(self) -> str:
        return "; ".join(self.dropped[-3:]) or "no reply arrived"

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        row = self.history[-1]  # appended when the mean was computed (see aggregate_train)
        if eval_metrics is not None and NUM_EXAMPLES in eval_metrics:  # a user's app: its own metrics
            row["task_metrics"] = {k: float(v) for k, v in eval_metrics.items()
                                   if k not in ("tasks", NUM_EXAMPLES)}
            row["evaluated_tasks"] = int(eval_metrics["tasks"])
        elif eval_metrics is not None:
            row.update({k: float(eval_metrics[k]) for k in ("excess", "loss", "accuracy")})
        row["skipped"] = bool(self._asked) and row["tasks"] == 0
        return row

    def round_line(self, row: dict) -> str:
        if "task_metrics" in row:
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in row["task_metrics"].items())
            return (f"[round {row['round']}/{self.cfg.rounds}] personalized models (mean over "
                    f"{row['evaluated_tasks']} tasks, weighted by num-examples): {metrics} | {health.tasks_sent(row)} "
                    f"| epsilon {row['epsilon']:.4f} (target {self.cfg.target_epsilon}) at delta "
                    f"{self.cfg.delta:.3g}")
        return (f"[round {row['round']}/{self.cfg.rounds}] personalized: accuracy "
                f"{row.get('accuracy', math.nan):.4f}, test loss {row.get('loss', math.nan):.4f}, excess loss "
                f"{row.get('excess', math.nan):.4g} | {health.tasks_sent(row)} | epsilon {row['epsilon']:.4f} "
                f"(target {self.cfg.target_epsilon}) at delta {self.cfg.delta:.3g}")

    def _maybe_resume(self) -> int:
        if not (self.checkpoint and self.resume and self.checkpoint.resumable()):
            return 1
        arrays, ledger, history, _ = self.checkpoint.load({MEAN: None})
        self.mean = arrays[MEAN].numpy()
        self.ledger, self.history = ledger, history
        done = int(history[-1]["round"]) if history else 0
        log(INFO, "Resuming after round %d: epsilon %.4f already spent", done, ledger.epsilon())
        return done + 1

    def results(self, wall_seconds: float = float("nan")) -> dict:
        last = self.history[-1] if self.history else {}
        exact = (self.release.epsilon(self.cfg.rounds, self.cfg.delta, self.cfg.accountant, exact=True)
                 if self.cfg.private else math.inf)
        return {"method": "dp-mtl" if self.cfg.private else "mtl-nonprivate",
                "final": (last.get("task_metrics", {}) if self.layout is not None
                          else {k: last.get(k) for k in ("accuracy", "loss", "excess")}),
                "sigma": self.release.sigma, "sensitivity": self.release.sensitivity,
                "exact_epsilon_of_noise": exact, "calibration": self.calibration_report(),
                "dropped": self.dropped, "wall_seconds": wall_seconds, "session": "dp-mtl"}

    def _save(self, wall_seconds: float) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint.save(self._mean_record(), self.ledger, self.history,
                             self.release.noise_multiplier, self.status, self.results(wall_seconds))
        if self.status != "running":
            log(INFO, "Finished (%s): results in %s", self.status, self.checkpoint.directory)


def _skipped_run_failed(history: list[dict], epsilon: float, reasons: str) -> RunFailed:
    """The failure of a run whose final round(s) had no task train."""
    n = health.trailing_skipped(history)
    last = history[-1]["round"] if history else 0
    return RunFailed(
        f"run failed: its final round{'s' if n > 1 else ''} ({n} up to round {last}) had no task train "
        f"(0 tasks sent: every task's reply dropped, refused or diverged), so the last released mean is "
        f"noise only; epsilon {epsilon:.4f} spent and saved. Last round's reasons: {reasons}")


__all__ = ["DPMeanRegularizedMTL", "parse_task_key", "task_key"]
