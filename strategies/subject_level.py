"""SubjectLevelFedAvg: subject-level DP across silos (Marathe et al.) as a Flower
ServerApp strategy, with horizontal-composition-aware accounting.

Privacy guarantee (``higradavg-dp``, ``user-ldp``): subject-level (epsilon, delta)-DP
of everything the server and other silos see, the unit being one data subject with
all its records at every silo (add/remove). Each silo noises its own model updates
(local DP, honest-but-curious server); the server averages the silos' models
(``theta = mean_i theta_i``, post-processing). The ledger (unit ``subject``) holds
one scope per Pareto-maximal subject of the subject-to-silo map (the worst-case
subject alone under the public cap), charged each round *before* the silos train
with the composition of that subject's events at every silo that holds it; its
epsilon is the exact maximum over subjects. The silos do not trust this server: each
checks every instruction against the plan it derives from its run config and keeps
its own ledger (:mod:`flwr_jdp.subject.silo_guard`); a refusal comes back as an error
reply naming the reason, and that silo is dropped for the round.
``local-item-dp`` records one scope per silo (record unit: silos hold disjoint
records); ``local-group-dp`` carries the paper's claimed budget only (its noise is
data-dependent, see :mod:`flwr_jdp.subject.group_privacy`), unless it runs with a fixed
``group-size`` ``G`` (sensitivity ``G C``), which is accounted as ``higradavg-dp``. The plan (noise,
rounds) is fixed before round 1 (:func:`flwr_jdp.subject.plan.make_plan`).

Set-up, two modes (:mod:`flwr_jdp.subject.plan`):

- **public cap** (``max-records-per-subject = K > 0``, the default): each silo keeps at
  most ``K`` records of each subject and samples at the public ``sample-rate``; the
  set-up reply lists only the silo indices a node hosts (node configuration), no
  subject id or count. The plan and the ledger (one scope, ``subject/worst-case``) are
  those of the worst-case subject, ``K`` records at every silo: conservative and
  data-independent. The server receives nothing but each silo's DP model.
- **reported counts** (``max-records-per-subject = 0``; the paper's reproduction): each
  silo sends its subject ids and per-subject record counts once, and the rates are
  ``batch-size`` over each silo's size. This metadata is not covered by the guarantee.

Batch statistics (group size ``Z`` and distinct subjects per batch) are sent only
with ``report-batch-stats = true`` (the paper's Figure 2; not DP; reported counts only,
refused under the public cap). Under the public cap ``target-epsilon`` is a hard
budget: a plan over it (``sqrt-rounds``, a too small fixed ``noise-multiplier``) is
refused before any node is contacted (:func:`flwr_jdp.subject.plan.over_target`).

Rounds: ``query`` once (each node lists its silos, and their counts in the
reported-counts mode), then per round
``train`` with the global model and the plan; a reply with missing silos, wrong
shapes or non-finite values is dropped with a logged reason (that silo is absent
from the average). The ledger is written as soon as a round is charged, model and
results after every round.

Restart (``resume = true``, the default): a server restarted with the same run
config and ``results-dir`` reloads the model, ledger, history and batch statistics
of an unfinished run and continues after the last completed round. A round that
was charged but not completed (crash mid-round) may have released noised models:
its charge stays, and re-running it is charged again. If that would take epsilon
beyond the target (or, with reported counts, the plan's epsilon, if larger), the run stops with status
``budget-exhausted`` and the model and ledger saved (conservative: nothing is ever un-charged). A silo
that released the interrupted round already refuses its re-run (its own ledger, kept across restarts in
the node's ``state-dir``), and is dropped from that round's average.
"""

from __future__ import annotations

import json
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted

from flwr_jdp.checkpoint import Checkpoint
from flwr_jdp.config_check import ConfigError
from flwr_jdp.node_query import query_nodes
from flwr_jdp.privacy.events import dp_sgd
from flwr_jdp.privacy.horizontal import HorizontalAccountant, SiloRelease
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.strategies.accounted import AccountedStrategy
from flwr_jdp.subject.config import SubjectDPConfig
from flwr_jdp.subject.plan import SubjectPlan, accounting_counts, make_plan, over_target, worst_case_counts
from flwr_jdp.subject.protocol import (  # noqa: E402,F401 - the keys, re-exported
    CALIBRATION_STEPS,
    CONFIG,
    MODEL,
    NOISE_MULTIPLIER,
    ROUND,
    SAMPLE_RATES,
    SETUP,
    SILOS,
    STATS,
    load_arrays,
    model_arrays,
    silo_key,
)


class SubjectLevelFedAvg(AccountedStrategy):
    """Plan, charge, broadcast, average, evaluate; one run."""

    def __init__(self, cfg: SubjectDPConfig, model: torch.nn.Module, evaluate_fn=None,  # noqa: ANN001
                 run_config: dict | None = None, accountant: str = "pld") -> None:
        self.cfg, self.model, self.evaluate_fn = cfg, model, evaluate_fn
        self.accountant = accountant
        self.node_silos: dict[int, list[int]] = {}
        self.counts: np.ndarray | None = None
        self.plan: SubjectPlan | None = None
        self.history: list[dict] = []
        self.dropped: list[str] = []
        self.batch_stats: dict[str, list[int]] = {"group_sizes": [], "distinct_subjects": []}
        self.ledger = PrivacyLedger(delta=cfg.delta, accountant=accountant)
        self.status = "running"
        self._events: dict = {}
        self._reference: dict[str, np.ndarray] = {}
        self._silos = 0
        self.checkpoint = Checkpoint(Path(cfg.results_dir), dict(run_config or {})) if cfg.results_dir else None

    def _drop(self, reply: Message, reason: str) -> None:
        msg = f"node {reply.metadata.src_node_id}: {reason}"
        self.dropped.append(msg)
        log(WARNING, "Dropped reply from %s", msg)

    # ------------------------------------------------------------------ setup
    def discover(self, grid: Grid, timeout: float = 600.0) -> np.ndarray:
        """Ask nodes for their silos until all silos report: the subject-to-silo counts
        they report (reported-counts mode), or the worst-case row ``[K] * s`` (public
        cap: no count is read, and the nodes send none)."""
        s, reported = self.cfg.num_silos, not self.cfg.public_cap
        per_silo: dict[int, dict[int, int]] = {}

        def handle(reply: Message) -> None:
            if reply.has_error() or SETUP not in reply.content:
                self._drop(reply, "setup reply without a 'setup' record")
                return
            silos = [int(i) for i in reply.content[SETUP].get(SILOS, [])]
            bad = [i for i in silos if not 0 <= i < s or i in per_silo]
            if bad or (reported and any(silo_key(i) not in reply.content.array_records for i in silos)):
                self._drop(reply, f"silos {silos[:5]} out of range, hosted twice or without counts")
                return
            for i in silos:
                per_silo[i] = {}
                if reported:
                    rec = reply.content.array_records[silo_key(i)]
                    subj, cnt = rec["subjects"].numpy(), rec["counts"].numpy()
                    per_silo[i] = {int(a): int(c) for a, c in zip(subj, cnt, strict=True) if c > 0}
            self.node_silos[reply.metadata.src_node_id] = silos

        _, silent = query_nodes(
            grid,
            lambda n: Message(RecordDict({CONFIG: ConfigRecord({"round": 0})}), dst_node_id=n,
                              message_type=MessageType.QUERY),
            handle, lambda: len(per_silo) >= s, time.time() + timeout, pause=0.5)
        if len(per_silo) < s:
            raise RuntimeError(f"only {len(per_silo)} of {s} silos reported within {timeout:.0f} s"
                               + (f"; nodes {silent[:10]} never answered" if silent else ""))
        if not reported:
            return worst_case_counts(self.cfg)
        num_subjects = 1 + max(a for d in per_silo.values() for a in d)
        counts = np.zeros((num_subjects, s), dtype=np.int64)
        for i, d in per_silo.items():
            for a, c in d.items():
                counts[a, i] = c
        return counts

    # ------------------------------------------------------------- accounting
    def round_events(self) -> dict:
        """Scope -> event of one round (what the ledger charges)."""
        cfg, plan = self.cfg, self.plan
        if not cfg.private or (cfg.method == "local-group-dp" and not cfg.group_size):
            return {}
        if cfg.method == "local-item-dp":
            return {f"silo/{i}": dp_sgd(plan.noise_multiplier, q, cfg.local_steps)
                    for i, q in enumerate(plan.sample_rates)}
        rel = [SiloRelease(q, plan.noise_multiplier, cfg.local_steps, sampling=cfg.sampling)
               for q in plan.sample_rates]
        acc = HorizontalAccountant(accounting_counts(cfg, self.counts), cfg.delta, self.accountant)
        if cfg.public_cap:  # the one worst-case subject: K records at every silo
            return {"subject/worst-case": acc.subject_event(acc.counts[0], rel, 1)}
        return {f"subject/{a}": acc.subject_event(acc.counts[a], rel, 1) for a in acc.candidates}

    # ----------------------------------------------------------------- rounds
    def _train_messages(self, server_round: int) -> list[Message]:
        plan = self.plan
        arrays = ArrayRecord({k: Array(v) for k, v in model_arrays(self.model).items()})
        out = []
        for node, silos in self.node_silos.items():
            conf = ConfigRecord({
                ROUND: server_round, SILOS: silos,
                SAMPLE_RATES: [float(plan.sample_rates[i]) for i in silos],
                NOISE_MULTIPLIER: float(plan.noise_multiplier),
                CALIBRATION_STEPS: int(plan.calibration_steps),
            })
            out.append(Message(RecordDict({MODEL: arrays, CONFIG: conf}), dst_node_id=node,
                               message_type=MessageType.TRAIN))
        return out

    def _collect(self, replies, reference: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        models = []
        for reply in replies:
            if reply.has_error():
                self._drop(reply, f"error {reply.error.code}: {reply.error.reason}")
                continue
            expected = self.node_silos.get(reply.metadata.src_node_id, [])
            for i in expected:
                rec = reply.content.array_records.get(silo_key(i))
                if rec is None:
                    self._drop(reply, f"no model for silo {i}")
                    continue
                arrays = {k: rec[k].numpy() for k in rec} if set(rec) == set(reference) else None
                if arrays is None or any(arrays[k].shape != reference[k].shape for k in reference):
                    self._drop(reply, f"silo {i}: arrays do not match the model")
                    continue
                if not all(np.isfinite(a).all() for a in arrays.values()):
                    self._drop(reply, f"silo {i}: non-finite values")
                    continue
                models.append(arrays)
            stats = reply.content.array_records.get(STATS)
            if stats is not None:
                for key in self.batch_stats:
                    if key in stats:
                        self.batch_stats[key].extend(int(v) for v in stats[key].numpy().ravel())
        return models

    # ---------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Discover the silos (and their per-subject counts in the reported-counts
        mode), plan z and the rates, resume. ``initial_arrays`` (the model's state dict) replaces the model's
        initial values; the plan sets the number of rounds, so ``num_rounds``, if
        given, must equal it."""
        cfg = self.cfg
        if initial_arrays is not None:
            load_arrays(self.model, {k: v.numpy() for k, v in initial_arrays.items()})
        if cfg.public_cap:  # the plan uses no data: refuse one over the target before contacting any node
            self._make_plan(None)
        self.counts = self.discover(grid, min(timeout, 600.0))
        if not cfg.public_cap:
            self._make_plan(self.counts)
        if num_rounds is not None and num_rounds != self.plan.rounds:
            raise ValueError(f"start(num_rounds={num_rounds}) differs from the plan's {self.plan.rounds} rounds")
        self.ledger = PrivacyLedger(delta=cfg.delta, accountant=self.accountant, unit=self.plan.unit)
        self._events = self.round_events()
        self.ledger, first = self._maybe_resume(self.ledger)
        if first == 1 and not self.history:
            self.save(self._arrays(), "running")  # a crash in round 1 then resumes with round 1's charge
        return self._arrays(), range(first, self.plan.rounds + 1)

    def _make_plan(self, counts: np.ndarray | None) -> None:
        """Plan z, the rates and the rounds; under the public cap a plan whose epsilon
        exceeds ``target-epsilon`` is refused (:class:`ConfigError` naming the keys)."""
        cfg, t0 = self.cfg, time.time()
        self.plan = make_plan(cfg, counts, self.accountant)
        log(INFO, "Plan (%s, %s, %s accounting, inclusion %s, sampling %s): z = %.4f, %d rounds, exact epsilon "
            "%.4g, s-fold bound %.4g, claimed %.4g (%.0f s)", cfg.method,
            f"public cap of {cfg.max_records_per_subject} records per subject and silo" if cfg.public_cap
            else "reported counts (not DP)", cfg.accounting, cfg.inclusion, cfg.sampling,
            self.plan.noise_multiplier, self.plan.rounds, self.plan.epsilon, self.plan.epsilon_sfold,
            self.plan.epsilon_claimed, time.time() - t0)
        reason = over_target(cfg, self.plan)
        if reason:
            raise ConfigError(reason)

    def _arrays(self) -> ArrayRecord:
        return ArrayRecord({k: Array(v) for k, v in model_arrays(self.model).items()})

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Charge the round (a rerun after a restart too, unless that would exceed
        the budget: then PrivacyBudgetExhausted), then address every node."""
        events, cfg = self._events, self.cfg
        if events and any(int(e["round"]) >= server_round for e in self.ledger.rounds):  # charged before a crash
            budget = max(cfg.target_epsilon, self.plan.epsilon)
            if self.ledger.epsilon(events) > budget * (1 + 1e-9):
                raise PrivacyBudgetExhausted(
                    f"re-running round {server_round} after a restart would take epsilon "
                    f"{self.ledger.epsilon(events):.4g} beyond {budget:.4g}")
        self.ledger.record_round(server_round, events, note=cfg.method)  # charged before release
        self._reference = model_arrays(self.model)
        return self._train_messages(server_round)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:  # noqa: ANN001
        """Average the valid silo models (each a DP release)."""
        reference = self._reference
        models = self._collect(replies, reference)
        if models:
            load_arrays(self.model, {k: np.mean([m[k] for m in models], axis=0) for k in reference})
        self._silos = len(models)
        return (self._arrays() if models else None), MetricRecord({"silos": len(models)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        return []  # the global model is evaluated on the server (evaluate_fn)

    def aggregate_evaluate(self, server_round: int, replies) -> MetricRecord | None:  # noqa: ANN001
        return None

    def save(self, arrays: ArrayRecord, status: str) -> None:
        self.status = status
        self._save(self.ledger, status)

    def epsilon_spent(self) -> float:
        return self.ledger.epsilon() if self._events else float("nan")

    def failure_reasons(self) -> str:
        return "; ".join(self.dropped[-3:]) or "no reply arrived"

    def round_row(self, server_round: int, train_metrics: MetricRecord | None,
                  eval_metrics: MetricRecord | None) -> dict:
        row = {"round": server_round, "silos": self._silos,
               "epsilon": self.ledger.epsilon() if self._events else None, "skipped": self._silos == 0}
        if self.evaluate_fn is not None and (server_round % self.cfg.eval_every == 0
                                             or server_round == self.plan.rounds):
            row.update(self.evaluate_fn(self.model))
        return row

    def round_line(self, row: dict) -> str:
        eps = (f"{row['epsilon']:.4f}" if row["epsilon"] is not None
               else f"claimed {self.plan.epsilon_claimed:g}")
        acc = f"{row['accuracy']:.4f}" if "accuracy" in row else "-"
        return (f"[round {row['round']}/{self.plan.rounds}] accuracy {acc} | epsilon {eps} ({self.plan.unit}) | "
                f"z {self.plan.noise_multiplier:.4f} | {row['silos']} silos")

    def results(self) -> dict:
        """What ``results.json`` holds (status, plan, ledger epsilon, final accuracy, ...)."""
        return self.summary(self.ledger, self.status)

    def _maybe_resume(self, ledger: PrivacyLedger) -> tuple[PrivacyLedger, int]:
        """(ledger, first round to run): the saved state of an unfinished run with
        the same configuration, or the fresh ledger and round 1."""
        ckpt = self.checkpoint
        if not (ckpt is not None and self.cfg.resume and ckpt.resumable()):
            return ledger, 1
        reference = model_arrays(self.model)
        arrays, saved, history, _ = ckpt.load({k: None for k in reference})
        load_arrays(self.model, {k: arrays[k].numpy() for k in reference})
        results = json.loads(ckpt.results_path.read_text())
        self.history = history
        self.batch_stats = {k: list(results.get("batch_stats", {}).get(k, [])) for k in self.batch_stats}
        self.dropped = list(results.get("dropped", []))
        done = int(history[-1]["round"]) if history else 0
        log(INFO, "Resuming after round %d: epsilon %.4g already spent (%d rounds charged)", done,
            saved.epsilon() if saved.scopes else 0.0, len(saved.rounds))
        return saved, done + 1

    def summary(self, ledger: PrivacyLedger, status: str) -> dict:
        last = self.history[-1] if self.history else {}
        return {"status": status, "method": self.cfg.method, "accounting": self.cfg.accounting,
                "inclusion": self.cfg.inclusion, "alpha": self.cfg.alpha,
                "max_records_per_subject": self.cfg.max_records_per_subject, "plan": self.plan.to_dict(),
                "ledger_epsilon": ledger.epsilon() if ledger.scopes else None,
                "acc_final": last.get("accuracy"), "dropped": self.dropped,
                "batch_stats": self.batch_stats, "silo_counts_max": self.counts.max(axis=0).tolist()}

    def _save(self, ledger: PrivacyLedger, status: str) -> None:
        if self.checkpoint is None:
            return
        arrays = ArrayRecord({k: Array(v) for k, v in model_arrays(self.model).items()})
        summary = self.summary(ledger, status)
        summary.pop("status")
        self.checkpoint.save(arrays, ledger, self.history, self.plan.noise_multiplier, status, summary)
