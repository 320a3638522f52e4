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

Where the ledger lives (:class:`LedgerStore`): with the node config's ``state-dir``,
in ``<state-dir>/<party>s/``, and nowhere else: every charge takes an exclusive lock
(``fcntl.flock`` on a lock file beside the ledger, which holds across processes: a
SuperNode runs each run's ClientApp in its own process, and several runs at once),
reads the file, checks, records and saves it atomically before the lock is released,
so runs served at the same time see each other's releases. Under a node's own policy
(:mod:`flwr_jdp.privacy.policy`) every party the node hosts charges the node's one
ledger, ``ledger-node.json`` (:data:`NODE_LEDGER`): which parties a node hosts, and
which of its records each one holds, is the run's choice (``num-owners``,
``partition-id`` / ``num-partitions``), which the node cannot verify is a disjoint
partition, so the cap holds for the sequential composition of every release the node
makes, whatever the run calls its parties; the per-party ledgers it finds beside it
(releases made without a policy) are composed in. Without a policy (the run config
trusted) each party keeps its own, ``ledger-<id>.json``; without a ``state-dir`` (no
policy then: a policy needs one) in ``context.state``, which lives as long as the
Flower run. The path depends only on what the node controls, its ``state-dir`` and
the party's id, never on the session, round, noise, rates or terms a run names: a
server that announces a new session, or a new run on the same node, finds the spent
epsilon where it left it. The ledger
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

import fcntl
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
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

#: The id of the one ledger every party of a node charges under the node's policy
#: (``<state-dir>/<party>s/ledger-node.json``).
NODE_LEDGER = "node"

LedgerId = int | str


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
    as JSON (on the node's disk when it has a ``state-dir``, else in the node's
    ``context.state``), recorded and saved *before* the release leaves the party.
    ``carried``: releases recorded in other ledgers of the node (a node's ledger
    composes in its parties' own ledgers), counted in its epsilon, never saved with it."""

    def __init__(self, budget: float, delta: float, accountant: str, unit: str,
                 state: dict[str, Any] | None = None, neighbouring: str = "add-remove",
                 party: str = "owner", carried: list[dpa.DpEvent] | None = None) -> None:
        self.party = party
        self.carried = list(carried or [])
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

    def epsilon(self, event: dpa.DpEvent | None = None) -> float:
        """Epsilon spent (after releasing ``event``, if given), the carried releases included."""
        planned = {SELF_SCOPE: event} if event is not None else None
        if not self.carried:
            return self.ledger.epsilon(planned)
        whole = ev.compose([self.ledger.scope_event(SELF_SCOPE, event), *self.carried])
        return epsilon(whole, self.ledger.delta, self.ledger.accountant, self.ledger.neighbouring)

    def check(self, event: dpa.DpEvent) -> str | None:
        """Why releasing ``event`` is refused (over budget), or None."""
        budget = self.ledger.budget
        if budget is None or math.isinf(budget):
            return None
        spent = self.epsilon(event)
        if spent > budget * (1 + TOLERANCE):
            return (f"releasing would spend epsilon {spent:.4f} > the {self.party}'s budget {budget:g} "
                    f"({self.releases} rounds released)")
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
    ledgers on a node: ``<state-dir>/<party>s/ledger-<id>.json`` when the node config
    sets ``state-dir`` (the file is the only truth, read and written under
    :meth:`locked`), else ``context.state[<state_key>.<id>]`` (this Flower run only).
    ``<id>`` is the party's, or :data:`NODE_LEDGER` for the node's one ledger."""

    party: str
    state_key: str

    def path(self, context: Context, ledger_id: LedgerId) -> Path | None:
        """The ledger's file on the node's disk (None without a ``state-dir``).
        Refused (:class:`InstructionRefused`) if the ``state-dir`` holds it in the old
        layout, before anything is written there."""
        root = context.node_config.get("state-dir")
        if not root:
            return None
        path = Path(str(root)) / f"{self.party}s" / f"ledger-{_name(ledger_id)}.json"
        old = sorted(path.parent.parent.glob(f"{self.party}s-*/{path.name}"))
        if old:
            raise InstructionRefused(
                f"{self.label(ledger_id)} is in the old layout at {old[0]}: move it to {path} if it counts in this "
                "node's policy's unit and relation; otherwise its releases cannot be charged in the policy's terms "
                "(point state-dir elsewhere only to start a new budget knowingly)")
        return path

    def label(self, ledger_id: LedgerId) -> str:
        return f"this node's {self.party}s' ledger" if ledger_id == NODE_LEDGER else f"{self.party} {ledger_id}'s ledger"

    @contextmanager
    def locked(self, context: Context, ledger_id: LedgerId) -> Iterator[None]:
        """Hold the ledger's file exclusively (``fcntl.flock`` on ``.<file>.lock`` beside
        it: every process of the node, every run it serves, waits its turn); nothing to
        hold without a ``state-dir``."""
        path = self.path(context, ledger_id)
        if path is None:
            yield
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as fh:  # noqa: PTH123
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def load(self, context: Context, ledger_id: LedgerId, agreed: AgreedRelease, unit: str) -> PartyLedger:
        """The record of the releases: the node's ``state-dir`` file if it sets one
        (whatever session or run the server names), else ``context.state`` (this Flower
        run), else empty. The node's ledger (:data:`NODE_LEDGER`) carries the releases of
        the per-party ledgers beside it. Refused (:class:`InstructionRefused`) if a
        ledger counts in other terms than ``agreed``'s (unit, relation, delta), or if the
        ``state-dir`` holds it in the old layout (:meth:`path`). A caller that charges
        holds :meth:`locked`."""
        path = self.path(context, ledger_id)
        carried: list[dpa.DpEvent] = []
        if path is None:
            record = context.state.get(f"{self.state_key}.{_name(ledger_id)}")
            text, where = (str(record["state"]) if record is not None else None), "this run's ledger"
        else:
            text, where = (path.read_text() if path.is_file() else None), str(path)
            if ledger_id == NODE_LEDGER:
                for other in sorted(path.parent.glob("ledger-*.json")):
                    pid = other.stem.removeprefix("ledger-")
                    if pid.isdigit():
                        state = self._checked(json.loads(other.read_text()), f"{self.label(int(pid))} ({other})",
                                              agreed, unit)
                        mine = PartyLedger(math.inf, agreed.delta, agreed.accountant, unit, state,
                                           agreed.neighbouring)
                        carried.append(mine.ledger.scope_event(SELF_SCOPE))
        state = self._checked(json.loads(text), f"{self.label(ledger_id)} ({where})", agreed, unit) if text else None
        party = "node" if ledger_id == NODE_LEDGER else agreed.party
        return PartyLedger(agreed.budget, agreed.delta, agreed.accountant, unit, state, agreed.neighbouring,
                           party, carried)

    @staticmethod
    def _checked(state: dict[str, Any], which: str, agreed: AgreedRelease, unit: str) -> dict[str, Any]:
        """``state`` (of the ledger ``which``) if it counts in ``agreed``'s terms, else
        :class:`InstructionRefused`."""
        terms = {"unit": str(unit), "neighbouring": agreed.neighbouring, "delta": float(agreed.delta)}
        recorded = {"neighbouring": "add-remove", **{k: state[k] for k in terms if k in state}}
        wrong = [f"{k}={recorded.get(k)!r} (policy: {v!r})" for k, v in terms.items() if recorded.get(k) != v]
        if wrong:
            raise InstructionRefused(f"{which} counts in other terms than this node's policy: {', '.join(wrong)}; "
                                     "its releases cannot be charged in the policy's terms")
        return state

    def save(self, context: Context, ledger_id: LedgerId, ledger: PartyLedger) -> None:
        """Write the ledger to the node's disk (atomically), or without a ``state-dir``
        keep it in ``context.state``."""
        path = self.path(context, ledger_id)
        if path is None:
            context.state[f"{self.state_key}.{_name(ledger_id)}"] = ConfigRecord({"state": ledger.to_json()})
        else:
            ledger.save(path)


def _name(ledger_id: LedgerId) -> str:
    return NODE_LEDGER if ledger_id == NODE_LEDGER else str(int(ledger_id))


def charge(context: Context, store: LedgerStore, requests: Mapping[int, tuple[AgreedRelease, Instruction]],
           unit: str, note: str = "", *, node_ledger: bool = False) -> None:
    """Each party checks its instruction against its agreement, and its ledger checks
    the release, then the release is recorded in the ledger and saved, before anything
    is trained. ``node_ledger`` (under a node's policy): every party charges the node's
    one ledger (:data:`NODE_LEDGER`), which checks and records the composition of their
    releases; else each party its own. Every ledger file is held (:meth:`LedgerStore.locked`)
    from before it is read until it is saved. Any refusal refuses the whole message:
    nothing is recorded, trained or sent (:class:`InstructionRefused` names every
    reason)."""
    groups: dict[LedgerId, list[int]] = {}
    for pid in requests:
        groups.setdefault(NODE_LEDGER if node_ledger else pid, []).append(pid)
    with ExitStack() as stack:
        for lid in sorted(groups, key=str):  # one order in every process
            stack.enter_context(store.locked(context, lid))
        reasons: list[str] = []
        charges: dict[LedgerId, tuple[PartyLedger, dpa.DpEvent, int]] = {}
        for lid, pids in groups.items():
            first = requests[pids[0]][0]
            budget = min(requests[pid][0].budget for pid in pids)
            ledger = store.load(context, lid, replace(first, budget=budget), unit)
            events = []
            for pid in pids:
                agreed, instruction = requests[pid]
                reason = agreed.check(instruction)
                if reason is None and agreed.once_per_round and ledger.released(instruction.server_round):
                    reason = f"round {instruction.server_round} was released already"
                if reason:
                    reasons.append(f"{agreed.party} {pid}: {reason}")
                else:
                    events.append(agreed.event(instruction))
            if len(events) < len(pids):
                continue
            event = ev.compose(events)
            reason = ledger.check(event)
            if reason:
                reasons.append(f"{first.party} {pids[0]}: {reason}" if lid != NODE_LEDGER else
                               f"{first.party}s {pids} ({store.label(lid)}): {reason}")
            charges[lid] = (ledger, event, requests[pids[0]][1].server_round)
        if reasons:
            raise InstructionRefused("; ".join(reasons))
        for lid, (ledger, event, server_round) in charges.items():
            who = f"({store.party}s {groups[lid]})" if lid == NODE_LEDGER else ""
            ledger.record(server_round, event, note=" ".join(p for p in (note, who) if p))
            store.save(context, lid, ledger)


__all__ = ["NODE_LEDGER", "SELF_SCOPE", "TOLERANCE", "AgreedRelease", "Instruction", "InstructionRefused", "LedgerStore",
           "PartyLedger", "charge"]
