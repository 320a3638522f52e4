"""An owner's policy, kept on the owner's node: the terms its ledger counts in and
the runs it accepts, whoever submits the run.

Whoever submits a run chooses its run config, and the server sends every
instruction, so neither can say what an owner accepts. A node operator writes its
owners' policy in the node config (Flower's ``--node-config "k=v ..."``), or in a TOML
file that node config ``policy-file`` names (the same keys, one per line)::

    max-epsilon = 1.0                        # the cap: epsilon this node's owners may spend, all runs together
    delta = 1e-5                             # the delta their ledgers are accounted at (default 1e-5)
    privacy-unit = "record"                  # record | user | owner | subject (default: record; subject for silos)
    neighbouring = "add-remove"              # add-remove | replace-one (default add-remove)
    noise-placements = ["local", "distributed"]  # and "central", only if named (default local and distributed)
    honest-owners = 3                        # distributed noise: honest owners whose shares reach the sum (default 1)
    seeded-noise = false                     # true accepts a run's noise-seed (reproducible noise: tests only)
    secure-noise = false                     # true: only runs that draw their noise from the OS CSPRNG (secure-noise)

Every run is held to it at set-up and again at every train message, before any data
is read (:func:`run_policy`): the run's ``delta`` must be the policy's, its privacy
unit and neighbouring relation the policy's, its noise placement one the policy
allows, and the run must be private at all, with unseeded noise; otherwise the owner refuses, naming the
run-config key and the policy's value. The owner's budget is ``min(max-epsilon, the
run's target-epsilon)``: a run cannot raise it. The cap covers every run on the
node, so a policy needs node config ``state-dir`` (refused without one: a ledger in
Flower's per-run ``context.state`` would start every run afresh). Under a policy the
node keeps one ledger for every owner it hosts (``<state-dir>/owners/ledger-node.json``,
:class:`~flwr_jdp.privacy.guard.LedgerStore`): which owners a node hosts and which of
its records each holds is the run's choice (``num-owners``, the partition), which the
node cannot verify is disjoint, so every release it makes is composed sequentially
against the cap, central ones included (charged as the noise the trusted server claims
to add: :func:`~flwr_jdp.joint_dp.owner_guard.agreed_release`). The ledger records the policy's unit, relation and delta, is always
accounted at the policy's delta, and is read and written under a lock across
processes (runs served at the same time share it).

Distributed noise and ``honest-owners``
    Under ``noise-placement = "distributed"`` each owner adds a share ``mu_i`` of the
    Skellam noise ``mu`` the released sum must carry (:mod:`flwr_jdp.privacy.skellam`).
    The run config plans the shares (``mu / (s - k)``: ``s`` the fewest survivors from
    ``num-owners`` and ``dropout-tolerance``, ``k`` = ``colluding-owners``), and the
    owner cannot check it: a server that adds nodes of its own, or names fewer
    colluders than there are, makes each honest share smaller. The policy's
    ``honest-owners`` = ``h`` is the owner's own assumption: at least ``h`` honest
    owners (itself included) add their shares and reach the sum. Its share is then
    ``mu / min(s - k, h)`` >= ``mu / h`` whatever the run says, so the ``h`` honest
    shares that reach the sum carry at least ``h * mu / h = mu``. Skellam noise is
    closed under sums, and every other vector in the sum (the other owners' data and
    noise, a colluder's values) is independent of this owner's units: the release is a
    post-processing of the owner's integer sum plus ``Sk(mu')`` with ``mu' >= mu``,
    which is at least as private as the mechanism with ``mu``. That is why the owner's
    ledger charges each release as carrying ``mu``, the whole noise; without the floor
    (no policy: the run config is trusted) the charge rests on the run's ``s`` and
    ``k``. ``h = 1`` (the default) assumes no other owner: the owner adds all of ``mu``
    itself.

No policy
    A node without one trusts the run submitter with its owners' budget: the run's
    ``target-epsilon``, ``delta``, unit, relation and distributed share sizes. On a
    real SuperNode (the ClientApp runs in Flower's ``flwr-clientapp``,
    :func:`on_supernode`) the owner refuses every run unless the node config opts in
    with ``policy = "trust-run"``. Elsewhere (Flower's simulation engine, flwr-jdp's
    in-process grid, a client half called from one's own Python process, where whoever
    runs it also writes the run config) the run config acts as the policy
    (:meth:`OwnerPolicy.trusting`). Either way the node logs once per process that its
    owners trust the run submitter.
"""

from __future__ import annotations

import math
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common import log

from ..config_check import ConfigError
from .guard import InstructionRefused
from .units import NoisePlacement, PrivacyUnit

#: Node config key of the policy file (TOML, the policy's keys).
FILE_KEY = "policy-file"
#: Node config key that opts a node without a policy into trusting the run: ``policy = "trust-run"``.
MODE_KEY = "policy"
TRUST_RUN = "trust-run"
#: The policy's keys, in the node config or the policy file.
KEYS = ("max-epsilon", "delta", "privacy-unit", "neighbouring", "noise-placements", "honest-owners",
        "seeded-noise", "secure-noise")
#: The delta of a policy that names a cap but no delta.
DEFAULT_DELTA = 1e-5
RELATIONS = ("add-remove", "replace-one")
UNITS = tuple(u.value for u in PrivacyUnit)
PLACEMENTS = tuple(p.value for p in NoisePlacement)
#: Central noise trusts the server with clipped sums: allowed only where the policy names it.
DEFAULT_PLACEMENTS = (NoisePlacement.LOCAL.value, NoisePlacement.DISTRIBUTED.value)

#: The module of Flower's ``flwr-clientapp`` that calls the ClientApp on a SuperNode
#: (subprocess or process isolation); Flower's simulation engine calls it from a Ray
#: actor (``flwr.simulation.ray_transport.ray_actor``) instead.
SUPERNODE_MODULE = "flwr.supernode.runtime.run_clientapp"

_LOGGED: set[str] = set()  # the trust-run lines this process has logged


@dataclass(frozen=True)
class RunTerms:
    """What a run asks of a party: its target, delta, unit, relation and placement;
    ``private`` False for a run that releases without noise (FedAvg baselines);
    ``noise_seed`` >= 0 for a run whose noise is seeded (reproducible by the submitter);
    ``secure_noise`` whether it draws its noise from the OS CSPRNG (run-config ``secure-noise``);
    ``keys`` maps each term to the run-config key a refusal names."""

    target_epsilon: float
    delta: float
    unit: str
    neighbouring: str
    placement: str
    private: bool = True
    noise_seed: int = -1
    secure_noise: bool = False
    keys: Mapping[str, str] | None = None

    def key(self, term: str) -> str:
        return (self.keys or {}).get(term, term)


@dataclass(frozen=True)
class OwnerPolicy:
    """What a node's owners (or silos) accept. ``max_epsilon`` None: a trusting policy,
    the run config's own terms (:meth:`trusting`). ``honest_owners`` None: no floor on
    a distributed noise share (the run's ``s - k``). ``source`` says where it was read."""

    max_epsilon: float | None
    delta: float = DEFAULT_DELTA
    privacy_unit: str = PrivacyUnit.RECORD.value
    neighbouring: str = "add-remove"
    noise_placements: tuple[str, ...] = DEFAULT_PLACEMENTS
    honest_owners: int | None = 1
    seeded_noise: bool = False
    secure_noise: bool = False
    source: str = "node config"

    @property
    def trusts_run(self) -> bool:
        return self.max_epsilon is None

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], *,
                         default_unit: str = PrivacyUnit.RECORD.value) -> OwnerPolicy | None:
        """The policy the node config names (its keys, or the file ``policy-file``), or
        None if it names none. A bad value, an unknown key in the file, a policy both
        in the node config and a file, a policy with ``policy = "trust-run"``, or a
        policy without ``max-epsilon`` is a :class:`ConfigError` naming the key."""
        mode = node_config.get(MODE_KEY)
        if mode is not None and mode != TRUST_RUN:
            raise ConfigError(f"node config key '{MODE_KEY}' must be '{TRUST_RUN}' (or left out), got {mode!r}")
        inline = {k: node_config[k] for k in KEYS if k in node_config}
        path = node_config.get(FILE_KEY)
        if path is not None and inline:
            raise ConfigError(f"node config sets '{FILE_KEY}' and {sorted(inline)}: write the policy in one place")
        if path is not None:
            values, source = _read_file(path), f"policy file {path}"
        elif inline:
            values, source = inline, "node config"
        else:
            return None
        if mode is not None:
            raise ConfigError(f"node config key '{MODE_KEY}'='{TRUST_RUN}' and a policy ({source}) contradict "
                              "each other: leave one out")
        return cls.from_mapping(values, source, default_unit=default_unit)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "node config", *,
                     default_unit: str = PrivacyUnit.RECORD.value) -> OwnerPolicy:
        """The policy of ``values`` (the policy's keys), every value checked."""
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (a policy has {', '.join(KEYS)})")
        where = f"{source} key" if source != "node config" else "node config key"

        def bad(key: str, allowed: str) -> ConfigError:
            return ConfigError(f"{where} '{key}' must be {allowed}, got {values[key]!r}")

        if "max-epsilon" not in values:
            raise ConfigError(f"{where} 'max-epsilon' is missing: a policy caps its owners' budget (a number > 0)")
        cap = _number(values["max-epsilon"])
        if not (math.isfinite(cap) and cap > 0):
            raise bad("max-epsilon", "a number > 0 (the epsilon this node's owners may spend at most, all runs "
                      "together)")
        delta = _number(values.get("delta", DEFAULT_DELTA))
        if not 0 < delta < 1:
            raise bad("delta", "a number in (0, 1) (the delta the owners' ledgers are accounted at)")
        unit = values.get("privacy-unit", default_unit)
        if unit not in UNITS:
            raise bad("privacy-unit", f"one of {UNITS}")
        relation = values.get("neighbouring", "add-remove")
        if relation not in RELATIONS:
            raise bad("neighbouring", f"one of {RELATIONS}")
        placements = values.get("noise-placements", DEFAULT_PLACEMENTS)
        if isinstance(placements, str):
            placements = [p.strip() for p in placements.split(",")]
        if not (isinstance(placements, (list, tuple)) and placements and set(placements) <= set(PLACEMENTS)):
            raise bad("noise-placements", f"a non-empty list of {PLACEMENTS} (or one comma-separated string)")
        honest = values.get("honest-owners", 1)
        if isinstance(honest, bool) or not isinstance(honest, int) or honest < 1:
            raise bad("honest-owners", "an integer >= 1 (the fewest honest owners, this one included, whose "
                      "noise shares reach a distributed sum)")
        seeded = values.get("seeded-noise", False)
        if not isinstance(seeded, bool):
            raise bad("seeded-noise", "true or false (true accepts a run whose noise-seed is set: reproducible "
                      "noise, for tests only)")
        secure = values.get("secure-noise", False)
        if not isinstance(secure, bool):
            raise bad("secure-noise", "true or false (true accepts only runs whose run config sets secure-noise = "
                      "true: every noise draw from the OS CSPRNG in float64)")
        return cls(max_epsilon=cap, delta=delta, privacy_unit=str(unit), neighbouring=str(relation),
                   noise_placements=tuple(dict.fromkeys(str(p) for p in placements)), honest_owners=int(honest),
                   seeded_noise=seeded, secure_noise=secure, source=source)

    @classmethod
    def trusting(cls, terms: RunTerms) -> OwnerPolicy:
        """The run config as the policy: its target, delta, unit, relation, placement
        and distributed share sizes (no floor)."""
        return cls(max_epsilon=None, delta=float(terms.delta), privacy_unit=str(terms.unit),
                   neighbouring=str(terms.neighbouring), noise_placements=(str(terms.placement),),
                   honest_owners=None, seeded_noise=True, source=f"the run config ({TRUST_RUN})")

    # ------------------------------------------------------------------ using
    def refusal(self, terms: RunTerms) -> str | None:
        """Why a run with ``terms`` is refused under this policy, or None."""
        if not terms.private:
            return (f"the run releases without noise (run-config key '{terms.key('private')}'); this node's policy "
                    f"({self.source}) accepts private runs only")
        if int(terms.noise_seed) >= 0 and not self.seeded_noise:
            return (f"run-config key '{terms.key('noise_seed')}'={terms.noise_seed} makes the noise reproducible by "
                    f"whoever submits the run (who could then subtract it); this node's policy ({self.source}) "
                    "accepts only noise drawn from the OS CSPRNG (noise-seed = -1; policy key 'seeded-noise' = true allows "
                    "seeded noise, for tests)")
        if self.secure_noise and not terms.secure_noise:
            return (f"run-config key '{terms.key('secure_noise')}'=false draws the noise from torch's generator in "
                    f"float32; this node's policy ({self.source}) requires noise from the OS CSPRNG (secure-noise = "
                    "true)")
        if not math.isclose(float(terms.delta), self.delta, rel_tol=1e-9, abs_tol=0.0):
            return (f"run-config key '{terms.key('delta')}'={terms.delta!r}, this node's policy ({self.source}) "
                    f"accounts its ledger at delta = {self.delta!r}")
        for term, want in (("unit", self.privacy_unit), ("neighbouring", self.neighbouring)):
            got = getattr(terms, term)
            if got != want:
                return (f"run-config key '{terms.key(term)}'={got!r}, this node's policy ({self.source}) counts "
                        f"its ledger in {want!r}")
        if terms.placement not in self.noise_placements:
            return (f"run-config key '{terms.key('placement')}'={terms.placement!r}, this node's policy "
                    f"({self.source}) allows {list(self.noise_placements)}")
        return None

    def budget(self, target_epsilon: float) -> float:
        """The epsilon the owner may spend: ``min(max-epsilon, target-epsilon)``; the
        run's ``target-epsilon`` for a trusting policy."""
        return float(target_epsilon) if self.max_epsilon is None else min(float(target_epsilon), self.max_epsilon)


def on_supernode() -> bool:
    """Whether this ClientApp runs on a real SuperNode: called by Flower's
    ``flwr-clientapp`` (a frame of :data:`SUPERNODE_MODULE` on the call stack), not by
    the simulation engine or one's own Python process. The call stack is the only sign
    Flower leaves; ``tests/test_owner_policy.py`` runs Flower's own ``run_clientapp``
    to keep it true."""
    frame = sys._getframe(1)  # noqa: SLF001
    while frame is not None:
        if frame.f_globals.get("__name__") == SUPERNODE_MODULE:
            return True
        frame = frame.f_back
    return False


def run_policy(node_config: Mapping[str, Any], terms: RunTerms, *, party: str = "owner",
               default_unit: str = PrivacyUnit.RECORD.value) -> OwnerPolicy:
    """The policy a run with ``terms`` is held to on this node: the node's own
    (:meth:`OwnerPolicy.from_node_config`), else the run config, trusted off a real
    SuperNode or with ``policy = "trust-run"`` (said once per process). Raises
    :class:`~flwr_jdp.privacy.guard.InstructionRefused` if the run breaks the node's
    policy, if a real SuperNode names no policy, or if a policy has no ``state-dir``
    for its ledger; :class:`ConfigError` for a bad one."""
    policy = OwnerPolicy.from_node_config(node_config, default_unit=default_unit)
    if policy is None:
        opted_in = node_config.get(MODE_KEY) == TRUST_RUN
        if not opted_in and on_supernode():
            raise InstructionRefused(
                f"this SuperNode names no policy for its {party}s: set node config 'max-epsilon' (and 'delta', "
                f"'privacy-unit', 'neighbouring', 'noise-placements', 'honest-owners' as needed) or "
                f"'{FILE_KEY}', or '{MODE_KEY}=\"{TRUST_RUN}\"' to trust whoever submits the run with the "
                f"{party}s' budget")
        why = f"node config '{MODE_KEY}'='{TRUST_RUN}'" if opted_in else "not on a SuperNode"
        if why not in _LOGGED:
            _LOGGED.add(why)
            log(WARNING, "No %s policy on this node (%s): its %ss trust the run submitter with their budget (the "
                "run's target-epsilon, delta, privacy unit, neighbouring relation and distributed noise-share "
                "sizes); set node config 'max-epsilon' or '%s' to hold every run to the node's own terms",
                party, why, party, FILE_KEY)
        return OwnerPolicy.trusting(terms)
    if not node_config.get("state-dir"):
        raise InstructionRefused(f"a policy's cap covers all runs on this node: it needs node config 'state-dir' "
                                 f"for its ledger (the policy: {policy.source})")
    reason = policy.refusal(terms)
    if reason:
        raise InstructionRefused(reason)
    return policy


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _read_file(path: Any) -> dict[str, Any]:
    try:
        with Path(str(path)).open("rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"node config key '{FILE_KEY}'={path!r}: cannot read the policy file ({err})") from None


__all__ = ["DEFAULT_DELTA", "DEFAULT_PLACEMENTS", "FILE_KEY", "KEYS", "MODE_KEY", "SUPERNODE_MODULE",
           "TRUST_RUN", "OwnerPolicy", "RunTerms", "on_supernode", "run_policy"]
