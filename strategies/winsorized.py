"""DifferentialPrivacyWinsorizedMean: central user-level DP aggregation of client
updates by the winsorized mean estimator (Levy et al., Algorithms 1-3), as a
Flower strategy wrapper (cf. Flower's ``DifferentialPrivacyServerSideFixedClipping``).

Privacy guarantee: each round's aggregate update is user-level DP where the user
is one client (its update is the client's "average"; replace-one neighbouring
with the number of sampled clients ``n`` public). A round costs the estimator's
two releases (:meth:`flwr_jdp.winsorized.estimator.WinsorizedMean.events`): the
noisy per-coordinate histogram that locates the centre (L2 sensitivity
``sqrt(2 d')``) and the winsorized mean (L2 sensitivity ``2 r sqrt(d') / n``, with
``r = 2.5 tau_inf``). Both are charged to the ledger's ``server`` scope before
the clients are asked; a round that would exceed the budget raises Flower's
``PrivacyBudgetExhausted``.

Where the noise goes: Flower's fixed clipping adds noise ``z C / n`` per
coordinate for clipping norm ``C`` around zero; this wrapper adds noise that
scales with the concentration radius ``tau`` of the updates *around their
centre* (after a random rotation, ``tau_inf ~ tau sqrt(2 log(2 n d'/beta) / d')``
per coordinate), so it wins when clients' updates agree more than they are large.

The trust model is central (a trusted aggregator sees each client's update).
Replies that are errors, carry no single ArrayRecord, or whose arrays do not
match the broadcast model are dropped with a logged reason; a round with fewer
valid replies than ``num_sampled_clients`` is skipped (the model is kept; its
charge stands, conservatively).
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Strategy

from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.mechanisms import numpy_rng
from flwr_jdp.strategies.accounted import AccountedStrategy
from flwr_jdp.winsorized.estimator import WinsorizedMean


class DifferentialPrivacyWinsorizedMean(AccountedStrategy):
    """Wrap ``strategy``: its train aggregate becomes the current model plus the
    winsorized private mean of the clients' updates."""

    def __init__(self, strategy: Strategy, estimator: WinsorizedMean, num_sampled_clients: int, *,
                 ledger: PrivacyLedger | None = None, ledger_path: str | Path | None = None,
                 noise_seed: int = -1) -> None:
        super().__init__()
        if num_sampled_clients <= 0:
            raise ValueError(f"num_sampled_clients must be > 0, got {num_sampled_clients}")
        self.strategy, self.estimator = strategy, estimator
        self.num_sampled_clients = num_sampled_clients
        self.ledger = ledger
        #: Where the ledger is written after each charge, before the round's
        #: messages are returned to Flower's loop (charge, save, release).
        self.ledger_path = Path(ledger_path) if ledger_path else None
        if self.ledger_path is not None and self.ledger is None:
            raise ValueError("ledger_path needs a ledger")
        self.rng = numpy_rng(None if noise_seed < 0 else noise_seed)
        self.current_arrays = ArrayRecord()
        self.dropped: list[str] = []
        self.history: list[dict] = []
        self.status = "running"
        self._valid = 0

    def __repr__(self) -> str:
        return "Differential Privacy Strategy Wrapper (Winsorized User-Level Mean)"

    def summary(self) -> None:
        e = self.estimator
        log(INFO, "\t├──> DP settings (winsorized mean, user = client, replace-one, n = %d):",
            self.num_sampled_clients)
        log(INFO, "\t│\t├── bound B %.4g, concentration radius tau %.4g, kind %s, rotate %s", e.bound,
            e.tau, e.kind, e.rotate)
        log(INFO, "\t│\t└── noise multipliers: range %.4g, mean %.4g", e.range_noise, e.mean_noise)
        self.strategy.summary()

    # ------------------------------------------------------------- train
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate; remember the broadcast model; charge the round's releases."""
        self.current_arrays = arrays
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if self.ledger is not None and messages:
            planned = {SERVER_SCOPE: self.estimator.event()}
            if self.ledger.would_exceed(planned):
                raise PrivacyBudgetExhausted(
                    f"round {server_round} would exceed epsilon {self.ledger.budget} "
                    f"(spent {self.ledger.epsilon():.4f} at delta {self.ledger.delta})")
            self.ledger.record_round(server_round, planned, note="winsorized mean (range + mean)")
            if self.ledger_path is not None:
                self.ledger.save(self.ledger_path)
        return messages

    def _drop(self, reply: Message, reason: str) -> None:
        msg = f"node {reply.metadata.src_node_id}: {reason}"
        self.dropped.append(msg)
        log(WARNING, "Dropped reply from %s", msg)

    def _update(self, reply: Message, keys: list[str], current: list[np.ndarray]) -> np.ndarray | None:
        if reply.has_error():
            return self._drop(reply, f"error reply: {reply.error.reason}")
        records = list(reply.content.array_records.values())
        if len(records) != 1:
            return self._drop(reply, f"expected one ArrayRecord, got {len(records)}")
        rec = records[0]
        if list(rec.keys()) != keys:
            return self._drop(reply, "array names differ from the broadcast model")
        parts = []
        for key, cur in zip(keys, current):
            arr = rec[key].numpy()
            if arr.shape != cur.shape or not np.all(np.isfinite(arr)):
                return self._drop(reply, f"array '{key}' has shape {arr.shape} (expected {cur.shape}) "
                                  "or non-finite values")
            parts.append((arr.astype(np.float64) - cur).ravel())
        return np.concatenate(parts)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Current model + winsorized private mean of the clients' updates."""
        replies = list(replies)
        keys = list(self.current_arrays.keys())
        current = [self.current_arrays[k].numpy().astype(np.float64) for k in keys]
        valid, updates = [], []
        for reply in replies:
            u = self._update(reply, keys, current)
            if u is not None:
                valid.append(reply)
                updates.append(u)
        self._valid = len(updates)
        if len(updates) != self.num_sampled_clients:
            log(WARNING, "Round %d: %d valid updates, %d expected (n is public): round skipped",
                server_round, len(updates), self.num_sampled_clients)
            return None, None
        stack = np.stack(updates)
        mean = np.asarray(self.estimator.estimate(stack, self.rng)).ravel()
        out, start = {}, 0
        for key, cur in zip(keys, current):
            size = cur.size
            dtype = self.current_arrays[key].numpy().dtype
            out[key] = Array((cur + mean[start:start + size].reshape(cur.shape)).astype(dtype))
            start += size
        _, metrics = self.strategy.aggregate_train(server_round, valid)  # metrics only
        log(INFO, "aggregate_train: winsorized private mean of %d updates (tau %.4g)",
            len(updates), self.estimator.tau)  # nothing data-dependent but the DP mean
        return ArrayRecord(out), metrics

    # ---------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """``initial_arrays`` is the initial model (required, as in Flower);
        ``num_rounds`` (default 3) the rounds to run, each charged before it runs."""
        if initial_arrays is None:
            raise ValueError("start(initial_arrays=...) is required: the initial model")
        self.summary()
        return initial_arrays, range(1, int(num_rounds or 3) + 1)

    def save(self, arrays: ArrayRecord, status: str) -> None:
        self.status = status
        if self.ledger is not None and self.ledger_path is not None:
            self.ledger.save(self.ledger_path)

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self.ledger is not None else float("nan")

    def failure_reasons(self) -> str:
        return "; ".join(self.dropped[-3:]) or f"fewer than {self.num_sampled_clients} valid updates"

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        row = {"round": server_round, "valid_updates": self._valid, "epsilon": self.epsilon_spent(),
               "skipped": self._valid != self.num_sampled_clients}
        if eval_metrics is not None:
            row["evaluate"] = {k: float(v) for k, v in eval_metrics.items() if isinstance(v, int | float)}
        return row

    def round_line(self, row: dict) -> str:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in row.get("evaluate", {}).items())
        return (f"[round {row['round']}] winsorized mean of {row['valid_updates']} updates"
                f"{' (skipped)' if row['skipped'] else ''} | {shown or 'no evaluation'} | "
                f"epsilon {row['epsilon']:.4f}")

    # ---------------------------------------------------------- evaluate
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)


__all__ = ["DifferentialPrivacyWinsorizedMean"]
