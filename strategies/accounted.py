"""The one accounted round loop every flwr-jdp strategy runs through Flower's ``start()``.

Each round: ``configure_train`` plans the round and charges its privacy events to
the ledger (or raises :class:`~flwr.serverapp.exception.PrivacyBudgetExhausted`
when they would exceed the budget); the strategy saves its ledger and checkpoint
(**charge, save**); only then do the round's messages leave the server
(**release**); ``aggregate_train`` validates, drops bad replies with a logged
reason and aggregates; the new state is saved before it is sent to anyone;
evaluation runs (``configure_evaluate`` / ``aggregate_evaluate``, and the user's
``evaluate_fn`` on the global model); one line per round is logged.

A run ends ``completed``, ``budget-exhausted`` (the next round would exceed the
budget: model and ledger saved), or ``failed`` (``max_skipped_rounds`` rounds in a
row without enough valid replies: saved, then an exception so that Flower marks
the run ``finished:failed``). A strategy restarted on the same results folder
resumes where its checkpoint says.

A strategy implements Flower's four ``configure_*`` / ``aggregate_*`` methods and
the hooks below; it does not override :meth:`start`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Result, Strategy

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class RunFailed(RuntimeError):
    """A run that could not make progress (saved as ``status: failed``)."""


class AccountedStrategy(Strategy):
    """Base of every flwr-jdp strategy: the accounted round loop (:meth:`start`)."""

    #: Rounds in a row without enough valid replies after which the run fails.
    max_skipped_rounds: int = 3

    # ------------------------------------------------------------------ hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Set-up before any release (discovery, calibration, resume): the global
        arrays to start from and the rounds still to run. Anything the strategy
        cannot honour fails here, before any privacy is spent."""
        raise NotImplementedError

    def save(self, arrays: ArrayRecord, status: str) -> None:
        """Write the ledger first, then the checkpoint and results."""
        raise NotImplementedError

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        """The round's entry of the run's history (``skipped``: no valid update)."""
        raise NotImplementedError

    def round_line(self, row: dict) -> str:
        """The one line logged per round (accuracy and epsilon spent)."""
        raise NotImplementedError

    def after_aggregate(self, server_round: int, arrays: ArrayRecord) -> None:  # noqa: B027
        """Called with each new global model (post-processing state, e.g. a moving average)."""

    def evaluated_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The global model owners are evaluated with (default: ``arrays``)."""
        return arrays

    def evaluate_fn_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """What the user's ``evaluate_fn`` receives (default: the global model)."""
        return arrays

    def result_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """``Result.arrays``: the model ``evaluate_fn`` sees, so that the user's model
        class loads it; parameters the server never holds (an owner's personal layers)
        are at their public initial values, said in one log line."""
        full = self.evaluate_fn_arrays(arrays)
        public = [k for k in full.keys() if k not in arrays.keys()]
        if public:
            log(INFO, "Result arrays: the shared layers as trained; %s at their public initial values (each "
                "owner's own stay on its node: its evaluate handler loads them)", ", ".join(public[:4]))
        return full

    def cannot_progress(self) -> bool:
        """True when the round just skipped shows that later rounds would be skipped
        too (e.g. every node's code breaks a rule it will break again): the run fails
        now instead of spending the rest of its budget."""
        return False

    def cannot_progress_reason(self) -> str:
        """Why later rounds would be skipped too (for the failure message, when
        :meth:`cannot_progress` ended the run)."""
        return "every reply was refused for a reason that holds in every later round"

    def failure_reasons(self) -> str:
        """Why the last rounds had too few valid replies (for the failure message)."""
        return "no reply arrived"

    def epsilon_spent(self) -> float:
        return float("nan")

    def exchange_train(self, server_round: int, messages: list[Message], grid: Grid,
                       timeout: float) -> Iterable[Message]:
        """Send the round's train messages and collect the replies (a strategy whose
        round is a multi-stage protocol, such as secure aggregation, runs it here)."""
        return grid.send_and_receive(messages, timeout=timeout)

    # -------------------------------------------------------------- the loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = 3600.0,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run the strategy's rounds: charge, save, release, aggregate, save,
        evaluate. The arguments mean what they mean in Flower's ``Strategy.start``;
        each strategy documents how it honours them (``num_rounds``: the horizon
        its noise is calibrated for)."""
        timeout = float(timeout or 3600.0)
        arrays, rounds = self.prepare(grid, initial_arrays, num_rounds, timeout)
        result = Result()
        result.arrays = arrays
        status, skipped, hopeless = "completed", 0, False
        if evaluate_fn is not None and rounds.start <= 1:
            self._server_evaluate(evaluate_fn, 0, self.evaluate_fn_arrays(self.evaluated_arrays(arrays)), result)
        for rnd in rounds:
            t_round = time.time()
            try:
                messages = list(self.configure_train(rnd, arrays, train_config or ConfigRecord(), grid))
            except PrivacyBudgetExhausted as err:
                log(WARNING, "Stopping before round %d: privacy budget exhausted (%s)", rnd, err)
                status = "budget-exhausted"
                break
            # Charge, save, release: the round's charge is on disk before any of its
            # messages leaves the server, so a crash from here on cannot un-charge it.
            self.save(arrays, "running")
            replies = self.exchange_train(rnd, messages, grid, timeout)
            new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                arrays = new_arrays
                self.after_aggregate(rnd, arrays)
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            self.save(arrays, "running")  # the new model is on disk before anyone receives it
            evaluated = self.evaluated_arrays(arrays)
            eval_metrics = self.aggregate_evaluate(rnd, grid.send_and_receive(
                self.configure_evaluate(rnd, evaluated, evaluate_config or ConfigRecord(), grid),
                timeout=timeout))
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = eval_metrics
            row = self.round_row(rnd, train_metrics, eval_metrics)
            if evaluate_fn is not None:
                server = self._server_evaluate(evaluate_fn, rnd, self.evaluate_fn_arrays(evaluated), result)
                if server is not None:
                    row["server_metrics"] = server
            row["seconds"] = time.time() - t_round
            if not self.history or self.history[-1] is not row:  # a strategy may append it earlier
                self.history.append(row)
            log(INFO, "%s | %.1fs", self.round_line(row), row["seconds"])
            result.arrays = arrays
            skipped = skipped + 1 if row.get("skipped") else 0
            hopeless = bool(row.get("skipped")) and skipped < self.max_skipped_rounds and self.cannot_progress()
            if skipped >= self.max_skipped_rounds or hopeless:
                status = "failed"
                break
            self.save(arrays, "running")
        self.save(arrays, status)
        self.status = status
        result.arrays = self.result_arrays(arrays)
        if status == "failed":
            why = (f"round {rnd} had too few valid replies and so would every later round "
                   f"({self.cannot_progress_reason()}): the run ends now instead of after "
                   f"max-skipped-rounds={self.max_skipped_rounds} skipped rounds"
                   if hopeless else
                   f"{skipped} rounds in a row (max-skipped-rounds={self.max_skipped_rounds}) had too few valid "
                   "replies")
            raise RunFailed(f"run failed: {why}; epsilon {self.epsilon_spent():.4f} spent and saved. "
                            f"Last round's reasons: {self.failure_reasons()}")
        return result

    @staticmethod
    def _server_evaluate(evaluate_fn: EvaluateFn, server_round: int, arrays: ArrayRecord,
                         result: Result) -> dict | None:
        """The user's ``evaluate_fn`` on the global model (no privacy cost: it is DP)."""
        metrics = evaluate_fn(server_round, arrays)
        if metrics is None:
            return None
        result.evaluate_metrics_serverapp[server_round] = metrics
        out = {k: float(v) if isinstance(v, int | float) else v for k, v in dict(metrics).items()}
        log(INFO, "[round %d] server-side evaluation: %s", server_round,
            ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()))
        return out
