"""The owner's side of the guarantee under local noise: check every instruction,
keep one's own ledger, refuse what was not agreed.

With ``noise-placement = "local"`` the server is not trusted, yet it is the server
that tells each owner, every round, its sampling rate ``q``, its number of noisy
steps and the noise multiplier ``z``. An owner therefore derives what it will
accept from what it knows itself, before any data is touched:

- the run config it was started with (unit, batch size, epochs, rounds, target
  epsilon, delta, accountant, and ``noise-multiplier`` when it is fixed),
- its own data size (records and users),
- its node's policy (:mod:`flwr_jdp.privacy.policy`, :func:`owner_policy`): the
  run's delta, unit, relation and noise placement must be the policy's, its ledger
  is accounted at the policy's delta, and its budget is the smaller of the policy's
  ``max-epsilon`` and the run's ``target-epsilon``. The owner reports the cap at
  set-up and the server asks it for a noise multiplier calibrated for it
  (:mod:`flwr_jdp.joint_dp.budgets`); the check below is the same either way. A node
  without a policy trusts the run config with all of these.

From these it computes the schedule the server must follow (:class:`AgreedRelease`,
the same formula as :func:`flwr_jdp.joint_dp.schedule.build_schedule`) and refuses,
before training, an instruction that is missing a key, asks for a larger sampling
rate or more steps than that schedule, or brings less noise than agreed: a fixed
``noise-multiplier`` must be met, and a calibrated one must keep ``rounds`` agreed
rounds within the budget with the owner's own accountant. An owner also keeps its
own ledger of what it has released (:class:`OwnerLedger`) and refuses a release
that would take it over its budget, whatever the server asks (extra rounds, a
restarted session that re-runs a round).

Under central noise and a node's own policy the same check and ledger apply to the
release the trusted server claims for the owner's round (:func:`agreed_release`), so
the policy's cap covers central runs too.

Refusal fails closed: the owner trains nothing, releases nothing, records nothing,
and its node replies with an error that names the reason (the server logs it and
drops the owner for the round).

The check, the ledger and where it is kept are the shared guard of
:mod:`flwr_jdp.privacy.guard` (subject-level silos use the same); this module derives
an owner's agreement from its run config and size. The ledger on the node's disk is
keyed by the node's ``state-dir`` and the owner only, never by the session or terms
the server names, and under its node's policy it is the node's one ledger, whichever
owner id the run gives (:mod:`flwr_jdp.joint_dp.owner_store`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context

from flwr_jdp.joint_dp.config import NAMESPACE, JobConfig
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.privacy.guard import (
    SELF_SCOPE,
    TOLERANCE,
    AgreedRelease,
    Instruction,
    InstructionRefused,
    PartyLedger,
)
from flwr_jdp.privacy.policy import OwnerPolicy, RunTerms, run_policy
from flwr_jdp.privacy.units import NoisePlacement

#: An owner's own ledger (the shared guard's party ledger, worded for an owner).
OwnerLedger = PartyLedger


#: The run-config key of each term of a run a policy checks (:class:`RunTerms`).
TERM_KEYS = {"delta": "delta", "unit": "privacy-unit", "neighbouring": "neighbouring",
             "placement": "noise-placement", "private": "method", "noise_seed": "noise-seed",
             "secure_noise": "secure-noise"}


def run_terms(cfg: JobConfig, run_config: Mapping[str, Any]) -> RunTerms:
    """What the run ``cfg`` asks of an owner, each term named by the run-config key as
    the run config spells it (``jdp.<key>`` in a user's app)."""
    keys = {t: f"{NAMESPACE}.{k}" if f"{NAMESPACE}.{k}" in run_config else k for t, k in TERM_KEYS.items()}
    return RunTerms(target_epsilon=float(cfg.target_epsilon), delta=float(cfg.delta), unit=cfg.privacy_unit,
                    neighbouring=cfg.neighbouring, placement=cfg.noise_placement, private=cfg.dp,
                    noise_seed=int(cfg.noise_seed), secure_noise=bool(cfg.secure_noise), keys=keys)


def owner_policy(context: Context, cfg: JobConfig) -> OwnerPolicy:
    """The policy the run ``cfg`` is held to on this owner's node
    (:func:`flwr_jdp.privacy.policy.run_policy`): raises :class:`InstructionRefused`
    if the run breaks it."""
    return run_policy(context.node_config, run_terms(cfg, context.run_config))


def agreed_release(cfg: JobConfig, size: OwnerSize, max_epsilon: float | None = None,
                   delta: float | None = None) -> AgreedRelease:
    """The release an owner of ``size`` accepts under the run config ``cfg``, with its
    budget capped by its node's ``max_epsilon`` if given, accounted at its policy's
    ``delta`` (default: the run's).

    Local noise: the owner's own DP-SGD schedule. Central noise (charged under a node's
    own policy only): the release the trusted server claims for the owner's round, one
    Poisson sample of its units at the rate the instruction names (the rate it samples
    at), one step, its clipped sum noised by the server with the instruction's ``z``:
    ``PoissonSampled(q, Gaussian(z))``; owner unit ``Gaussian(z)`` (its clipped update,
    no amplification claimed). The owner cannot see that noise added: its ledger
    records the server's claim."""
    if cfg.placement is NoisePlacement.DISTRIBUTED:
        raise ValueError("distributed noise is agreed in flwr_jdp.joint_dp.distributed.agreed_distributed")
    budget = cfg.target_epsilon if max_epsilon is None else min(cfg.target_epsilon, float(max_epsilon))
    common = {"unit": cfg.unit, "fixed_noise": float(cfg.noise_multiplier), "rounds": int(cfg.num_rounds),
              "budget": float(budget), "delta": float(cfg.delta if delta is None else delta),
              "accountant": cfg.accountant, "neighbouring": cfg.neighbouring}
    if cfg.placement is NoisePlacement.CENTRAL:
        return AgreedRelease(max_sample_rate=1.0, max_steps=1, rate_from="a probability",
                             steps_from="one clipped sum per round under central noise", **common)
    schedule = build_schedule(cfg, {0: size})
    return AgreedRelease(max_sample_rate=float(schedule.owner_rates[0]), max_steps=int(schedule.owner_steps[0]),
                         **common)


__all__ = ["SELF_SCOPE", "TERM_KEYS", "TOLERANCE", "AgreedRelease", "Instruction", "InstructionRefused",
           "OwnerLedger", "agreed_release", "owner_policy", "run_terms"]
