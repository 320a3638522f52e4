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
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted

from flwr_jdp.mtl.algorithm import MeanServer, MTLConfig
from flwr_jdp.mtl.noise import MeanRelease, paper_sigma, tight_sigma
from flwr_jdp.mtl.protocol import (  # noqa: E402 - the keys, re-exported
    CONFIG,
    MEAN,
    METRICS,
    MODELS,
    ROUND,
    SETUP,
    TASKS,
    parse_task_key,
    task_key,
)
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.mechanisms import numpy_rng

from .accounted import AccountedStrategy
from .checkpoint import Checkpoint
from .node_query import query_nodes

#: Relative slack on the ball check (float32/float64 round-off of a projected model).
BALL_SLACK = 1e-6


class DPMeanRegularizedMTL(AccountedStrategy):
    """Algorithm 1: broadcast ``w~``, tasks take projected steps, release a noisy mean."""

    def __init__(self, num_tasks: int, num_params: int, cfg: MTLConfig, results_dir: str | Path = "",
                 noise_seed: int = -1, run_config: dict | None = None, resume: bool = True) -> None:
        self.num_tasks, self.num_params, self.cfg = num_tasks, num_params, cfg
        if cfg.private:
            self.release = cfg.release(num_tasks)
        else:
            self.release = MeanRelease(cfg.radius, num_tasks, cfg.fraction_train, 0.0, cfg.neighbouring)
        self.ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant, unit="owner",
                                    budget=cfg.target_epsilon if cfg.private else None,
                                    neighbouring=cfg.neighbouring)
        self.server = MeanServer(self.release, numpy_rng(None if noise_seed < 0 else noise_seed))
        self.mean = np.zeros(num_params)
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
            if reply.has_error() or SETUP not in reply.content:
                self._drop(reply, "setup reply without a 'setup' record")
                return
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
            handle, lambda: len(seen) == self.num_tasks, time.time() + timeout)
        missing = self.num_tasks - len(seen)
        if missing:
            log(WARNING, "%d of %d tasks are hosted by no responding node%s", missing, self.num_tasks,
                f" (nodes {silent[:10]} never answered)" if silent else "")

    # ------------------------------------------------------------- rounds
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Charge the round's noisy mean (unless it was charged before a crash and
        its mean never computed: that charge covers its rerun), then Poisson-sample
        tasks; each node gets ``w~`` and its own sampled ids."""
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
                content = RecordDict({CONFIG: ConfigRecord({ROUND: server_round, TASKS: chosen}),
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
        return [Message(RecordDict({CONFIG: ConfigRecord({ROUND: server_round}), MEAN: arrays}),
                        dst_node_id=node, message_type=MessageType.EVALUATE) for node in self.node_tasks]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        sums = {"excess": 0.0, "loss": 0.0, "accuracy": 0.0}
        counts = {"excess": 0, "loss": 0, "accuracy": 0}
        for reply in replies:
            if reply.has_error() or METRICS not in reply.content:
                self._drop(reply, "evaluation reply without metrics")
                continue
            rec = reply.content[METRICS]
            for key in sums:
                n = int(rec.get(f"{key}-count", 0))
                if n > 0:
                    sums[key] += float(rec[f"{key}-sum"])
                    counts[key] += n
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

    # ---------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Resume, discover the tasks, save before round 1. ``num_rounds`` must equal
        ``rounds`` (T, the horizon sigma is calibrated for); ``initial_arrays``, one
        array of ``num_params`` values, is the public initial mean (default 0)."""
        if num_rounds is not None and num_rounds != self.cfg.rounds:
            raise ValueError(f"start(num_rounds={num_rounds}) differs from run-config 'rounds'="
                             f"{self.cfg.rounds}, the horizon sigma is calibrated for")
        self._t0 = time.time()
        first = self._maybe_resume()
        if initial_arrays is not None and first == 1:
            values = initial_arrays.to_numpy_ndarrays()
            if len(values) != 1 or values[0].shape != (self.num_params,):
                raise ValueError(f"initial_arrays must hold one array of {self.num_params} values "
                                 "(the initial mean)")
            self.mean = np.asarray(values[0], dtype=np.float64)
        self.summary()
        self.discover(grid, timeout)
        self._charged = {int(r["round"]) for r in self.ledger.rounds}
        if first == 1 and not self.history:
            self.save(self._mean_record(), "running")  # resumable from round 1 on
        return self._mean_record(), range(first, self.cfg.rounds + 1)

    def save(self, arrays: ArrayRecord, status: str) -> None:
        self.status = status
        self._save(time.time() - self._t0)

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self.cfg.private else math.inf

    def failure_reasons(self) -> str:
        return "; ".join(self.dropped[-3:]) or "no reply arrived"

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        row = self.history[-1]  # appended when the mean was computed (see aggregate_train)
        row.update({k: float(eval_metrics[k]) for k in ("excess", "loss", "accuracy")} if eval_metrics else {})
        row["skipped"] = bool(self._asked) and row["tasks"] == 0
        return row

    def round_line(self, row: dict) -> str:
        return (f"[round {row['round']}/{self.cfg.rounds}] personalized: accuracy "
                f"{row.get('accuracy', math.nan):.4f}, test loss {row.get('loss', math.nan):.4f}, excess loss "
                f"{row.get('excess', math.nan):.4g} | {row['tasks']} tasks sent | epsilon {row['epsilon']:.4f} "
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
                "final": {k: last.get(k) for k in ("accuracy", "loss", "excess")},
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


__all__ = ["DPMeanRegularizedMTL", "parse_task_key", "task_key"]
