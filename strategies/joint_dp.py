"""JointDP: a Flower Message-API strategy for joint differential privacy.

Owner ``j``'s personal parameters never leave ``j``; the shared parameters are
learned together, and everything the other owners see (the shared parameters the
server broadcasts) is (epsilon, delta)-DP with respect to ``j``'s data, for the
configured unit (record, user or owner). This is joint DP in the billboard model.

Noise placement
    ``local``: owners add the noise themselves (DP-SGD on the shared parameters, or
    a noised clipped update for the owner unit); the server only averages. The
    ledger keeps one scope per owner and reports the maximum over owners.
    ``central``: owners send clipped quantities; the server (trusted aggregator)
    adds Gaussian noise once to their sum and divides by the expected count. The
    ledger has one ``server`` scope.

Accounting is conservative: charge, save, release. A round's events are recorded
and the ledger written to disk *before* any message of the round leaves the server,
so a round whose replies are dropped or skipped is still charged, and so is a round
interrupted by a crash (its re-run after a restart is charged again). If the next
round would exceed the budget, training stops cleanly, keeping the last model and
the ledger on disk. Under local noise the owners also check each instruction and
keep their own ledgers (:mod:`flwr_jdp.privacy.owner_guard`).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from flwr_jdp import protocol
from flwr_jdp.config import ConfigError, JobConfig
from flwr_jdp.models import build_model
from flwr_jdp.params import get_arrays, split_parameters
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, numpy_rng
from flwr_jdp.privacy.schedule import OwnerSize, Schedule, build_schedule, calibrate_schedule
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit
from flwr_jdp.training.owner_round import release_kind

from .checkpoint import Checkpoint
from .iterate_average import SharedParameterEMA
from .node_query import query_nodes
from .validation import ArraySpec, spec_of, validate_replies

ModelFn = Callable[[tuple[int, ...], int], nn.Module]


class JointDP(Strategy):
    """Joint-DP training of shared parameters with personal layers kept local.

    Parameters
    ----------
    cfg : JobConfig
        The validated run configuration (:func:`flwr_jdp.config.parse_config`).
    model_fn : callable, optional
        ``(image_shape, num_classes) -> nn.Module``; defaults to the seed CNN.
    ledger : PrivacyLedger, optional
        Where releases are recorded; a new one at ``cfg.delta`` by default.
    node_settle_s : float
        At start-up, how long the count of connected nodes must stay unchanged
        before the set-up query goes out (skipped once there are as many nodes as
        owners; 0: query at once).
    """

    def __init__(
        self,
        cfg: JobConfig,
        model_fn: ModelFn | None = None,
        ledger: PrivacyLedger | None = None,
        node_settle_s: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.node_settle_s = node_settle_s
        self.model_fn = model_fn or (
            lambda shape, classes: build_model(cfg.model, shape, classes, cfg.norm, cfg.seed)
        )
        self.ledger = ledger or PrivacyLedger(
            delta=cfg.delta, accountant=cfg.accountant, unit=cfg.privacy_unit,
            budget=cfg.target_epsilon,
        )
        self.noise_multiplier = cfg.noise_multiplier
        self.kind = release_kind(cfg)
        self.rng = numpy_rng(cfg.noise_seed_or_none)
        self.owner_node: dict[int, int] = {}
        self.sizes: dict[int, OwnerSize] = {}
        self.schedule: Schedule | None = None
        self.spec: dict[str, ArraySpec] = {}
        self.num_personal = 0
        self._requested: dict[int, list[int]] = {}
        self._current: ArrayRecord = ArrayRecord()
        self.last_round_info: dict[str, object] = {}
        self.session = secrets.token_hex(8)  # kept across restarts (results.json)
        #: Moving average of the shared parameters that owners are evaluated with
        #: (``ema-decay`` > 0; post-processing, no privacy cost).
        self.ema = SharedParameterEMA(cfg.ema_decay) if cfg.ema_decay > 0 else None

    # ------------------------------------------------------------------ set-up
    def setup(self, grid: Grid, timeout: float = 120.0) -> ArrayRecord:
        """Ask every node which owners it hosts and their sizes; build the initial
        shared arrays; compute the sampling schedule and (if asked) calibrate the
        noise multiplier. Fails with a message naming the key on a mismatch."""
        found: list[tuple[tuple[int, ...], int]] = []
        deadline = time.time() + timeout
        self._wait_for_nodes(grid, deadline)

        def handle(reply: Message) -> None:
            got = self._register_node(reply)
            if got is not None:
                found.append(got)

        answered, silent = query_nodes(
            grid,
            lambda n: Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=n,
                              message_type=MessageType.QUERY),
            handle, lambda: set(range(self.cfg.num_owners)) <= set(self.owner_node), deadline)
        missing = sorted(set(range(self.cfg.num_owners)) - set(self.owner_node))
        if missing:
            shown = f"{missing[:10]}{'...' if len(missing) > 10 else ''}"
            if silent:
                raise RuntimeError(
                    f"{len(silent)} of {len(silent) + len(answered)} connected nodes did not answer the "
                    f"set-up query within {timeout:g} s (nodes {silent[:10]}), so owners {shown} are "
                    "unaccounted for: the nodes may still be starting on a busy machine, or have failed"
                )
            raise ConfigError(
                f"run-config key 'num-owners'={self.cfg.num_owners} but no node hosts owners "
                f"{shown} ({len(answered)} nodes connected, all answered)"
            )
        shape, classes = found[-1]
        model = self.model_fn(shape, classes)
        try:
            split = split_parameters(model, self.cfg.effective_personal_rule,
                                     allow_empty=self.cfg.method != "joint-dp")
        except ValueError as err:
            raise ConfigError(f"run-config key 'personal-layers': {err}") from None
        self.num_personal = sum(p.numel() for n, p in model.named_parameters()
                                if n in split.personal)
        initial = protocol.to_record(get_arrays(model, split.shared))
        self.spec = spec_of(initial)
        self.schedule = build_schedule(self.cfg, self.sizes)
        if (self.cfg.dp and self.cfg.method == "joint-dp" and not self.cfg.decoupled
                and self.cfg.unit is not PrivacyUnit.OWNER):
            log(WARNING, "personal-coupling='interleaved': shared gradients are taken through "
                "personal parameters trained without noise, so the %s-level guarantee the "
                "ledger reports is NOT established (the paper's Algorithm 1, kept for "
                "reproduction only); use 'decoupled'", self.cfg.privacy_unit)
        if self.cfg.dp and self.cfg.calibrate and self.noise_multiplier == 0.0:
            self.noise_multiplier = calibrate_schedule(self.cfg, self.schedule)
            log(INFO, "Calibrated noise multiplier %.4f for epsilon=%.3g at delta=%.3g over "
                "%d rounds (%s accountant)", self.noise_multiplier, self.cfg.target_epsilon,
                self.cfg.delta, self.cfg.num_rounds, self.cfg.accountant)
        return initial

    def _wait_for_nodes(self, grid: Grid, deadline: float, poll: float = 0.1) -> None:
        """Before the first query, let connecting nodes arrive: wait until as many
        nodes as owners are connected (no more can host an owner) or the count has
        not changed for ``node_settle_s`` seconds. Nodes that join later are still
        queried (see :meth:`setup`); this only saves a second round trip at start-up."""
        settle = self.node_settle_s
        if settle <= 0:
            return
        count, since = -1, time.time()
        while time.time() < deadline:
            now = len(list(grid.get_node_ids()))
            if now >= self.cfg.num_owners:
                return
            if now != count:
                count, since = now, time.time()
            elif now > 0 and time.time() - since >= settle:
                return
            time.sleep(poll)

    def _register_node(self, reply: Message) -> tuple[tuple[int, ...], int] | None:
        """Record the owners a node hosts; return (image shape, classes) if any."""
        if reply.has_error():
            raise RuntimeError(
                f"node {reply.metadata.src_node_id} failed at set-up: {reply.error.reason}"
            )
        rec = reply.content[protocol.SETUP]
        for o, nrec, nusr in zip(rec[protocol.OWNER_IDS], rec[protocol.NUM_RECORDS],
                                 rec[protocol.NUM_USERS], strict=False):
            if int(o) in self.owner_node:
                raise ConfigError(f"owner {o} is hosted by two nodes; check node configs "
                                  "'partition-id' and 'num-partitions'")
            self.owner_node[int(o)] = reply.metadata.src_node_id
            self.sizes[int(o)] = OwnerSize(int(nrec), int(nusr))
        if not rec[protocol.OWNER_IDS]:
            return None
        return tuple(int(v) for v in rec[protocol.IMAGE_SHAPE]), int(rec[protocol.NUM_CLASSES])

    # ---------------------------------------------------------------- training
    def _select(self) -> list[int]:
        owners = sorted(self.owner_node)
        if self.cfg.unit is PrivacyUnit.OWNER and self.cfg.fraction_train < 1.0:
            keep = self.rng.random(len(owners)) < self.cfg.fraction_train
            return [o for o, k in zip(owners, keep, strict=False) if k]
        return owners

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Plan the round, check and charge the budget, and address each node."""
        assert self.schedule is not None, "call setup() first"
        selected = self._select()
        planned = self.schedule.round_events(self.cfg, self.noise_multiplier, selected)
        if self.ledger.would_exceed(planned, self.cfg.target_epsilon):
            raise PrivacyBudgetExhausted(
                f"round {server_round} would spend epsilon={self.ledger.epsilon(planned):.4f} > "
                f"target-epsilon={self.cfg.target_epsilon} at delta={self.cfg.delta}"
            )
        self.ledger.record_round(server_round, planned, note=f"{len(selected)} owners")
        self._current = arrays
        self._requested = {}
        for o in selected:
            self._requested.setdefault(self.owner_node[o], []).append(o)
        messages = []
        for node, owners in self._requested.items():
            rec = ConfigRecord(dict(config))
            rec[protocol.ROUND] = server_round
            rec[protocol.OWNERS] = owners
            rec[protocol.SAMPLE_RATES] = [float(self.schedule.owner_rates[o]) for o in owners]
            rec[protocol.STEPS] = [int(self.schedule.owner_steps[o]) for o in owners]
            if self.kind == protocol.KIND_GRAD_SUM:
                rec[protocol.SAMPLE_RATES] = [float(self.schedule.server_rate)] * len(owners)
                rec[protocol.STEPS] = [1] * len(owners)
            rec[protocol.NOISE_MULTIPLIER] = float(self.noise_multiplier)
            rec[protocol.SESSION] = self.session
            content = RecordDict({protocol.SHARED: arrays, protocol.CONFIG: rec})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, drop bad replies with a reason, aggregate, add central noise."""
        selected = [o for owners in self._requested.values() for o in owners]
        central_clip = (self.cfg.dp and self.kind == protocol.KIND_DELTA
                        and self.cfg.placement is NoisePlacement.CENTRAL)
        valid = validate_replies(list(replies), self._requested, self.spec,
                                 max_norm=self.cfg.clipping_norm if central_clip else None)
        for reason in valid.dropped.values():
            log(WARNING, "round %d: dropped reply: %s", server_round, reason)
        needed = max(1, math.ceil(self.cfg.min_valid_fraction * len(selected)))
        info = {"valid-owners": len(valid.arrays), "dropped-owners": len(valid.dropped)}
        self.last_round_info = dict(info)
        if not self.spec:  # per-silo: nothing is shared
            return self._current, MetricRecord(info)
        if len(valid.arrays) < needed:
            log(WARNING, "round %d skipped: %d valid replies < %d required "
                "(min-valid-fraction=%.2f); its privacy cost is still charged",
                server_round, len(valid.arrays), needed, self.cfg.min_valid_fraction)
            self.last_round_info["skipped"] = True
            return None, MetricRecord(info)
        new = self._aggregate(valid.arrays, valid.weights)
        return protocol.to_record(dict(zip(self.spec, new, strict=False))), MetricRecord(info)

    def _aggregate(self, arrays: dict[int, list[np.ndarray]], weights: dict[int, float]) -> list[np.ndarray]:
        current = [self._current[k].numpy() for k in self.spec]
        owners = sorted(arrays)
        cfg = self.cfg
        if self.kind == protocol.KIND_PARAMS:
            w = np.array([weights[o] for o in owners], dtype=np.float64)
            w = w / w.sum()
            return [sum(wi * arrays[o][i] for wi, o in zip(w, owners, strict=False)).astype(current[i].dtype)
                    for i in range(len(current))]
        total = [sum(arrays[o][i] for o in owners) for i in range(len(current))]
        assert self.schedule is not None
        if self.kind == protocol.KIND_GRAD_SUM:
            mech = GaussianSumMechanism(self.noise_multiplier, cfg.clipping_norm,
                                        self.schedule.server_rate * self.schedule.num_units)
            grad = mech.release_numpy(total, self.rng)
            return [(c - cfg.learning_rate * g).astype(c.dtype) for c, g in zip(current, grad, strict=False)]
        # KIND_DELTA
        if cfg.placement is NoisePlacement.CENTRAL:
            expected = self.schedule.server_rate * len(self.owner_node)
            mech = GaussianSumMechanism(self.noise_multiplier, cfg.clipping_norm, expected)
            update = mech.release_numpy(total, self.rng)
        else:
            update = [t / len(owners) for t in total]
        return [(c + cfg.server_learning_rate * u).astype(c.dtype) for c, u in zip(current, update, strict=False)]

    # -------------------------------------------------------------- evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Ask every owner to evaluate its own model on its own test split."""
        self._requested = {}
        for o, node in sorted(self.owner_node.items()):
            self._requested.setdefault(node, []).append(o)
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
        valid = validate_replies(list(replies), self._requested, None,
                                 required_metrics=(protocol.NUM_EXAMPLES, protocol.ACCURACY,
                                                   protocol.PERSONAL_ROUNDS))
        for reason in valid.dropped.values():
            log(WARNING, "round %d: dropped evaluation reply: %s", server_round, reason)
        accs = [m[protocol.ACCURACY] for m in valid.metrics.values() if m[protocol.ACCURACY] <= 1.0]
        if not accs:
            return None
        n = [m[protocol.NUM_EXAMPLES] for m in valid.metrics.values()]
        weighted = sum(m[protocol.ACCURACY] * m[protocol.NUM_EXAMPLES] for m in valid.metrics.values())
        return MetricRecord({
            "accuracy": float(np.mean(accs)),
            "accuracy-std": float(np.std(accs)),
            "accuracy-weighted": float(weighted / max(1.0, sum(n))),
            "owners": len(accs),
            "personal-rounds-min": min(m.get(protocol.PERSONAL_ROUNDS, 0.0)
                                       for m in valid.metrics.values()),
        })

    def summary(self) -> None:
        """Log the privacy configuration."""
        cfg = self.cfg
        log(INFO, "\t├──> JointDP: method=%s unit=%s placement=%s", cfg.method,
            cfg.privacy_unit, cfg.noise_placement)
        log(INFO, "\t│\t├── personal layers: %r (%d personal parameters)",
            cfg.effective_personal_rule, self.num_personal)
        log(INFO, "\t│\t├── clipping norm %.4g, noise multiplier %.4g", cfg.clipping_norm,
            self.noise_multiplier)
        log(INFO, "\t│\t└── budget epsilon=%.4g at delta=%.3g (%s)", cfg.target_epsilon,
            cfg.delta, cfg.accountant)

    # --------------------------------------------------------------- main loop
    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run set-up and the rounds, checkpointing model, ledger and results to
        ``results-dir`` after every round; stop cleanly when the budget would be
        exceeded. An unfinished run with the same configuration is resumed.

        ``timeout`` (default: run-config ``round-timeout``) bounds every exchange;
        an owner whose reply is later (crashed, hung or disconnected node) is
        dropped for that round, which is still charged in full."""
        cfg = self.cfg
        timeout = float(timeout or cfg.round_timeout)
        num_rounds = num_rounds or cfg.num_rounds
        t0 = time.time()
        arrays = self.setup(grid, timeout=120.0)
        if initial_arrays is not None:
            arrays = initial_arrays
        ckpt = Checkpoint(Path(cfg.results_dir), cfg.to_dict())
        start_round, history = 1, []
        if cfg.resume and ckpt.resumable():
            arrays, self.ledger, history, z = ckpt.load(self.spec)
            self.noise_multiplier = z if cfg.dp else self.noise_multiplier
            start_round = len(history) + 1
            self.session = ckpt.session() or self.session
            saved = ckpt.load_ema(self.spec) if self.ema is not None else None
            if saved is not None:
                self.ema.restore(*saved)
            log(INFO, "Resuming from %s after round %d (epsilon %.4f spent)",
                cfg.results_dir, start_round - 1, self.ledger.epsilon())
            interrupted = [r["round"] for r in self.ledger.rounds if r["round"] >= start_round]
            if interrupted:
                log(WARNING, "Round %d was charged before the restart and its owners may have "
                    "released; its charge stands and its re-run is charged again", interrupted[-1])
        self.summary()
        result = Result()
        result.arrays = arrays
        status = "completed"
        for rnd in range(start_round, num_rounds + 1):
            t_round = time.time()
            try:
                messages = self.configure_train(rnd, arrays, train_config or ConfigRecord(), grid)
            except PrivacyBudgetExhausted as err:
                log(WARNING, "Stopping before round %d: privacy budget exhausted (%s)", rnd, err)
                status = "budget-exhausted"
                break
            # Charge, save, release: the round's charge is on disk before any of its
            # messages leaves the server, so a crash from here on cannot un-charge it.
            ckpt.save(arrays, self.ledger, history, self.noise_multiplier, "running",
                      self._summary(history, t0), ema=self._ema_state())
            replies = grid.send_and_receive(messages, timeout=timeout)
            new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                arrays = new_arrays
                if self.ema is not None:
                    self.ema.update({k: v.numpy() for k, v in arrays.items()})
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            evaluated = self._evaluated_arrays(arrays)
            eval_replies = grid.send_and_receive(
                self.configure_evaluate(rnd, evaluated, evaluate_config or ConfigRecord(), grid),
                timeout=timeout,
            )
            eval_metrics = self.aggregate_evaluate(rnd, eval_replies)
            if eval_metrics is not None:
                result.evaluate_metrics_clientapp[rnd] = eval_metrics
            eps = self.ledger.epsilon() if cfg.dp else 0.0
            acc = float(eval_metrics["accuracy"]) if eval_metrics is not None else float("nan")
            row = {
                "round": rnd, "accuracy": acc,
                "accuracy_std": float(eval_metrics["accuracy-std"]) if eval_metrics else float("nan"),
                "epsilon": eps, "delta": cfg.delta, "noise_multiplier": self.noise_multiplier,
                "valid_owners": int(self.last_round_info.get("valid-owners", 0)),
                "dropped_owners": int(self.last_round_info.get("dropped-owners", 0)),
                "skipped": bool(self.last_round_info.get("skipped", False)),
                "personal_rounds_min": int(eval_metrics["personal-rounds-min"]) if eval_metrics else 0,
                "seconds": time.time() - t_round,
            }
            history.append(row)
            log(INFO, "[round %d/%d] mean personalized accuracy %.4f over %d owners | "
                "epsilon %.4f (target %.4g) at delta %.3g | noise multiplier %.4f | %.1fs",
                rnd, num_rounds, acc, int(eval_metrics["owners"]) if eval_metrics else 0, eps,
                cfg.target_epsilon, cfg.delta, self.noise_multiplier, row["seconds"])
            result.arrays = arrays
            ckpt.save(arrays, self.ledger, history, self.noise_multiplier, "running",
                      self._summary(history, t0), ema=self._ema_state())
        ckpt.save(arrays, self.ledger, history, self.noise_multiplier, status,
                  self._summary(history, t0), ema=self._ema_state())
        log(INFO, "Finished (%s): results in %s", status, ckpt.results_path)
        return result

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
            "final_epsilon": self.ledger.epsilon() if self.cfg.dp else 0.0,
            "num_owners": len(self.owner_node),
            "shared_parameters": int(sum(math.prod(s.shape) for s in self.spec.values())),
            "personal_parameters": self.num_personal,
            "wall_seconds": time.time() - t0,
            "session": self.session,
        }


def load_results(results_dir: str | Path) -> dict:
    """Read the ``results.json`` a run wrote."""
    return json.loads((Path(results_dir) / "results.json").read_text())


__all__ = ["JointDP", "load_results"]
