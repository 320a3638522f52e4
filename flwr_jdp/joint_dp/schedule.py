"""The accounting schedule: who releases what each round, as DpEvents.

From the configuration and the owners' data sizes (reported at set-up), the server
derives, before round 1, every owner's sampling rate and number of noisy steps per
round. The owners use exactly these values, and the ledger records exactly these
events, so the noise that is accounted is the noise that is added.

Per round (``z`` the noise multiplier; under local noise ``z`` may differ per owner,
see :mod:`flwr_jdp.joint_dp.budgets`):

- record/user unit, local noise: scope ``owner/<o>`` releases
  ``SelfComposed(PoissonSampled(q_o, Gaussian(z)), steps_o)`` with
  ``q_o = min(1, batch / units_o)`` and ``steps_o = round(epochs / q_o)``.
- record/user unit, central noise: scope ``server`` releases
  ``PoissonSampled(q, Gaussian(z))`` once, ``q`` the same for every owner.
- owner unit, local noise: scope ``owner/<o>`` releases ``Gaussian(z)`` when ``o``
  is selected (no amplification: the owner's release is observed directly).
- owner unit, central noise: scope ``server`` releases
  ``PoissonSampled(fraction, Gaussian(z))`` (owners are Poisson-sampled).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import dp_accounting as dpa

from flwr_jdp.joint_dp.config import JobConfig, minimum_survivors
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.privacy.ledger import SERVER_SCOPE, owner_scope
from flwr_jdp.privacy.skellam import SkellamPlan
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit


@dataclass(frozen=True)
class OwnerSize:
    """What an owner reports at set-up: its number of records and users."""

    num_records: int
    num_users: int


@dataclass(frozen=True)
class Schedule:
    """Per-owner sampling rate and steps per round, and the server's rate."""

    owner_rates: dict[int, float]
    owner_steps: dict[int, int]
    server_rate: float
    num_units: int  # total protected units (for central denominators)
    #: Distributed noise: the number of shared parameters and the scale (gamma) of the
    #: integer encoding, fixed at set-up (:mod:`flwr_jdp.privacy.skellam`).
    dim: int = 0
    scale: float = 0.0

    def round_events(self, cfg: JobConfig, z: float | Mapping[int, float],
                     selected: list[int]) -> dict[str, dpa.DpEvent]:
        """Scope -> event of one round in which ``selected`` owners train; ``z`` one
        noise multiplier, or (local noise) one per owner."""
        if not cfg.dp:
            return {}
        if cfg.placement is NoisePlacement.CENTRAL:
            return {SERVER_SCOPE: ev.dp_sgd(z, self.server_rate, 1)}
        if cfg.placement is NoisePlacement.DISTRIBUTED:
            if not self.dim:
                raise ValueError("distributed noise: the schedule has no dimension yet (set at set-up)")
            return {SERVER_SCOPE: owner_plan(cfg, z, self.dim, self.scale).event(self.server_rate)}
        zs = z if isinstance(z, Mapping) else dict.fromkeys(selected, z)
        if cfg.unit is PrivacyUnit.OWNER:
            return {owner_scope(o): ev.gaussian(zs[o]) for o in selected}
        return {
            owner_scope(o): ev.dp_sgd(zs[o], self.owner_rates[o], self.owner_steps[o])
            for o in selected
        }

    def restricted(self, owners: Iterable[int]) -> Schedule:
        """The schedule of ``owners`` alone (the same rates, steps and server rate)."""
        owners = list(owners)
        return Schedule({o: self.owner_rates[o] for o in owners}, {o: self.owner_steps[o] for o in owners},
                        self.server_rate, self.num_units)

    def run_events(self, cfg: JobConfig, z: float, rounds: int) -> list[dpa.DpEvent]:
        """Distinct whole-run events (``rounds`` rounds, every owner every round)."""
        per_round = self.round_events(cfg, z, sorted(self.owner_rates))
        distinct = {ev.canonical(e): e for e in per_round.values()}
        return [dpa.SelfComposedDpEvent(e, rounds) for e in distinct.values()]


def units_of(cfg: JobConfig, size: OwnerSize) -> int:
    """Number of protected units an owner holds."""
    if cfg.unit is PrivacyUnit.USER:
        return size.num_users
    if cfg.unit is PrivacyUnit.OWNER:
        return 1
    return size.num_records


def batch_units(cfg: JobConfig) -> float:
    """Expected units per DP batch: ``batch-size`` records, or under the user unit
    ``user-batch-size`` users (0: as many users as fill ``batch-size`` records,
    ``batch-size / records-per-user``).

    The noise a batch gets is ``z C`` on the sum over its units, so the noise per
    unit of signal is ``z / batch_units``; at a fixed epsilon a batch of few users
    (small q) needs less ``z`` but takes many more steps, and the noise that
    accumulates per epoch grows as ``1 / q**2`` (for ``z`` roughly proportional to
    ``q sqrt(steps)``). ``user-batch-size`` lets the user unit keep as many units
    per batch as the record unit instead of as many records."""
    if cfg.unit is PrivacyUnit.USER:
        return cfg.user_batch_size or cfg.batch_size / cfg.records_per_user
    return float(cfg.batch_size)


def build_schedule(cfg: JobConfig, sizes: dict[int, OwnerSize]) -> Schedule:
    """Sampling rates and steps for every owner, from the set-up sizes."""
    rates, steps = {}, {}
    total = sum(units_of(cfg, s) for s in sizes.values())
    for o, size in sizes.items():
        units = max(1, units_of(cfg, size))
        q = min(1.0, batch_units(cfg) / units)
        rates[o] = q
        steps[o] = max(1, round(cfg.local_epochs / q))
    if cfg.unit is PrivacyUnit.OWNER:
        server_rate = cfg.fraction_train
    else:
        server_rate = min(1.0, batch_units(cfg) * len(sizes) / max(1, total))
    return Schedule(rates, steps, server_rate, total)


def calibrate_schedule(cfg: JobConfig, schedule: Schedule) -> float:
    """Smallest noise multiplier keeping the whole run within ``target-epsilon``.

    Many owners may have distinct (rate, steps); the bisection runs on the few
    worst by RDP (add/remove; only a ranking), then every distinct event is checked
    with the configured accountant under the configured ``neighbouring`` relation,
    adding any that still exceeds the target and repeating.
    """
    def all_events(z: float) -> list[dpa.DpEvent]:
        return schedule.run_events(cfg, z, cfg.num_rounds)

    def ranked(z: float) -> list[int]:
        scores = [epsilon(e, cfg.delta, "rdp") for e in all_events(z)]
        return sorted(range(len(scores)), key=lambda i: -scores[i])

    chosen = set(ranked(1.0)[:3])
    while True:
        z = calibrate(
            cfg.target_epsilon, cfg.delta,
            lambda s: [all_events(s)[i] for i in sorted(chosen)], cfg.accountant,
            relation=cfg.neighbouring,
        )
        over = [i for i, e in enumerate(all_events(z))
                if epsilon(e, cfg.delta, cfg.accountant, cfg.neighbouring)
                > cfg.target_epsilon * (1 + 1e-9)]
        if not over:
            return z
        chosen.update(over)


def owner_plan(cfg: JobConfig, noise_multiplier: float, dim: int, scale: float) -> SkellamPlan:
    """The Skellam plan of a run under distributed noise: the server's and every
    owner's (same formula; an owner floors its share by its policy, see
    :func:`flwr_jdp.joint_dp.distributed.charge_distributed`)."""
    return SkellamPlan(
        clipping_norm=float(cfg.clipping_norm), scale=float(scale), dim=int(dim),
        noise_multiplier=float(noise_multiplier), num_owners=int(cfg.num_owners),
        min_survivors=minimum_survivors(cfg.num_owners, cfg.dropout_tolerance),
        colluding=int(cfg.colluding_owners))
