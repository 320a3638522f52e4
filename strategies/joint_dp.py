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
keep their own ledgers (:mod:`flwr_jdp.joint_dp.owner_guard`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
from flwr.serverapp.strategy import FedAvg, FedAvgM, Result, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt

from flwr_jdp.checkpoint import Checkpoint
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import (
    NAMESPACE,
    ConfigError,
    JobConfig,
    dropin_record,
    namespaced_config,
    run_folder,
    with_settings,
)
from flwr_jdp.joint_dp.iterate_average import SharedParameterEMA
from flwr_jdp.joint_dp.release import release_kind
from flwr_jdp.joint_dp.schedule import OwnerSize, Schedule, build_schedule, calibrate_schedule, units_of
from flwr_jdp.joint_dp.validation import NORM_SLACK, ArraySpec, max_sampled_units, validate_replies
from flwr_jdp.node_query import query_nodes
from flwr_jdp.params import split_names
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, numpy_rng, reclipped_sum
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit
from flwr_jdp.strategies.accounted import AccountedStrategy


class JointDP(AccountedStrategy):
    r"""Joint-DP training of shared parameters with personal layers kept local.

    Parameters
    ----------
    cfg : JobConfig
        The validated run configuration (:func:`flwr_jdp.joint_dp.config.parse_config`).
    ledger : PrivacyLedger, optional
        Where releases are recorded; a new one at ``cfg.delta`` by default.
    node_settle_s : float
        At start-up, how long the count of connected nodes must stay unchanged
        before the set-up query goes out (skipped once there are as many nodes as
        owners; 0: query at once).
    inner : Strategy, optional
        A Flower strategy applied to each round's DP aggregate as post-processing
        (FedAvg by default; FedAvgM, FedAdam, FedYogi or FedAdagrad for a server
        optimizer). It changes the model, never the ledger. Flower's DP wrappers and
        robust aggregators are refused with the reason.
    **settings
        Any configuration key by its Python name (``target_epsilon=2.0``,
        ``personal_layers=r"^fc3\."``, ``noise_placement="central"``, ...), validated
        as the run config is; without ``cfg`` they configure the strategy alone
        (see :meth:`from_run_config` for apps configured by ``jdp.*`` keys).
    """

    def __init__(
        self,
        cfg: JobConfig | None = None,
        ledger: PrivacyLedger | None = None,
        node_settle_s: float = 1.0,
        inner: Strategy | None = None,
        **settings: object,
    ) -> None:
        self.inner = _checked_inner(inner)
        #: How the user spells flwr-jdp's run-config keys (in error messages): ``jdp.``
        #: in a drop-in app (:meth:`from_run_config`, or settings without ``cfg``),
        #: none in flwr-jdp's own app, whose whole run config is flwr-jdp's.
        self.key_prefix = "" if cfg is not None else f"{NAMESPACE}."
        if cfg is None:
            cfg = namespaced_config({}, **settings)
        elif settings:
            cfg = with_settings(cfg, **settings)
        self.cfg = cfg
        self.node_settle_s = node_settle_s
        self.ledger = ledger or PrivacyLedger(
            delta=cfg.delta, accountant=cfg.accountant, unit=cfg.privacy_unit,
            budget=cfg.target_epsilon, neighbouring=cfg.neighbouring,
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
        self.last_drop_reasons: list[str] = []
        self.model_spec: dict[str, ArraySpec] = {}  # every parameter of the model (set-up)
        self.public_initial: dict[str, np.ndarray] = {}  # personal values the release uses
        self.session = secrets.token_hex(8)  # kept across restarts (results.json)
        self._answered: set[int] = set()
        self._warned_accuracy = False
        #: Moving average of the shared parameters that owners are evaluated with
        #: (``ema-decay`` > 0; post-processing, no privacy cost).
        self.ema = SharedParameterEMA(cfg.ema_decay) if cfg.ema_decay > 0 else None

    @classmethod
    def from_run_config(cls, run_config: dict, **kwargs: object) -> JointDP:
        """A strategy configured by the ``jdp.*`` keys of a user's run config
        (``[tool.flwr.app.config.jdp]`` in pyproject.toml; every owner checks its
        instructions against the same keys); ``kwargs`` as for the constructor."""
        strategy = cls(namespaced_config(run_config), **kwargs)
        strategy.key_prefix = f"{NAMESPACE}."
        return strategy

    def _key(self, key: str) -> str:
        """Run-config key ``key`` as the user's app spells it (``jdp.num-rounds``)."""
        return f"{self.key_prefix}{key}"

    # ------------------------------------------------------------------ set-up
    def _split_initial(self, initial: ArrayRecord) -> None:
        """Shared/personal split of the user's ``initial_arrays`` by ``personal-layers``."""
        names = list(initial.keys())
        values = {n: initial[n].numpy() for n in names}
        self.model_spec = {n: ArraySpec(tuple(v.shape), str(v.dtype)) for n, v in values.items()}
        try:
            split = split_names(names, self.cfg.effective_personal_rule,
                                allow_empty=self.cfg.method != "joint-dp", what="initial_arrays")
        except ValueError as err:
            raise ConfigError(f"run-config key '{self._key('personal-layers')}': {err}") from None
        self.public_initial = {n: values[n] for n in split.personal}
        self.num_personal = int(sum(values[n].size for n in split.personal))
        self.spec = {n: self.model_spec[n] for n in split.shared}

    def _check_model(self, names: list[str], shapes: list[str], node: int) -> None:
        """The ClientApp's model (as a node reported it) against ``initial_arrays``."""
        reported = dict(zip(names, shapes, strict=False))
        given = {n: "x".join(str(d) for d in spec.shape) or "scalar" for n, spec in self.model_spec.items()}
        extra = sorted(set(given) - set(reported))
        if extra:
            raise ConfigError(
                f"initial_arrays has {extra[:5]}, which are not parameters of the ClientApp's model "
                f"(node {node}); buffers such as BatchNorm statistics depend on the data and cannot be "
                "shared under DP: pass only parameters, e.g. ArrayRecord(dict(net.named_parameters()))"
                if any("running" in n or "num_batches" in n for n in extra) else
                f"initial_arrays has {extra[:5]}, which the ClientApp's model (node {node}) does not have")
        missing = sorted(set(reported) - set(given))
        if missing:
            raise ConfigError(f"initial_arrays lacks {missing[:5]} of the ClientApp's model (node {node})")
        wrong = [f"{n}: {given[n]} here, {reported[n]} in the ClientApp" for n in given if given[n] != reported[n]]
        if wrong:
            raise ConfigError(f"initial_arrays do not match the ClientApp's model (node {node}): {wrong[:3]}")

    def setup(self, grid: Grid, timeout: float = 120.0,
              initial_arrays: ArrayRecord | None = None) -> ArrayRecord:
        """Ask every node which owners it hosts and their sizes (and check its model
        against ``initial_arrays``, whose personal values it is sent); return the
        initial shared arrays; compute the sampling schedule and (if asked) calibrate the
        noise multiplier. Fails with a message naming the key on a mismatch."""
        if initial_arrays is None:
            raise ConfigError("start() needs the model: pass start(initial_arrays=ArrayRecord("
                              "model.state_dict())) with the ClientApps' model's parameters")
        deadline = time.time() + timeout
        self._wait_for_nodes(grid, deadline)
        try:
            self._split_initial(initial_arrays)
            rule_error = None
        except ConfigError as err:  # raised once the nodes' models are known: if initial_arrays
            rule_error = err        # are not the ClientApp's model, that is the error to name
        query = RecordDict({protocol.CONFIG: ConfigRecord(),
                            protocol.PUBLIC_PERSONAL: protocol.to_record(self.public_initial)})

        def done() -> bool:
            if rule_error is not None:  # one node's model tells which error to name
                return bool(self._answered)
            if self.cfg.num_owners == 0:  # every node that is connected
                return bool(self._answered) and set(grid.get_node_ids()) <= self._answered
            return set(range(self.cfg.num_owners)) <= set(self.owner_node)

        answered, silent = query_nodes(
            grid, lambda n: Message(query, dst_node_id=n, message_type=MessageType.QUERY),
            self._register_node, done, deadline)
        if rule_error is not None:
            raise rule_error
        wanted = range(self.cfg.num_owners) if self.cfg.num_owners else sorted(self.owner_node)
        missing = sorted(set(wanted) - set(self.owner_node))
        if not self.owner_node:
            raise RuntimeError(f"no node hosts an owner ({len(answered)} nodes answered the set-up)")
        if missing:
            shown = f"{missing[:10]}{'...' if len(missing) > 10 else ''}"
            if silent:
                raise RuntimeError(
                    f"{len(silent)} of {len(silent) + len(answered)} connected nodes did not answer the "
                    f"set-up query within {timeout:g} s (nodes {silent[:10]}), so owners {shown} are "
                    "unaccounted for: the nodes may still be starting on a busy machine, or have failed"
                )
            raise ConfigError(
                f"run-config key '{self._key('num-owners')}'={self.cfg.num_owners} but no node hosts owners "
                f"{shown} ({len(answered)} nodes connected, all answered)"
            )
        self.schedule = build_schedule(self.cfg, self.sizes)
        self._calibrate()
        return protocol.to_record({n: initial_arrays[n].numpy() for n in self.spec})

    def _calibrate(self) -> None:
        assert self.schedule is not None
        if self.cfg.dp and self.cfg.calibrate and self.noise_multiplier == 0.0:
            self.noise_multiplier = calibrate_schedule(self.cfg, self.schedule)
            log(INFO, "Calibrated noise multiplier %.4f for epsilon=%.3g at delta=%.3g over "
                "%d rounds (%s accountant)", self.noise_multiplier, self.cfg.target_epsilon,
                self.cfg.delta, self.cfg.num_rounds, self.cfg.accountant)

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
            if self.cfg.num_owners and now >= self.cfg.num_owners:
                return
            if now != count:
                count, since = now, time.time()
            elif now > 0 and time.time() - since >= settle:
                return
            time.sleep(poll)

    def _register_node(self, reply: Message) -> None:
        """Record the owners a node hosts after checking its model."""
        if reply.has_error():
            hint = (": its ClientApp has no flwr-jdp client half; create JointDPClient(app, model_fn=..., "
                    "train_data=...) in the ClientApp (README, 'Use it in your own Flower app')"
                    if "No query function registered" in reply.error.reason else "")
            raise RuntimeError(
                f"node {reply.metadata.src_node_id} failed at set-up: {reply.error.reason}{hint}"
            )
        self._answered.add(reply.metadata.src_node_id)
        rec = reply.content[protocol.SETUP]
        if protocol.PARAM_NAMES not in rec:
            raise ConfigError(f"node {reply.metadata.src_node_id} replied to the set-up without its model's "
                              "parameter names: its ClientApp does not use flwr_jdp's JointDPClient")
        self._check_model(list(rec[protocol.PARAM_NAMES]), list(rec[protocol.PARAM_SHAPES]),
                          reply.metadata.src_node_id)
        for o, nrec, nusr in zip(rec[protocol.OWNER_IDS], rec[protocol.NUM_RECORDS],
                                 rec[protocol.NUM_USERS], strict=False):
            if int(o) in self.owner_node:
                raise ConfigError(f"owner {o} is hosted by two nodes; check node configs "
                                  "'partition-id' and 'num-partitions'")
            self.owner_node[int(o)] = reply.metadata.src_node_id
            self.sizes[int(o)] = OwnerSize(int(nrec), int(nusr))

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
        if self.schedule is None:
            raise ConfigError("JointDP runs through its own start() (set-up, calibration, ledger); it was "
                              f"driven by another strategy's loop. If it was wrapped: {_DP_WRAPPER}")
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
        """Validate, drop bad replies with a reason, aggregate, add central noise.

        Structurally malformed replies are dropped with a logged reason. Under
        central noise (the server noises what it aggregates) a well-formed owner
        update with invalid values (NaN/Inf; owner unit: a norm above the clipping
        norm beyond ``NORM_SLACK``) is replaced by zero, with a logged reason, and
        still counts as valid (``valid-owners``, of which ``zeroed-owners``), also for
        ``min-valid-fraction``, so neither the sum's denominator (the expected count)
        nor the decision to skip depends on its values."""
        selected = [o for owners in self._requested.values() for o in owners]
        central = self.cfg.dp and (self.kind == protocol.KIND_GRAD_SUM or (
            self.kind == protocol.KIND_DELTA and self.cfg.placement is NoisePlacement.CENTRAL))
        owner_clip = central and self.kind == protocol.KIND_DELTA
        valid = validate_replies(list(replies), self._requested, self.spec,
                                 max_norm=self.cfg.clipping_norm if owner_clip else None,
                                 zero_invalid=central)
        for owner, reason in sorted(valid.dropped.items()):
            why = ("no reply within round-timeout: node disconnected, crashed or too slow"
                   if reason.endswith("no reply") else "refused by the owner" if "refused:" in reason
                   else "error reply" if "reported an error" in reason else "invalid reply")
            log(WARNING, "round %d: dropped reply of owner %d (node %s), %s: %s", server_round,
                owner, self.owner_node.get(owner, "?"), why, reason)
        self.last_drop_reasons = list(valid.dropped.values())
        for reason in valid.zeroed.values():
            log(WARNING, "round %d: replaced an invalid update by zero: %s", server_round, reason)
        needed = max(1, math.ceil(self.cfg.min_valid_fraction * len(selected)))
        # zeroed owners are valid (aggregated, as zero) and counted as such everywhere
        info = {"valid-owners": len(valid.arrays), "dropped-owners": len(valid.dropped),
                "zeroed-owners": len(valid.zeroed)}
        self.last_round_info = dict(info)
        if not self.spec:  # per-silo: nothing is shared
            return self._current, MetricRecord(info)
        if len(valid.arrays) < needed:
            log(WARNING, "round %d skipped: %d valid replies (%d of them zeroed) < %d required "
                "(min-valid-fraction=%.2f); its privacy cost is still charged",
                server_round, len(valid.arrays), len(valid.zeroed), needed, self.cfg.min_valid_fraction)
            self.last_round_info["skipped"] = True
            return None, MetricRecord(info)
        new = self._aggregate(valid.arrays, valid.weights, server_round)
        released = protocol.to_record(dict(zip(self.spec, new, strict=False)))
        return self._post_process(server_round, released), MetricRecord(info)

    def _post_process(self, server_round: int, released: ArrayRecord) -> ArrayRecord:
        """The inner strategy's step on the DP aggregate (free post-processing: a
        function of DP output and the server's own state; the ledger is unchanged).
        The aggregate is handed to ``inner.aggregate_train`` as the one reply of the
        round, so FedAdam, FedYogi, FedAdagrad and FedAvgM apply their server
        optimizer to the pseudo-gradient ``aggregate - current``."""
        inner = self.inner
        if inner is None or type(inner) is FedAvg:
            return released
        if isinstance(inner, FedOpt):
            inner.current_arrays = {k: v.numpy() for k, v in self._current.items()}
        elif isinstance(inner, FedAvgM) and inner.current_arrays is None:
            inner.current_arrays = self._current
        ask = Message(RecordDict(), dst_node_id=0, message_type=MessageType.TRAIN)
        reply = Message(RecordDict({protocol.ARRAYS: released,
                                    protocol.METRICS: MetricRecord({inner.weighted_by_key: 1})}),
                        reply_to=ask)
        arrays, _ = inner.aggregate_train(server_round, [reply])
        if arrays is None:
            raise RuntimeError(f"the inner strategy {type(inner).__name__} returned no arrays")
        return protocol.to_record({k: arrays[k].numpy().astype(self._current[k].numpy().dtype)
                                   for k in self.spec})

    def _aggregate(self, arrays: dict[int, list[np.ndarray]], weights: dict[int, float],
                   server_round: int = 0) -> list[np.ndarray]:
        """Average (local noise) or re-clip, sum, noise and normalise (central noise).

        Central noise re-clips every owner's contribution, in float64, before the
        noise is added (:func:`~flwr_jdp.privacy.mechanisms.reclipped_sum`):
        owner unit, each clipped update to exactly ``C`` (the sensitivity the noise
        is for); record/user unit, each sum of clipped per-unit gradients to ``C``
        times :func:`~flwr_jdp.joint_dp.validation.max_sampled_units` of the
        owner (a public bound an honest sum exceeds with probability <= 1e-9).
        Re-clipping is non-expansive, so one unit still moves the noised sum by at
        most ``C``; the bound only limits what one owner's reply can do to the model.
        """
        current = [self._current[k].numpy() for k in self.spec]
        owners = sorted(arrays)
        cfg = self.cfg
        if self.kind == protocol.KIND_PARAMS:
            w = np.array([weights[o] for o in owners], dtype=np.float64)
            w = w / w.sum()
            return [sum(wi * arrays[o][i] for wi, o in zip(w, owners, strict=False)).astype(current[i].dtype)
                    for i in range(len(current))]
        assert self.schedule is not None
        central = self.kind == protocol.KIND_GRAD_SUM or cfg.placement is NoisePlacement.CENTRAL
        if central:
            if self.kind == protocol.KIND_GRAD_SUM:
                rate = self.schedule.server_rate
                bounds = {o: cfg.clipping_norm * max_sampled_units(units_of(cfg, self.sizes[o]), rate)
                          for o in owners}
            else:
                bounds = {o: cfg.clipping_norm for o in owners}
            total, over = reclipped_sum(arrays, bounds)
            for o, norm in over.items():
                if norm > bounds[o] * (1 + NORM_SLACK):
                    log(WARNING, "round %d: owner %d's contribution has norm %.4g > its bound %.4g; "
                        "re-clipped to the bound", server_round, o, norm, bounds[o])
        if self.kind == protocol.KIND_GRAD_SUM:
            mech = GaussianSumMechanism(self.noise_multiplier, cfg.clipping_norm,
                                        self.schedule.server_rate * self.schedule.num_units,
                                        secure=cfg.secure_noise)
            grad = mech.release_numpy(total, self.rng)
            return [(c - cfg.learning_rate * g).astype(c.dtype) for c, g in zip(current, grad, strict=False)]
        # KIND_DELTA
        if central:
            expected = self.schedule.server_rate * len(self.owner_node)
            mech = GaussianSumMechanism(self.noise_multiplier, cfg.clipping_norm, expected,
                                        secure=cfg.secure_noise)
            update = mech.release_numpy(total, self.rng)
        else:
            total = [sum(arrays[o][i] for o in owners) for i in range(len(current))]
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
        valid = validate_replies(list(replies), self._requested, None, required_metrics=(protocol.NUM_EXAMPLES,))
        for reason in valid.dropped.values():
            log(WARNING, "round %d: dropped evaluation reply: %s", server_round, reason)
        metrics = _weighted_metrics(valid.metrics)
        if metrics is not None and "accuracy" not in metrics and not self._warned_accuracy:
            self._warned_accuracy = True
            names = sorted(k for k in metrics if k != "owners")
            log(WARNING, "The owners' evaluation metrics %s have none named 'accuracy' (or containing "
                "'acc'): the round lines show accuracy nan; rename your test's accuracy metric", names)
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
        log(INFO, "\t│\t└── budget epsilon=%.4g at delta=%.3g (%s)", cfg.target_epsilon,
            cfg.delta, cfg.accountant)

    # ------------------------------------------------- the accounted loop's hooks
    def prepare(self, grid: Grid, initial_arrays: ArrayRecord | None, num_rounds: int | None,
                timeout: float) -> tuple[ArrayRecord, range]:
        """Set-up, calibration and resume, before any release. The arguments of
        ``start()`` mean what they mean in Flower's ``Strategy.start``:

        - ``initial_arrays``: the initial model. Its shared parameters are broadcast;
          its personal parameters are sent to the owners once, at set-up, as their
          public initial values (drop-in ClientApps), or must equal the public
          initial values the project's ClientApp model has. A mismatch with the
          ClientApps' model fails before any privacy is spent, naming the array.
        - ``num_rounds``: the horizon the noise is calibrated for. Under local noise
          it must equal run-config ``num-rounds``, which every owner uses to check the
          noise it is asked to add; a different value fails before any spending.
        - ``timeout`` (default: run-config ``round-timeout``) bounds every exchange;
          an owner whose reply is later (crashed, hung or disconnected node) is
          dropped for that round, which is still charged in full.
        - ``train_config`` / ``evaluate_config``: sent to the ClientApps with every
          train / evaluate instruction.
        - ``evaluate_fn(server_round, arrays)``: called on the global shared model
          before round 1 (round 0) and after every round; its metrics go to
          ``Result.evaluate_metrics_serverapp`` and ``results.json``.

        A run in which ``max-skipped-rounds`` rounds in a row have too few valid
        replies ends as failed (``status: failed`` with the epsilon spent saved, and
        an exception, so Flower marks the run ``finished:failed``)."""
        cfg = self.cfg
        if num_rounds is not None and num_rounds != cfg.num_rounds:
            if cfg.dp and cfg.placement is NoisePlacement.LOCAL:
                raise ConfigError(
                    f"start(num_rounds={num_rounds}) differs from run-config key '{self._key('num-rounds')}'="
                    f"{cfg.num_rounds}, which every owner uses to check the noise it adds under "
                    f"local noise: set {self._key('num-rounds')} = {num_rounds} in the run config, or pass "
                    f"num_rounds=context.run_config[\"{self._key('num-rounds')}\"]")
            if num_rounds < 1:
                raise ConfigError(f"start(num_rounds={num_rounds}): must be >= 1")
            cfg = self.cfg = dataclasses.replace(cfg, num_rounds=int(num_rounds))
        if not cfg.results_dir:
            cfg = self.cfg = dataclasses.replace(cfg, results_dir=run_folder("", self.session))
        self._t0 = time.time()
        self.max_skipped_rounds = cfg.max_skipped_rounds
        # Flower prints through its own handler; a root handler that another library
        # installed would print every line a second time.
        logging.getLogger("flwr").propagate = False
        arrays = self.setup(grid, timeout=120.0, initial_arrays=initial_arrays)
        recorded = dropin_record(cfg) if self.key_prefix else cfg.to_dict()
        self._ckpt = ckpt = Checkpoint(Path(cfg.results_dir), recorded)
        self.history = []
        start_round = 1
        if cfg.resume and ckpt.resumable():
            arrays, self.ledger, self.history, z = ckpt.load(self.spec)
            self.noise_multiplier = z if cfg.dp else self.noise_multiplier
            start_round = len(self.history) + 1
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
        log(INFO, "Writing model, ledger and results to %s", Path(cfg.results_dir).resolve())
        return arrays, range(start_round, cfg.num_rounds + 1)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """The accounted round loop (:class:`AccountedStrategy`); see :meth:`prepare`
        for what each argument means here. ``timeout`` defaults to run-config
        ``round-timeout``."""
        return super().start(grid, initial_arrays, num_rounds, timeout or self.cfg.round_timeout,
                             train_config, evaluate_config, evaluate_fn)

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
        return (f"[round {row['round']}/{self.cfg.num_rounds}] mean personalized accuracy "
                f"{row['accuracy']:.4f} over {row['evaluated_owners']} owners | epsilon {row['epsilon']:.4f} "
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
        }


#: Inner strategies whose server step is defined on one aggregate (post-processing).
INNER_STRATEGIES = "FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad"

#: Why a Flower DP wrapper cannot wrap or be wrapped by JointDP.
_DP_WRAPPER = ("flwr-jdp clips, noises and accounts the releases itself; Flower's DP wrappers "
               "(DifferentialPrivacy*FixedClipping / *AdaptiveClipping) would clip and noise "
               "releases that are already DP, without a ledger")


def _checked_inner(inner: Strategy | None) -> Strategy | None:
    """``inner`` if JointDP can apply it as post-processing, else a ConfigError."""
    if inner is None:
        return None
    name = type(inner).__name__
    if "DifferentialPrivacy" in name:
        raise ConfigError(f"inner={name}: {_DP_WRAPPER}; pass a plain strategy ({INNER_STRATEGIES})")
    if not isinstance(inner, FedOpt | FedAvgM) and type(inner) is not FedAvg:
        raise ConfigError(f"inner={name}: JointDP post-processes one DP aggregate per round, which "
                          f"{INNER_STRATEGIES} can step on; robust aggregators (median, Krum, trimmed "
                          "mean) need the individual replies, which are not DP")
    return inner


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


__all__ = ["JointDP", "load_results"]
