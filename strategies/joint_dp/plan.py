"""The release plan of :class:`~flwr_jdp.strategies.JointDP`: the noise multiplier calibrated
for the whole run (and, under local noise, one per group of owners capped by their node,
:mod:`.budgets`), the owners selected each round, and the round's charge, recorded
before the instruction that asks for the release leaves the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import PrivacyBudgetExhausted

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.joint_dp.schedule import calibrate_schedule
from flwr_jdp.privacy.skellam import wrap_probability
from flwr_jdp.privacy.units import PrivacyUnit
from flwr_jdp.strategies.joint_dp.aggregation import _DP_WRAPPER


class ReleasePlan:
    """Calibration, selection and the charge before each round's instruction.

    A part of :class:`~flwr_jdp.strategies.JointDP` (which holds the state it uses).
    """

    def _calibrate(self) -> None:
        assert self.schedule is not None
        if self.cfg.dp and self.cfg.calibrate and self.noise_multiplier == 0.0:
            self.noise_multiplier = calibrate_schedule(self.cfg, self.schedule)
            log(INFO, "Calibrated noise multiplier %.4f for epsilon=%.3g at delta=%.3g over "
                "%d rounds (%s accountant)", self.noise_multiplier, self.cfg.target_epsilon,
                self.cfg.delta, self.cfg.num_rounds, self.cfg.accountant)
        self._plan_owner_budgets()  # local noise: owners capped by their node's max-epsilon
        if self.kind == protocol.KIND_SECURE_SUM:
            plan = self.secure_plan()
            log(INFO, "Distributed noise: each owner adds Skellam noise with mu=%.4g to its sum rounded at "
                "scale %.4g; planned for >= %d of %d owners surviving, %d colluding; wrap-around probability "
                "<= %.1e per round", plan.share_mu, plan.scale, plan.min_survivors, plan.num_owners,
                plan.colluding, wrap_probability(plan, self.max_units))

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
        planned = self.schedule.round_events(self.cfg, self.round_noise(selected), selected)
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
            if self.kind == protocol.KIND_SECURE_SUM:
                rec[protocol.SAMPLE_RATES] = [float(self.schedule.server_rate)] * len(owners)
                rec[protocol.STEPS] = [1] * len(owners)
                rec[protocol.SCALE] = float(self.schedule.scale)
            rec[protocol.NOISE_MULTIPLIER] = protocol.noise_value([self.noise_of(o) for o in owners])
            rec[protocol.SESSION] = self.session
            content = RecordDict({protocol.SHARED: arrays, protocol.CONFIG: rec})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages


