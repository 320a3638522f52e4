"""PrivAltMin: Priv-AltMin (Algorithms 1-3 of the model-personalization paper) as a
Flower Message-API strategy.

Privacy guarantee: the sequence of released embeddings ``U^(0..E)`` is
user-level (epsilon, delta)-DP (unit: one user's whole data set; add/remove one
user), accounted by PLD over the exact Gaussian releases in the ledger's
``server`` scope. Users' ``v_j`` are fitted locally from the released ``U`` and
never sent (billboard model: joint DP for the personalized models).

Trust model: central. SuperNodes host users and send per-node sums of
user-level clipped statistics; the server (a trusted aggregator, as the paper's
"central algorithm") adds the noise once to the total. Per-node sums are not
DP on their own.

Round structure (default: section 6's full-batch variant, ``T = groups = 1``;
with ``groups = T = epochs > 1``, Algorithm 1's disjoint user groups: epoch ``t``
uses only the users of group ``S_t``, each user is charged for the
initialisation and one epoch, and the ledger keeps one scope per group):
- round 0 (``train.init``): nodes send ``sum_j c_j M_j``; the server releases
  ``M + Wigner`` and takes its top-``k`` eigenvectors;
- rounds 1..E (``train``): nodes fit ``v_j`` on the broadcast ``U`` and send
  clipped ``A`` and ``b`` (Algorithm 2) or ``A`` and the gradient (Newton step);
  the server noises both and updates ``U``;
- after each round (``evaluate``): nodes report their users' mean excess
  population MSE with local final ``v_j`` (a synthetic-benchmark metric from
  the ground truth, not covered by DP).

Every release is charged to the ledger, and the ledger written to ``results-dir``,
before the nodes are asked (charge, save, release); a node whose
reply is missing or malformed is dropped with a logged reason (its users are
simply absent from that sum, which the sensitivity already covers).
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

from flwr_jdp.altmin.algorithm import (
    AltMinConfig,
    epoch_releases,
    init_release,
    server_init,
    server_update,
)
from flwr_jdp.altmin.problem import ProblemSpec
from flwr_jdp.altmin.protocol import CONFIG, EMBEDDING, INIT_ACTION, METRICS, STATS  # noqa: E402,F401
from flwr_jdp.altmin.release import GaussianRelease
from flwr_jdp.altmin.statistics import AltMinSums
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger
from flwr_jdp.privacy.mechanisms import numpy_rng
from flwr_jdp.strategies.accounted import AccountedStrategy


class PrivAltMin(AccountedStrategy):
    """Private alternating minimization of a shared ``d x k`` embedding."""

    def __init__(self, spec: ProblemSpec, cfg: AltMinConfig, results_dir: str | Path = "",
                 noise_seed: int = -1) -> None:
        self.spec, self.cfg = spec, cfg
        self.plan = cfg.noise_plan()
        self.ledger = PrivacyLedger(delta=cfg.delta, accountant=cfg.accountant, unit="user",
                                    budget=cfg.target_epsilon if cfg.private else None)
        self.rng = numpy_rng(None if noise_seed < 0 else noise_seed)
        self.results_dir = Path(results_dir) if results_dir else None
        self.embedding: np.ndarray | None = None
        self.history: list[dict] = []
        self.dropped: list[str] = []
        self._events: list = []
        self._t0 = time.time()

    # ------------------------------------------------------------- messages
    def _config(self, epoch: int) -> ConfigRecord:
        return ConfigRecord({"epoch": epoch})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Round 0: ask for the initialisation statistic; round ``r >= 1``: for
        epoch ``r``'s statistics at the broadcast embedding ``arrays``."""
        if self.cfg.private:  # charged here; the loop saves the ledger before sending
            self._events = self._events or self.release_events()
            self._charge(server_round, self._events)
        kind = INIT_ACTION if server_round == 0 else MessageType.TRAIN
        out = []
        for node in grid.get_node_ids():
            content = RecordDict({CONFIG: self._config(server_round)})
            if server_round > 0:
                content[EMBEDDING] = arrays
            out.append(Message(content, dst_node_id=node, message_type=kind))
        return out

    def _valid(self, reply: Message, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
        if reply.has_error():
            return self._drop(reply, f"error reply: {reply.error.reason}")
        if STATS not in reply.content or METRICS not in reply.content:
            return self._drop(reply, "missing 'stats' or 'metrics' record")
        arrays = {k: v.numpy() for k, v in reply.content[STATS].items()}
        if set(arrays) != set(shapes):
            return self._drop(reply, f"arrays {sorted(arrays)} != expected {sorted(shapes)}")
        for k, a in arrays.items():
            if tuple(a.shape) != shapes[k] or not np.all(np.isfinite(a)):
                return self._drop(reply, f"array '{k}' has shape {a.shape} (expected {shapes[k]}) or non-finite values")
        return arrays

    def _drop(self, reply: Message, reason: str) -> None:
        msg = f"node {reply.metadata.src_node_id}: {reason}"
        self.dropped.append(msg)
        log(WARNING, "Dropped reply from %s", msg)
        return None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Sum the valid node replies, add the noise of this round's releases,
        post-process into the new embedding."""
        d, k = self.spec.dim, self.spec.rank
        if server_round == 0:
            shapes = {"m": (d, d)}
        else:
            shapes = {"a": (d * k, d * k), "b": (d * k,)}
        total = {name: np.zeros(shape) for name, shape in shapes.items()}
        users, valid = 0, 0
        for reply in replies:
            arrays = self._valid(reply, shapes)
            if arrays is None:
                continue
            valid += 1
            for name in shapes:
                total[name] += arrays[name]
            users += int(reply.content[METRICS].get("num-users", 0))
        releases = self.round_releases(server_round)
        if server_round == 0:
            self.embedding = server_init(total["m"], releases[0], k, self.rng)
        else:
            sums = AltMinSums(total["a"], total["b"], users, 0)  # clipped counts are not sent
            self.embedding = server_update(sums, releases, self.embedding, self.cfg, self.rng)
        metrics = MetricRecord({"num-users": users, "valid-nodes": valid})
        return ArrayRecord([self.embedding]), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return [Message(RecordDict({CONFIG: self._config(server_round), EMBEDDING: arrays}),
                        dst_node_id=node, message_type=MessageType.EVALUATE)
                for node in grid.get_node_ids()]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        total, users = 0.0, 0
        for reply in replies:
            if reply.has_error() or METRICS not in reply.content:
                self._drop(reply, "evaluation reply without metrics")
                continue
            rec = reply.content[METRICS]
            total += float(rec.get("mse-sum", 0.0))
            users += int(rec.get("num-users", 0))
        if users == 0:
            return None
        return MetricRecord({"mse": total / users, "num-users": users})

    def round_releases(self, server_round: int) -> tuple[GaussianRelease, ...]:
        """Round ``server_round``'s releases: the initialisation matrix (round 0) or
        epoch ``server_round - 1``'s ``(A, b)``. :meth:`aggregate_train` adds their
        noise and :meth:`release_events` takes the ledger's events from them."""
        if server_round == 0:
            return (init_release(self.cfg, self.plan, self.spec.samples_per_user),)
        return epoch_releases(self.cfg, self.plan, server_round - 1)

    def release_events(self) -> list:
        """The events of the plan's releases, in its order ``[init, A_1, b_1, ...]``
        (with ``groups > 1``: init and one epoch's pair), each from the mechanism of
        :meth:`round_releases` that adds that release's noise."""
        pairs = (len(self.plan.multipliers()) - 1) // 2
        return [r.event() for rnd in range(pairs + 1) for r in self.round_releases(rnd)]

    def summary(self) -> None:
        log(INFO, "PrivAltMin: %d users x %d samples, d=%d, k=%d | %d epochs, u-step %s | "
            "target epsilon %s at delta %.3g | overall noise multiplier %.4f (rho=%.4g zCDP)",
            self.spec.num_users, self.spec.samples_per_user, self.spec.dim, self.spec.rank,
            self.cfg.epochs, self.cfg.u_step, self.cfg.target_epsilon, self.cfg.delta,
            self.plan.noise_multiplier, self.plan.zcdp)

    # ---------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Round 0 is the initialisation, rounds 1..``epochs`` the epochs
        (``num_rounds``, if given, must equal ``epochs``: the noise plan's horizon).
        The embedding starts from the private initialisation, so ``initial_arrays``
        is not used."""
        if num_rounds is not None and num_rounds != self.cfg.epochs:
            raise ValueError(f"start(num_rounds={num_rounds}) differs from run-config 'epochs'="
                             f"{self.cfg.epochs}, the horizon of the noise plan")
        self._t0 = time.time()
        self.summary()
        self._events = self.release_events()
        return ArrayRecord([np.zeros((self.spec.dim, self.spec.rank))]), range(0, self.cfg.epochs + 1)

    def save(self, arrays: ArrayRecord, status: str) -> None:
        self._save(time.time() - self._t0, status=status)

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self.cfg.private else math.inf

    def failure_reasons(self) -> str:
        return "; ".join(self.dropped[-3:]) or "no reply arrived"

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        return {"epoch": server_round, "mse": float(eval_metrics["mse"]) if eval_metrics else float("nan"),
                "epsilon": self.epsilon_spent(),
                "users": int(train_metrics["num-users"]) if train_metrics else 0,
                "skipped": not train_metrics or int(train_metrics["valid-nodes"]) == 0}

    def round_line(self, row: dict) -> str:
        return (f"[epoch {row['epoch']}/{self.cfg.epochs}] population excess MSE {row['mse']:.3e} over "
                f"{row['users']} users | epsilon {row['epsilon']:.4f} (target {self.cfg.target_epsilon}) "
                f"at delta {self.cfg.delta:.3g}")

    def _charge(self, rnd: int, events: list) -> None:
        """Record round ``rnd``'s releases. Full batch: one ``server`` scope. With
        ``groups = T > 1``: scope ``group/t`` per disjoint user group; the
        initialisation touches every group, iteration ``t`` only group ``t``, and
        the run's epsilon is the maximum over groups (parallel composition)."""
        if self.cfg.groups <= 1:
            for event in (events[:1] if rnd == 0 else events[2 * rnd - 1: 2 * rnd + 1]):
                self.ledger.record(SERVER_SCOPE, event)
            return
        if rnd == 0:
            for t in range(self.cfg.groups):
                self.ledger.record(f"group/{t}", events[0])
        else:
            for event in events[1:3]:
                self.ledger.record(f"group/{rnd - 1}", event)

    def results(self, wall_seconds: float = float("nan"), status: str = "completed") -> dict:
        last = self.history[-1] if self.history else {}
        return {
            "status": status,
            "method": "priv-altmin" if self.cfg.private else "nonprivate-altmin",
            "final_mse": last.get("mse"),
            "epsilon": self.ledger.epsilon() if self.cfg.private else math.inf,
            "delta": self.cfg.delta,
            "zcdp": self.plan.zcdp,
            "noise_multiplier": self.plan.noise_multiplier,
            "release_multipliers": self.plan.multipliers(),
            "history": self.history,
            "dropped": self.dropped,
            "problem": self.spec.__dict__,
            "config": self.cfg.__dict__,
            "wall_seconds": wall_seconds,
        }

    def _save(self, wall_seconds: float, status: str) -> None:
        """Write the ledger (first), then results and the embedding. Called after
        every charge (``running``, before the nodes are asked) and at the end."""
        if self.results_dir is None:
            return
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.ledger.save(self.results_dir / "ledger.json")
        (self.results_dir / "results.json").write_text(
            json.dumps(self.results(wall_seconds, status), indent=1))
        if self.embedding is not None:
            np.savez(self.results_dir / "embedding.npz", embedding=self.embedding)
        if status != "running":
            log(INFO, "Finished: results in %s", self.results_dir)


__all__ = ["PrivAltMin"]
