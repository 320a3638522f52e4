"""The privacy ledger: every release of every mechanism, and the epsilon it costs.

Scopes
    A *scope* is a set of protected units that see the same releases. In ``local``
    placement each owner noises its own release, so each owner is a scope
    (``owner/<id>``); owners hold disjoint units, so by parallel composition the
    joint-DP epsilon of the run is the **maximum over scopes**. In ``central``
    placement the server's release touches every unit, so there is one scope
    (``server``). Horizontal composition (a subject at several silos) is a scope
    that composes the events of every silo holding it.

Events
    Each scope holds its sequence of ``dp_accounting.DpEvent`` releases; equal
    consecutive events are merged into a count. Epsilon at the configured delta is
    computed by PLD (default) or RDP over the sequential composition.

Persistence
    :meth:`save` writes the whole ledger as JSON (atomically); :meth:`load`
    restores it, so a restarted server continues from the epsilon it had spent.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dp_accounting as dpa

from . import events as ev
from .accountants import check_accountant, check_relation, epsilon, screened_max_epsilon

SERVER_SCOPE = "server"


def owner_scope(owner_id: int) -> str:
    """Scope name of one owner's units (local noise placement)."""
    return f"owner/{int(owner_id)}"


@dataclass
class PrivacyLedger:
    """Composed privacy events per scope, with epsilon by PLD or RDP.

    Parameters
    ----------
    delta : float
        The delta at which epsilon is reported, in (0, 1).
    accountant : str
        ``"pld"`` (default) or ``"rdp"``.
    unit : str
        The privacy unit every event protects (record, user, owner, subject).
    budget : float or None
        Epsilon budget; :meth:`would_exceed` compares against it.
    neighbouring : str
        ``"add-remove"`` (default) or ``"replace-one"`` (see
        :mod:`flwr_jdp.privacy.accountants`): what a neighbouring dataset changes.
    """

    delta: float
    accountant: str = "pld"
    unit: str = "record"
    budget: float | None = None
    neighbouring: str = "add-remove"
    scopes: dict[str, list[list[Any]]] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    _epsilon_cache: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        check_accountant(self.accountant)
        check_relation(self.neighbouring)

    # ------------------------------------------------------------------ record
    def record(self, scope: str, event: dpa.DpEvent) -> None:
        """Append one release ``event`` to ``scope``."""
        if isinstance(event, dpa.NoOpDpEvent):
            return
        history = self.scopes.setdefault(scope, [])
        data = ev.to_dict(event)
        if history and history[-1][0] == data:
            history[-1][1] += 1
        else:
            history.append([data, 1])

    def record_round(
        self, server_round: int, releases: dict[str, dpa.DpEvent], note: str = ""
    ) -> None:
        """Record one round's releases (scope -> event) and log the round."""
        for scope, event in releases.items():
            self.record(scope, event)
        self.rounds.append(
            {
                "round": int(server_round),
                "scopes": len(releases),
                "note": note,
                "epsilon": self.epsilon(),
            }
        )

    # ----------------------------------------------------------------- epsilon
    def _history(self, scope: str, extra: dpa.DpEvent | None = None) -> list[list[Any]]:
        """The merged (event data, count) history of ``scope`` plus ``extra``, in the
        same canonical form as after recording ``extra``."""
        history = [[data, count] for data, count in self.scopes.get(scope, [])]
        if extra is not None and not isinstance(extra, dpa.NoOpDpEvent):
            data = ev.to_dict(extra)
            if history and history[-1][0] == data:
                history[-1][1] += 1
            else:
                history.append([data, 1])
        return history

    @staticmethod
    def _event_of(history: list[list[Any]]) -> dpa.DpEvent:
        parts = [
            dpa.SelfComposedDpEvent(ev.from_dict(data), count) if count > 1 else ev.from_dict(data)
            for data, count in history
        ]
        return ev.compose(parts)

    def scope_event(self, scope: str, extra: dpa.DpEvent | None = None) -> dpa.DpEvent:
        """The composed event of ``scope`` (plus an optional planned ``extra``)."""
        return self._event_of(self._history(scope, extra))

    def scope_epsilon(self, scope: str, extra: dpa.DpEvent | None = None) -> float:
        """Epsilon at ``delta`` spent by ``scope``."""
        return epsilon(self.scope_event(scope, extra), self.delta, self.accountant, self.neighbouring)

    def epsilon(self, planned: dict[str, dpa.DpEvent] | None = None,
                scopes: Iterable[str] | None = None) -> float:
        """Joint-DP epsilon: the maximum over scopes (optionally after ``planned``;
        only over ``scopes`` if given, e.g. a group of owners).

        Scopes with the same history (e.g. owners of equal size) are accounted once.
        With many distinct scopes (e.g. one per subject) and the PLD accountant
        under add/remove, scopes are screened by two upper bounds on their true
        epsilon, RDP and a coarse-grid PLD
        (:func:`~flwr_jdp.privacy.accountants.screened_max_epsilon`): a scope is
        skipped only when a bound is at most a value already attained, so the
        result is a valid bound for every scope (and equals the maximum PLD
        epsilon whenever the bounds lie above it, as they do for Gaussian
        releases)."""
        planned = planned or {}
        names = set(self.scopes) | set(planned)
        if scopes is not None:
            names &= set(scopes)
        if not names:
            return 0.0
        todo: dict[str, list[list[Any]]] = {}
        worst = 0.0
        for name in names:
            history = self._history(name, planned.get(name))
            key = json.dumps(history, sort_keys=True)
            if key in self._epsilon_cache:
                worst = max(worst, self._epsilon_cache[key])
            else:
                todo[key] = history
        keys = list(todo)
        events = [self._event_of(todo[key]) for key in keys]
        if len(keys) > 2 and self.accountant == "pld" and self.neighbouring == "add-remove":
            worst, _, exact = screened_max_epsilon(events, self.delta, floor=worst)
            self._epsilon_cache.update({keys[j]: value for j, value in exact.items()})
            return worst
        for key, event in zip(keys, events):
            self._epsilon_cache[key] = epsilon(event, self.delta, self.accountant, self.neighbouring)
            worst = max(worst, self._epsilon_cache[key])
        return worst

    def would_exceed(self, planned: dict[str, dpa.DpEvent], budget: float | None = None) -> bool:
        """True if recording ``planned`` would push epsilon above the budget."""
        limit = self.budget if budget is None else budget
        if limit is None or math.isinf(limit):
            return False
        return self.epsilon(planned) > limit * (1.0 + 1e-9)

    # ------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state of the ledger."""
        return {
            "version": 1,
            "delta": self.delta,
            "accountant": self.accountant,
            "unit": self.unit,
            "neighbouring": self.neighbouring,
            "budget": self.budget,
            "epsilon": self.epsilon(),
            "scopes": self.scopes,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; delta, accountant and unit must match."""
        defaults = {"neighbouring": "add-remove"}  # ledgers written before the field
        for key in ("delta", "accountant", "unit", "neighbouring"):
            if state.get(key, defaults.get(key)) != getattr(self, key):
                raise ValueError(
                    f"ledger on disk has {key}={state.get(key, defaults.get(key))!r}, "
                    f"this run has {key}={getattr(self, key)!r}"
                )
        self.scopes = {k: [[d, int(c)] for d, c in v] for k, v in state["scopes"].items()}
        self.rounds = list(state.get("rounds", []))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the ledger to ``path`` as JSON, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ledger-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(self.state_dict(), fh, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrivacyLedger:
        """Read a ledger written by :meth:`save`."""
        state = json.loads(Path(path).read_text())
        ledger = cls(
            delta=state["delta"],
            accountant=state["accountant"],
            unit=state["unit"],
            budget=state.get("budget"),
            neighbouring=state.get("neighbouring", "add-remove"),
        )
        ledger.load_state_dict(state)
        return ledger
