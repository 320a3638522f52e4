"""A party's own guard against an untrusted server: accept only the releases it
agreed to, keep its own ledger on its own disk, refuse everything else.

Where the server is not trusted, it is still the server that tells each party (a
JointDP owner under local noise, a subject-level silo) every round which sampling
rate, how many noisy steps and which noise multiplier to use. A party therefore
derives what it accepts from what it knows itself (its run config, its own data
size), as an :class:`AgreedRelease`, and checks every :class:`Instruction` against
it *before* any data is touched: a non-positive or non-finite noise multiplier, a
larger sampling rate or more steps than agreed, a round outside the agreed ones, or
less noise than agreed is refused. A party also keeps its own ledger of what it has
released (:class:`PartyLedger`) and refuses a release that would take it over its
budget (and, where it agreed to one release per round, a round it already
released), whatever the server asks.

:func:`charge` runs these checks for every party a message addresses and is all or
nothing: one refusal refuses the message, and nobody's ledger is charged; otherwise
every ledger is charged and saved before anything is trained. Refusal fails closed:
the node trains nothing, sends nothing, and replies with an error naming the reason
(:class:`InstructionRefused`).

The ledger lives in ``context.state`` and, when the node config sets ``state-dir``,
in ``<state-dir>/<party>s/ledger-<id>.json`` (:class:`LedgerStore`): one file per
party, whatever the run's unit, neighbouring relation or delta. The path depends only
on what the node controls, its ``state-dir`` and the party's id, never on the session,
round, noise, rates or terms a run names: a server that announces a new session, or a
new run on the same node, finds the party's spent epsilon where it left it. The ledger
records the terms it counts in, the node's policy's unit, relation and delta
(:mod:`flwr_jdp.privacy.policy`), and is always accounted at that delta; a ledger
recorded in other terms is refused, not re-read (the release could not be charged in
the policy's terms), and so is a ledger of the layout before this one
(``<party>s-<unit>-<neighbouring>/``), named by its path: its operator moves it to the
new path if its unit and relation are the policy's. A node operator who means to
start a new budget points ``state-dir`` elsewhere. The accountant is the run's (every
accountant here gives a valid upper bound).

Used by JointDP's owners (:mod:`flwr_jdp.joint_dp.owner_guard`,
:mod:`flwr_jdp.joint_dp.owner_store`) and subject-level silos
(:mod:`flwr_jdp.subject.silo_guard`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dp_accounting as dpa
from flwr.app import ConfigRecord, Context

from . import events as ev
from .accountants import epsilon
from .ledger import PrivacyLedger
from .units import PrivacyUnit

#: Relative slack on the comparisons with the agreement (float rounding between the
#: server's computation and the party's, which use the same formula).
TOLERANCE = 1e-9

#: The one scope of a party's own ledger.
SELF_SCOPE = "self"


class InstructionRefused(RuntimeError):
    """A party refuses a training instruction (the message names the reason)."""


@dataclass(frozen=True)
class Instruction:
    """What the server asks one party to release this round."""

    server_round: int
    sample_rate: float
    steps: int
    noise_multiplier: float


@dataclass(frozen=True)
class AgreedRelease:
    """The per-round release a party accepts, derived from what it knows.

    ``max_sample_rate`` and ``max_steps`` bound the DP-SGD schedule (the owner unit
    releases one Gaussian update per round; its rate and local steps do not enter the
    guarantee and are not checked). ``fixed_noise`` is the smallest noise multiplier
    accepted; 0 (a noise multiplier the server calibrates) accepts any ``z`` whose
    ``rounds`` rounds stay within ``budget``. ``once_per_round``: a round the party's
    ledger already holds is refused. ``party``, ``rate_from``, ``steps_from``,
    ``rounds_from`` and ``noise_from`` name the party and the config keys a refusal
    points to."""

    unit: PrivacyUnit | str
    max_sample_rate: float
    max_steps: int
    fixed_noise: float
    rounds: int
    budget: float
    delta: float
    accountant: str
    neighbouring: str = "add-remove"
    party: str = "owner"
    rate_from: str = "batch-size and this owner's data size"
    steps_from: str = "local-epochs"
    rounds_from: str = "num-rounds"
    noise_from: str = "noise-multiplier"
    once_per_round: bool = False

    def event(self, instruction: Instruction) -> dpa.DpEvent:
        """The party's release event under ``instruction``."""
        if self.unit == PrivacyUnit.OWNER:
            return ev.gaussian(instruction.noise_multiplier)
        return ev.dp_sgd(instruction.noise_multiplier, instruction.sample_rate, instruction.steps)

    def check(self, instruction: Instruction) -> str | None:
        """Why ``instruction`` is refused, or None if it is within the agreement."""
        z = instruction.noise_multiplier
        if not (math.isfinite(z) and z > 0):
            return f"noise multiplier {z!r} is not a positive number"
        return self.check_schedule(instruction) or self.check_noise(instruction)

    def check_schedule(self, instruction: Instruction) -> str | None:
        """Why the sampling rate, steps or round of ``instruction`` are refused, or None."""
        q, steps = instruction.sample_rate, instruction.steps
        if self.unit != PrivacyUnit.OWNER:
            if not (math.isfinite(q) and 0 < q <= self.max_sample_rate * (1 + TOLERANCE)):
                return f"sampling rate {q!r} is above the agreed {self.max_sample_rate:.6g} (from {self.rate_from})"
            if not 0 < steps <= self.max_steps:
                return f"{steps} steps per round, agreed at most {self.max_steps} (from {self.steps_from})"
        if not 1 <= instruction.server_round <= self.rounds:
            return (f"round {instruction.server_round} is outside the agreed 1..{self.rounds} "
                    f"({self.rounds_from})")
        return None

    def check_noise(self, instruction: Instruction) -> str | None:
        """Why the noise multiplier of ``instruction`` is too small, or None."""
        z = instruction.noise_multiplier
        if self.fixed_noise > 0:
            if z < self.fixed_noise * (1 - TOLERANCE):
                return f"noise multiplier {z:.6g} is below the agreed {self.noise_from} {self.fixed_noise:.6g}"
            return None
        if math.isinf(self.budget):
            return None
        whole = dpa.SelfComposedDpEvent(self.event(instruction), self.rounds)
        spent = epsilon(whole, self.delta, self.accountant, self.neighbouring)
        if spent > self.budget * (1 + TOLERANCE):
            return (f"noise multiplier {z:.6g} is too small: {self.rounds} rounds of it would spend "
                    f"epsilon {spent:.4f} > the {self.party}'s budget {self.budget:g} at delta {self.delta:g}")
        return None


class PartyLedger:
    """What one party has released, accounted by the party itself.

    A :class:`~flwr_jdp.privacy.ledger.PrivacyLedger` with one scope; it is kept
    as JSON (in the node's ``context.state``, and on the node's disk when it has a
    ``state-dir``), recorded and saved *before* the release leaves the party."""

    def __init__(self, budget: float, delta: float, accountant: str, unit: str,
                 state: dict[str, Any] | None = None, neighbouring: str = "add-remove",
                 party: str = "owner") -> None:
        self.party = party
        self.ledger = PrivacyLedger(delta=delta, accountant=accountant, unit=unit, budget=budget,
                                    neighbouring=neighbouring)
        if state:
            # the events are re-accounted with this run's accountant, at the ledger's own delta
            self.ledger.load_state_dict(dict(state, accountant=accountant))

    @classmethod
    def from_json(cls, text: str | None, agreed: AgreedRelease, unit: str) -> PartyLedger:
        return cls(agreed.budget, agreed.delta, agreed.accountant, unit,
                   json.loads(text) if text else None, agreed.neighbouring, agreed.party)

    def to_json(self) -> str:
        return json.dumps(self.ledger.state_dict())

    @property
    def releases(self) -> int:
        """Number of rounds released so far."""
        return len(self.ledger.rounds)

    def released(self, server_round: int) -> bool:
        """Whether round ``server_round`` was released already."""
        return any(int(r["round"]) == int(server_round) for r in self.ledger.rounds)

    def epsilon(self) -> float:
        return self.ledger.epsilon()

    def check(self, event: dpa.DpEvent) -> str | None:
        """Why releasing ``event`` is refused (over budget), or None."""
        if self.ledger.would_exceed({SELF_SCOPE: event}):
            return (f"releasing would spend epsilon {self.ledger.epsilon({SELF_SCOPE: event}):.4f} > "
                    f"the {self.party}'s budget {self.ledger.budget:g} ({self.releases} rounds released)")
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


@dataclass(frozen=True)
class LedgerStore:
    """Where the parties of one kind (``party``: ``owner``, ``silo``) keep their
    ledgers on a node: ``context.state[<state_key>.<id>]``, and
    ``<state-dir>/<party>s/ledger-<id>.json`` when the node config sets ``state-dir``."""

    party: str
    state_key: str

    def path(self, context: Context, party_id: int) -> Path | None:
        """The ledger's file on the node's disk (None without a ``state-dir``)."""
        root = context.node_config.get("state-dir")
        if not root:
            return None
        return Path(str(root)) / f"{self.party}s" / f"ledger-{int(party_id)}.json"

    def load(self, context: Context, party_id: int, agreed: AgreedRelease, unit: str) -> PartyLedger:
        """The party's record of its releases: ``context.state`` (this Flower run),
        else the node's ``state-dir`` (after a restart, whatever session or run the
        server names now), else empty. Refused (:class:`InstructionRefused`) if it
        counts in other terms than ``agreed``'s (unit, relation, delta), or if the
        ``state-dir`` holds the party's ledger in the old layout."""
        key = f"{self.state_key}.{int(party_id)}"
        path = self.path(context, party_id)
        where = "this run's ledger"
        text = None
        if path is not None:
            old = sorted(path.parent.parent.glob(f"{self.party}s-*/{path.name}"))
            if old:
                raise InstructionRefused(
                    f"{self.party} {party_id}'s ledger is in the old layout at {old[0]}: move it to {path} if it "
                    f"counts in this node's policy's unit and relation ({unit}, {agreed.neighbouring}); otherwise "
                    "its releases cannot be charged in the policy's terms (point state-dir elsewhere only to "
                    "start a new budget knowingly)")
        if key in context.state:
            text = str(context.state[key]["state"])
        elif path is not None and path.is_file():
            text, where = path.read_text(), str(path)
        state = json.loads(text) if text else None
        if state:
            terms = {"unit": str(unit), "neighbouring": agreed.neighbouring, "delta": float(agreed.delta)}
            recorded = {"neighbouring": "add-remove", **{k: state[k] for k in terms if k in state}}
            wrong = [f"{k}={recorded.get(k)!r} (policy: {v!r})" for k, v in terms.items() if recorded.get(k) != v]
            if wrong:
                raise InstructionRefused(f"{self.party} {party_id}'s ledger ({where}) counts in other terms than "
                                         f"this node's policy: {', '.join(wrong)}; its releases cannot be charged "
                                         "in the policy's terms")
        return PartyLedger(agreed.budget, agreed.delta, agreed.accountant, unit, state, agreed.neighbouring,
                           agreed.party)

    def save(self, context: Context, party_id: int, ledger: PartyLedger) -> None:
        """Keep the party's ledger in ``context.state`` and on the node's disk."""
        context.state[f"{self.state_key}.{int(party_id)}"] = ConfigRecord({"state": ledger.to_json()})
        path = self.path(context, party_id)
        if path is not None:
            ledger.save(path)


def charge(context: Context, store: LedgerStore, requests: Mapping[int, tuple[AgreedRelease, Instruction]],
           unit: str, note: str = "") -> None:
    """Each party checks its instruction against its agreement and its own ledger,
    then records the release in its ledger and saves it, before anything is trained.
    Any refusal refuses the whole message: nothing is recorded, trained or sent
    (:class:`InstructionRefused` names every party's reason)."""
    reasons: list[str] = []
    charges: dict[int, tuple[PartyLedger, dpa.DpEvent]] = {}
    for pid, (agreed, instruction) in requests.items():
        ledger = store.load(context, pid, agreed, unit)
        reason = agreed.check(instruction)
        if reason is None and agreed.once_per_round and ledger.released(instruction.server_round):
            reason = f"round {instruction.server_round} was released already"
        if reason is None:
            event = agreed.event(instruction)
            reason = ledger.check(event)
            charges[pid] = (ledger, event)
        if reason:
            reasons.append(f"{agreed.party} {pid}: {reason}")
    if reasons:
        raise InstructionRefused("; ".join(reasons))
    for pid, (ledger, event) in charges.items():
        ledger.record(requests[pid][1].server_round, event, note=note)
        store.save(context, pid, ledger)


__all__ = ["SELF_SCOPE", "TOLERANCE", "AgreedRelease", "Instruction", "InstructionRefused", "LedgerStore",
           "PartyLedger", "charge"]
