"""Evaluation and results of :class:`~flwr_jdp.strategies.JointDP`: the owners' own
evaluation of their personalized models, the round lines and rows, and what is
saved (model, ledger, ``results.json``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.validation import validate_replies


class Results:
    """Evaluation, the round's row and line, and the saved results.

    A part of :class:`~flwr_jdp.strategies.JointDP` (which holds the state it uses).
    """

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Ask every owner (a ``fraction_evaluate`` of them, at least one) to evaluate
        its own model on its own test split."""
        self._requested = {}
        owners = sorted(self.owner_node)
        if self.fraction_evaluate < 1.0:
            count = max(1, int(len(owners) * self.fraction_evaluate)) if self.fraction_evaluate > 0 else 0
            owners = sorted(int(o) for o in self.evaluate_rng.choice(owners, size=count, replace=False))
        for o in owners:
            self._requested.setdefault(self.owner_node[o], []).append(o)
        messages = []
        for node, owners in self._requested.items():
            rec = ConfigRecord(dict(config))
            rec[protocol.ROUND] = server_round
            rec[protocol.OWNERS] = owners
            rec[protocol.SESSION] = self.session
            content = RecordDict({protocol.SHARED: arrays, protocol.CONFIG: rec})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Mean over owners of each owner's personalized test accuracy."""
        valid = validate_replies(list(replies), self._requested, None, required_metrics=(protocol.NUM_EXAMPLES,))
        for reason in valid.dropped.values():
            log(WARNING, "round %d: dropped evaluation reply: %s", server_round, reason)
        metrics = _weighted_metrics(valid.metrics)
        if metrics is not None and self.evaluate_metrics_aggr_fn is not None:  # the user's own, as FedAvg calls it
            contents = [RecordDict({protocol.METRICS: MetricRecord(m)}) for m in valid.metrics.values()]
            metrics = MetricRecord({**metrics, **self.evaluate_metrics_aggr_fn(contents, protocol.NUM_EXAMPLES)})
        if metrics is not None and "accuracy" not in metrics and not self._warned_accuracy:
            self._warned_accuracy = True
            names = sorted(k for k in metrics if k != "owners")
            log(WARNING, "The owners' evaluation metrics %s have none named 'accuracy' (or containing "
                "'acc'): the round lines show the mean of %s instead", names, names[0] if names else "none")
        return metrics

    def summary(self) -> None:
        """Log the privacy configuration."""
        cfg = self.cfg
        log(INFO, "\t├──> JointDP: method=%s unit=%s placement=%s", cfg.method,
            cfg.privacy_unit, cfg.noise_placement)
        log(INFO, "\t│\t├── personal layers: %r (%d personal parameters)",
            cfg.effective_personal_rule, self.num_personal)
        log(INFO, "\t│\t├── clipping norm %.4g, noise multiplier %.4g", cfg.clipping_norm,
            self.noise_multiplier)
        line = self.budget_line()  # owners capped by their node's max-epsilon (local noise)
        if line:
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t└── budget epsilon=%.4g at delta=%.3g (%s)", cfg.target_epsilon,
            cfg.delta, cfg.accountant)

    def save(self, arrays: ArrayRecord, status: str) -> None:
        self._ckpt.save(arrays, self.ledger, self.history, self.noise_multiplier, status,
                        self._summary(self.history, self._t0), ema=self._ema_state())
        if status != "running":
            log(INFO, "Finished (%s): results in %s", status, self._ckpt.results_path)

    def after_aggregate(self, server_round: int, arrays: ArrayRecord) -> None:
        if self.ema is not None:
            self.ema.update({k: v.numpy() for k, v in arrays.items()})

    def evaluated_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        return self._evaluated_arrays(arrays)

    def evaluate_fn_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The shared model plus the personal parameters at their public
        initial values (the server never holds an owner's personal layers), in the
        order of ``initial_arrays``, so ``evaluate_fn`` can ``load_state_dict`` it."""
        values = {k: v.numpy() for k, v in arrays.items()}
        values.update(self.public_initial)
        return protocol.to_record({k: values[k] for k in self.model_spec if k in values})

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self.cfg.dp else 0.0

    def failure_reasons(self) -> str:
        return "; ".join(list(dict.fromkeys(self.last_drop_reasons))[:3]) or "no reply arrived"

    def cannot_progress(self) -> bool:
        return bool(self.last_drop_reasons) and all(protocol.BROKEN_RULE in r for r in self.last_drop_reasons)

    def cannot_progress_reason(self) -> str:
        return ("every owner's train function breaks a rule of the DP pass, which the same code breaks in every "
                "round; fix it and start a new run")

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        cfg = self.cfg
        info = self.last_round_info
        row = {
            "round": server_round,
            "accuracy": float(eval_metrics.get("accuracy", float("nan"))) if eval_metrics else float("nan"),
            "accuracy_std": float(eval_metrics.get("accuracy-std", float("nan"))) if eval_metrics else float("nan"),
            "evaluated_owners": int(eval_metrics["owners"]) if eval_metrics else 0,
            "epsilon": self.epsilon_spent(), "delta": cfg.delta, "noise_multiplier": self.noise_multiplier,
            "valid_owners": int(info.get("valid-owners", 0)),
            "dropped_owners": int(info.get("dropped-owners", 0)),
            "skipped": bool(self.spec) and (bool(info.get("skipped", False)) or int(info.get("valid-owners", 0)) == 0),
        }
        if eval_metrics is not None and "personal-rounds-min" in eval_metrics:
            row["personal_rounds_min"] = int(eval_metrics["personal-rounds-min"])
        if eval_metrics is not None:
            row["owner_metrics"] = {k: float(v) for k, v in eval_metrics.items()
                                    if k not in ("personal-rounds-min",)}
        return row

    def round_line(self, row: dict) -> str:
        name, value = "accuracy", row["accuracy"]
        others = [k for k in row.get("owner_metrics", {}) if k not in ("owners", protocol.NUM_EXAMPLES)]
        if math.isnan(value) and others:  # no accuracy (a VAE, a regression): the owners' first metric
            name, value = others[0], row["owner_metrics"][others[0]]
        return (f"[round {row['round']}/{self.cfg.num_rounds}] mean personalized {name} "
                f"{value:.4f} over {row['evaluated_owners']} owners | epsilon {row['epsilon']:.4f} "
                f"(target {self.cfg.target_epsilon:.4g}) at delta {self.cfg.delta:.3g} | noise multiplier "
                f"{self.noise_multiplier:.4f}")

    def _evaluated_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The shared model owners are evaluated with: the moving average once a
        round has been averaged, else the aggregate itself."""
        if self.ema is None or self.ema.steps == 0:
            return arrays
        return protocol.to_record(self.ema.average(like={k: v.numpy() for k, v in arrays.items()}))

    def _ema_state(self) -> tuple[dict[str, np.ndarray], int] | None:
        if self.ema is None or self.ema.steps == 0:
            return None
        return self.ema.average(), self.ema.steps

    def _summary(self, history: list[dict], t0: float) -> dict[str, object]:
        last = history[-1] if history else {}
        return {
            "rounds_completed": len(history),
            "rounds_charged": len(self.ledger.rounds),
            "final_accuracy": last.get("accuracy"),
            "final_accuracy_owners": last.get("evaluated_owners"),  # how many owners that mean covers
            "final_epsilon": self.ledger.epsilon() if self.cfg.dp else 0.0,
            "num_owners": len(self.owner_node),
            "shared_parameters": int(sum(math.prod(s.shape) for s in self.spec.values())),
            "personal_parameters": self.num_personal,
            "wall_seconds": time.time() - t0,
            "session": self.session,
            # local noise: which owners ran at which budget and noise multiplier, and spent what
            **({"owner_budgets": budgets} if (budgets := self.budget_record()) is not None else {}),
        }


def _weighted_metrics(metrics: dict[int, dict[str, float]]) -> MetricRecord | None:
    """The owners' own evaluation metrics (a drop-in app's ``test``) averaged
    weighted by ``num-examples``, as Flower's FedAvg does; ``accuracy`` is the
    metric named so, else the first whose name contains ``acc``; ``owners`` is how
    many owners the averages cover."""
    if not metrics:
        return None
    total = sum(m[protocol.NUM_EXAMPLES] for m in metrics.values()) or 1.0
    keys = sorted({k for m in metrics.values() for k in m} - {protocol.NUM_EXAMPLES, protocol.PERSONAL_ROUNDS})
    out = {k: float(sum(m.get(k, 0.0) * m[protocol.NUM_EXAMPLES] for m in metrics.values()) / total)
           for k in keys if all(k in m for m in metrics.values())}
    acc = next((k for k in out if k == "accuracy"), None) or next((k for k in out if "acc" in k), None)
    if acc is not None:
        accs = [m[acc] for m in metrics.values()]
        out["accuracy"] = float(np.mean(accs))
        out["accuracy-std"] = float(np.std(accs))
        out["accuracy-weighted"] = float(sum(m[acc] * m[protocol.NUM_EXAMPLES] for m in metrics.values()) / total)
    out["owners"] = len(metrics)
    if all(protocol.PERSONAL_ROUNDS in m for m in metrics.values()):  # flwr-jdp's own app
        out["personal-rounds-min"] = float(min(m[protocol.PERSONAL_ROUNDS] for m in metrics.values()))
    return MetricRecord(out)


def load_results(results_dir: str | Path) -> dict:
    """Read the ``results.json`` a run wrote."""
    return json.loads((Path(results_dir) / "results.json").read_text())

