"""Aggregation of :class:`~flwr_jdp.strategies.JointDP`: the owners' replies validated,
averaged (local noise) or re-clipped, summed and noised (central noise), and the
inner Flower strategy's step applied to the DP aggregate as post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM, Strategy
from flwr.serverapp.strategy.fedopt import FedOpt

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, minimum_survivors
from flwr_jdp.joint_dp.distributed import owner_plan
from flwr_jdp.joint_dp.schedule import units_of
from flwr_jdp.joint_dp.validation import NORM_SLACK, max_sampled_units, validate_replies
from flwr_jdp.privacy.mechanisms import GaussianSumMechanism, reclipped_sum
from flwr_jdp.privacy.skellam import MODULUS, SkellamPlan, from_field
from flwr_jdp.privacy.units import NoisePlacement
from flwr_jdp.strategies.joint_dp.secagg import SecureSum


class Aggregation:
    """Validation, the (noised) aggregate and the inner strategy's post-processing.

    A part of :class:`~flwr_jdp.strategies.JointDP` (which holds the state it uses).
    """

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
        if self.kind == protocol.KIND_SECURE_SUM:
            return self._aggregate_secure(server_round)
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

    def exchange_train(self, server_round: int, messages: list[Message], grid: Grid,
                       timeout: float) -> Iterable[Message]:
        """Distributed noise: the round is one secure sum (:class:`SecureSum`) of the
        nodes' vectors; the server never holds a node's vector unmasked."""
        if self.kind != protocol.KIND_SECURE_SUM:
            return super().exchange_train(server_round, messages, grid, timeout)
        contents = {m.metadata.dst_node_id: m.content for m in messages}
        plan = self.secure_plan()
        hosted = {n: len(owners) for n, owners in self._requested.items()}

        def proceed(survivors: list[int]) -> str | None:
            alive = sum(hosted[n] for n in survivors)
            if alive < plan.min_survivors:
                return (f"{alive} owners sent their vectors, fewer than the {plan.min_survivors} the noise was "
                        f"planned for (dropout-tolerance={self.cfg.dropout_tolerance}); not unmasked")
            return None

        nodes_needed = minimum_survivors(len(contents), self.cfg.dropout_tolerance)
        self._secure = SecureSum(MODULUS, timeout).run(grid, contents, nodes_needed, str(server_round), proceed)
        return []

    def secure_plan(self) -> SkellamPlan:
        """The run's Skellam plan (distributed noise), as every owner computes it."""
        assert self.schedule is not None
        return owner_plan(self.cfg, self.noise_multiplier, self.schedule.dim, self.schedule.scale)

    def _aggregate_secure(self, server_round: int) -> tuple[ArrayRecord | None, MetricRecord]:
        """Decode the secure sum: centred integers / scale is the noisy clipped sum; it
        is divided by the expected batch and stepped as central noise's is."""
        res = self._secure
        owners_of = self._requested
        alive = [o for n in res.survivors for o in owners_of.get(n, [])]
        for nid, reason in sorted(res.dropped.items()):
            log(WARNING, "round %d: node %d (owners %s) left the secure sum: %s", server_round, nid,
                owners_of.get(nid, [])[:5], reason)
        self.last_drop_reasons = list(res.dropped.values())
        info = {"valid-owners": len(alive) if res.total is not None else 0,
                "dropped-owners": sum(len(o) for o in owners_of.values()) - len(alive), "zeroed-owners": 0}
        self.last_round_info = dict(info)
        if res.total is None:
            log(WARNING, "round %d skipped: %s; its privacy cost is still charged", server_round, res.stopped)
            self.last_round_info["skipped"] = True
            return None, MetricRecord(info)
        assert self.schedule is not None
        parts = res.total[1:]  # SecAgg+'s first entry is its weight factor
        shapes = [tuple(spec.shape) for spec in self.spec.values()]
        if [tuple(a.shape) for a in parts] != shapes:
            raise RuntimeError(f"the secure sum's shapes {[a.shape for a in parts][:3]} are not the model's")
        expected = self.schedule.server_rate * self.schedule.num_units
        current = [self._current[k].numpy() for k in self.spec]
        new = [(c - self.cfg.learning_rate * (from_field(a).astype(np.float64) / self.schedule.scale) / expected)
               .astype(c.dtype) for c, a in zip(current, parts, strict=True)]
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

