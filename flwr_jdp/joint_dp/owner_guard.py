"""The owner's side of the guarantee under local noise: check every instruction,
keep one's own ledger, refuse what was not agreed.

With ``noise-placement = "local"`` the server is not trusted, yet it is the server
that tells each owner, every round, its sampling rate ``q``, its number of noisy
steps and the noise multiplier ``z``. An owner therefore derives what it will
accept from what it knows itself, before any data is touched:

- the run config it was started with (unit, batch size, epochs, rounds, target
  epsilon, delta, accountant, and ``noise-multiplier`` when it is fixed),
- its own data size (records and users),
- optionally its node's own cap, node config ``max-epsilon`` (the owner's budget
  is then the smaller of that and the run's ``target-epsilon``). The owner reports
  the cap at set-up and the server asks it for a noise multiplier calibrated for
  it (:mod:`flwr_jdp.joint_dp.budgets`); the check below is the same either way.

From these it computes the schedule the server must follow (:class:`AgreedRelease`,
the same formula as :func:`flwr_jdp.joint_dp.schedule.build_schedule`) and refuses,
before training, an instruction that is missing a key, asks for a larger sampling
rate or more steps than that schedule, or brings less noise than agreed: a fixed
``noise-multiplier`` must be met, and a calibrated one must keep ``rounds`` agreed
rounds within the budget with the owner's own accountant. An owner also keeps its
own ledger of what it has released (:class:`OwnerLedger`) and refuses a release
that would take it over its budget, whatever the server asks (extra rounds, a
restarted session that re-runs a round).

Refusal fails closed: the owner trains nothing, releases nothing, records nothing,
and its node replies with an error that names the reason (the server logs it and
drops the owner for the round).

The check, the ledger and where it is kept are the shared guard of
:mod:`flwr_jdp.privacy.guard` (subject-level silos use the same); this module derives
an owner's agreement from its run config and size. The ledger on the node's disk is
keyed by the node's ``state-dir``, the owner and the privacy unit, never by the
session the server names (:mod:`flwr_jdp.joint_dp.owner_store`).
"""

from __future__ import annotations

from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.privacy.guard import (
    SELF_SCOPE,
    TOLERANCE,
    AgreedRelease,
    Instruction,
    InstructionRefused,
    PartyLedger,
)
from flwr_jdp.privacy.units import NoisePlacement

#: An owner's own ledger (the shared guard's party ledger, worded for an owner).
OwnerLedger = PartyLedger


def agreed_release(cfg: JobConfig, size: OwnerSize, max_epsilon: float | None = None) -> AgreedRelease:
    """The release an owner of ``size`` accepts under the run config ``cfg`` (local
    noise), with its budget capped by its node's ``max_epsilon`` if given."""
    if cfg.placement is not NoisePlacement.LOCAL:
        raise ValueError("owners check the server's instructions under local noise only")
    schedule = build_schedule(cfg, {0: size})
    budget = cfg.target_epsilon if max_epsilon is None else min(cfg.target_epsilon, float(max_epsilon))
    return AgreedRelease(
        unit=cfg.unit, max_sample_rate=float(schedule.owner_rates[0]),
        max_steps=int(schedule.owner_steps[0]), fixed_noise=float(cfg.noise_multiplier),
        rounds=int(cfg.num_rounds), budget=float(budget), delta=float(cfg.delta),
        accountant=cfg.accountant, neighbouring=cfg.neighbouring,
    )


__all__ = ["SELF_SCOPE", "TOLERANCE", "AgreedRelease", "Instruction", "InstructionRefused", "OwnerLedger",
           "agreed_release"]
