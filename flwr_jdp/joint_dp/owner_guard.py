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
  is then the smaller of that and the run's ``target-epsilon``).

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
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dp_accounting as dpa

from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.ledger import PrivacyLedger
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit

#: Relative slack on the comparisons with the agreed schedule (float rounding
#: between the server's computation and the owner's, which use the same formula).
TOLERANCE = 1e-9

#: The one scope of an owner's own ledger.
SELF_SCOPE = "self"


class InstructionRefused(RuntimeError):
    """An owner refuses a training instruction (the message names the reason)."""


@dataclass(frozen=True)
class Instruction:
    """What the server asks one owner to release this round."""

    server_round: int
    sample_rate: float
    steps: int
    noise_multiplier: float


@dataclass(frozen=True)
class AgreedRelease:
    """The per-round release an owner accepts, derived from what it knows.

    ``max_sample_rate`` and ``max_steps`` bound the DP-SGD schedule (record and
    user units; the owner unit releases one Gaussian update per round and its local
    steps do not enter the guarantee). ``fixed_noise`` is the run config's
    ``noise-multiplier`` (0: calibrated by the server; then any ``z`` is accepted
    whose ``rounds`` agreed rounds stay within ``budget``)."""

    unit: PrivacyUnit
    max_sample_rate: float
    max_steps: int
    fixed_noise: float
    rounds: int
    budget: float
    delta: float
    accountant: str
    neighbouring: str = "add-remove"

    def event(self, instruction: Instruction) -> dpa.DpEvent:
        """The owner's release event under ``instruction``."""
        if self.unit is PrivacyUnit.OWNER:
            return ev.gaussian(instruction.noise_multiplier)
        return ev.dp_sgd(instruction.noise_multiplier, instruction.sample_rate, instruction.steps)

    def check(self, instruction: Instruction) -> str | None:
        """Why ``instruction`` is refused, or None if it is within the agreement."""
        z, q, steps = instruction.noise_multiplier, instruction.sample_rate, instruction.steps
        if not (math.isfinite(z) and z > 0):
            return f"noise multiplier {z!r} is not a positive number"
        if self.unit is not PrivacyUnit.OWNER:
            if not (math.isfinite(q) and 0 < q <= self.max_sample_rate * (1 + TOLERANCE)):
                return (f"sampling rate {q!r} is above the agreed {self.max_sample_rate:.6g} "
                        "(from batch-size and this owner's data size)")
            if not 0 < steps <= self.max_steps:
                return f"{steps} steps per round, agreed at most {self.max_steps} (from local-epochs)"
        if not 1 <= instruction.server_round <= self.rounds:
            return f"round {instruction.server_round} is outside the agreed 1..{self.rounds} (num-rounds)"
        if self.fixed_noise > 0:
            if z < self.fixed_noise * (1 - TOLERANCE):
                return f"noise multiplier {z:.6g} is below the agreed noise-multiplier {self.fixed_noise:.6g}"
            return None
        whole = dpa.SelfComposedDpEvent(self.event(instruction), self.rounds)
        spent = epsilon(whole, self.delta, self.accountant, self.neighbouring)
        if spent > self.budget * (1 + TOLERANCE):
            return (f"noise multiplier {z:.6g} is too small: {self.rounds} rounds of it would spend "
                    f"epsilon {spent:.4f} > the owner's budget {self.budget:g} at delta {self.delta:g}")
        return None


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


class OwnerLedger:
    """What one owner has released, accounted by the owner itself.

    A :class:`~flwr_jdp.privacy.ledger.PrivacyLedger` with one scope; it is kept
    as JSON (in the node's ``context.state``, and on the node's disk when it has a
    ``state-dir``), recorded and saved *before* the release leaves the owner."""

    def __init__(self, budget: float, delta: float, accountant: str, unit: str,
                 state: dict[str, Any] | None = None, neighbouring: str = "add-remove") -> None:
        self.ledger = PrivacyLedger(delta=delta, accountant=accountant, unit=unit, budget=budget,
                                    neighbouring=neighbouring)
        if state:
            self.ledger.load_state_dict(state)

    @classmethod
    def from_json(cls, text: str | None, agreed: AgreedRelease, unit: str) -> OwnerLedger:
        return cls(agreed.budget, agreed.delta, agreed.accountant, unit,
                   json.loads(text) if text else None, agreed.neighbouring)

    def to_json(self) -> str:
        return json.dumps(self.ledger.state_dict())

    @property
    def releases(self) -> int:
        """Number of rounds released so far."""
        return len(self.ledger.rounds)

    def epsilon(self) -> float:
        return self.ledger.epsilon()

    def check(self, event: dpa.DpEvent) -> str | None:
        """Why releasing ``event`` is refused (over budget), or None."""
        if self.ledger.would_exceed({SELF_SCOPE: event}):
            return (f"releasing would spend epsilon {self.ledger.epsilon({SELF_SCOPE: event}):.4f} > "
                    f"the owner's budget {self.ledger.budget:g} ({self.releases} rounds released)")
        return None

    def record(self, server_round: int, event: dpa.DpEvent, note: str = "") -> None:
        self.ledger.record_round(server_round, {SELF_SCOPE: event}, note=note)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        with os.fdopen(fd, "w") as fh:
            fh.write(self.to_json())
        os.replace(tmp, path)


__all__ = ["AgreedRelease", "Instruction", "InstructionRefused", "OwnerLedger", "agreed_release"]
