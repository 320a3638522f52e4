"""An owner's state on its node: personal parameters, their public initial values
and the owner's own privacy ledger, in ``context.state`` and (node config
``state-dir``) on the node's own disk.

Personal parameters of owner ``o`` live under ``personal.<o>`` as an ArrayRecord,
read back at the start of every round and written at its end; nothing here ever
puts them into a message. ``context.state`` lives as long as the Flower run; a
SuperNode started with ``state-dir=<path>`` also keeps them in
``<path>/<session>/personal-<o>.npz`` (never sent; the session id comes with every
instruction and is kept by the server across restarts), so that after the
ServerApp is killed and the run resumed the owners continue from their personal
state; a new session starts from the public initial values.

The owner's own ledger depends neither on the session nor on the run's terms: it
is kept in ``<path>/owners/`` (:class:`flwr_jdp.privacy.guard.LedgerStore`), read and
written under an exclusive lock at every charge, in its node's policy's unit, relation
and delta (:mod:`flwr_jdp.privacy.policy`), so that a server naming a new session
after a SuperNode restart, a new run with other terms, or a run served at the same
time, finds every release the owner made and cannot spend its budget again. Under a
node's policy every owner the node hosts charges the node's one ledger,
``ledger-node.json`` (the run names the owners and their partition, which the node
cannot verify); without one each owner keeps ``ledger-<o>.json``. Used by every joint-DP ClientApp, the drop-in client half included.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.owner_guard import (
    AgreedRelease,
    Instruction,
    InstructionRefused,
    OwnerLedger,
    agreed_release,
    owner_policy,
)
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.privacy.guard import LedgerId, LedgerStore, charge
from flwr_jdp.privacy.mechanisms import torch_generator
from flwr_jdp.privacy.units import NoisePlacement


def personal_key(owner_id: int) -> str:
    """``context.state`` key of one owner's personal arrays."""
    return f"personal.{int(owner_id)}"


SharedArrays = ArrayRecord | dict[str, np.ndarray] | None


def shared_arrays(shared: SharedArrays) -> dict[str, np.ndarray]:
    """Broadcast shared arrays by name (an ArrayRecord is deserialised once here,
    so that a message's handler can reuse the result for every owner it hosts)."""
    if shared is None:
        return {}
    if isinstance(shared, ArrayRecord):
        return dict(zip(shared.keys(), shared.to_numpy_ndarrays(), strict=False))
    return dict(shared)


def shared_digest(shared: SharedArrays) -> str:
    """Fingerprint of broadcast shared arrays (which global model personal
    parameters were last fitted against)."""
    h = hashlib.sha256()
    for name, arr in shared_arrays(shared).items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:32]


def personal_fit_on(context: Context, owner_id: int, session: str = "") -> str:
    """Digest of the shared arrays the owner's personal parameters were last
    fitted against ('' if never)."""
    if personal_key(owner_id) not in context.state:
        _restore_from_disk(session, context, owner_id)
    meta = f"{personal_key(owner_id)}.meta"
    if meta not in context.state:
        return ""
    return str(context.state[meta].get("fit-on", ""))


def _state_file(session: str, context: Context, owner_id: int) -> Path | None:
    """Node-local file of one owner's personal state, if the node keeps one."""
    root = context.node_config.get("state-dir")
    if not root or not session or not str(session).isalnum():
        return None
    return Path(str(root)) / str(session) / f"personal-{int(owner_id)}.npz"


def _restore_from_disk(session: str, context: Context, owner_id: int) -> None:
    path = _state_file(session, context, owner_id)
    if path is None or not path.is_file():
        return
    meta_keys = ("__trained_rounds__", "__fit_on__")
    with np.load(path) as npz:
        arrays = {k: np.asarray(npz[k]) for k in npz.files if k not in meta_keys}
        rounds = int(npz["__trained_rounds__"]) if "__trained_rounds__" in npz.files else 0
        fit_on = str(npz["__fit_on__"]) if "__fit_on__" in npz.files else ""
    context.state[personal_key(owner_id)] = protocol.to_record(arrays)
    context.state[f"{personal_key(owner_id)}.meta"] = ConfigRecord(
        {"trained-rounds": rounds, "fit-on": fit_on})


def _save_to_disk(session: str, context: Context, owner_id: int, arrays: dict, rounds: int,
                  fit_on: str = "") -> None:
    path = _state_file(session, context, owner_id)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "wb") as fh:
        np.savez(fh, __trained_rounds__=np.int64(rounds), __fit_on__=np.str_(fit_on), **arrays)
    os.replace(tmp, path)


def trained_rounds(context: Context, owner_id: int, session: str = "") -> int:
    """How many rounds this owner's personal state has been trained (0: fresh)."""
    if personal_key(owner_id) not in context.state:
        _restore_from_disk(session, context, owner_id)
    meta = f"{personal_key(owner_id)}.meta"
    return int(context.state[meta]["trained-rounds"]) if meta in context.state else 0


#: Where owners keep their ledgers: ``<state-dir>/owners/ledger-<o>.json`` (``ledger-node.json``
#: under a node's policy), else ``context.state["ledger.<o>"]``.
OWNER_LEDGERS = LedgerStore(party="owner", state_key="ledger")


def load_owner_ledger(context: Context, owner_id: LedgerId, agreed: AgreedRelease, unit: str) -> OwnerLedger:
    """The owner's own record of its releases (``owner_id``; :data:`~flwr_jdp.privacy.guard.NODE_LEDGER`:
    the node's, under its policy): the node's ``state-dir`` (after a restart, whatever
    session the server names), else ``context.state`` (this Flower run), else empty."""
    return OWNER_LEDGERS.load(context, owner_id, agreed, unit)


def save_owner_ledger(context: Context, owner_id: int, ledger: OwnerLedger) -> None:
    """Keep the owner's ledger on the node's disk, else in ``context.state``."""
    OWNER_LEDGERS.save(context, owner_id, ledger)


def owner_generator(cfg: JobConfig, server_round: int, owner_id: int) -> torch.Generator:
    """Randomness for sampling and noise: OS CSPRNG unless ``noise-seed`` is set."""
    seed = cfg.noise_seed_or_none
    if seed is not None:
        digest = hashlib.sha256(f"{seed}/{server_round}/{owner_id}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
    return torch_generator(seed)


def load_personal_arrays(context: Context, owner_id: int, session: str = "") -> dict[str, np.ndarray] | None:
    """The owner's saved personal arrays by name (``context.state``, else the node's
    ``state-dir``), or None if it has none yet."""
    key = personal_key(owner_id)
    if key not in context.state:
        _restore_from_disk(session, context, owner_id)
    if key not in context.state:
        return None
    rec = context.state[key]
    return dict(zip(rec.keys(), rec.to_numpy_ndarrays(), strict=True))


def save_personal_arrays(context: Context, owner_id: int, arrays: dict[str, np.ndarray], session: str = "",
                         *, fit_on: str = "", count_round: bool = True) -> None:
    """Keep the owner's personal arrays in ``context.state`` (never sent), and on
    the node's disk if it has a ``state-dir``; count the rounds trained
    (``count_round``) and record which broadcast they were fitted on (``fit_on``)."""
    context.state[personal_key(owner_id)] = protocol.to_record(arrays)
    meta = f"{personal_key(owner_id)}.meta"
    rounds = int(context.state[meta]["trained-rounds"]) if meta in context.state else 0
    rounds += int(count_round)
    context.state[meta] = ConfigRecord({"trained-rounds": rounds, "fit-on": fit_on})
    _save_to_disk(session, context, owner_id, dict(arrays), rounds, fit_on)


def read_instructions(cfg: JobConfig, cfg_rec: ConfigRecord, owners: list[int]) -> dict[int, Instruction]:
    """Each requested owner's instruction, read strictly: under DP every key must be
    there, one value per owner (a missing key is refused, never defaulted)."""
    if not cfg.dp:
        return {o: Instruction(int(cfg_rec.get(protocol.ROUND, 0)), 1.0, 1, 0.0) for o in owners}
    missing = [k for k in (protocol.ROUND, protocol.OWNERS, protocol.SAMPLE_RATES, protocol.STEPS,
                           protocol.NOISE_MULTIPLIER, protocol.SESSION) if k not in cfg_rec]
    if missing:
        raise InstructionRefused(f"the train instruction lacks {missing}")
    wanted = [int(o) for o in cfg_rec[protocol.OWNERS]]
    rates, steps = list(cfg_rec[protocol.SAMPLE_RATES]), list(cfg_rec[protocol.STEPS])
    if not len(rates) == len(steps) == len(wanted):
        raise InstructionRefused(f"{len(wanted)} owners but {len(rates)} sampling rates and "
                                 f"{len(steps)} step counts")
    # one noise multiplier for every owner, or one per owner
    zs = protocol.noise_multipliers(cfg_rec[protocol.NOISE_MULTIPLIER], len(wanted))
    if zs is None:
        raise InstructionRefused(f"{len(wanted)} owners but {len(cfg_rec[protocol.NOISE_MULTIPLIER])} "
                                 "noise multipliers")
    rnd = int(cfg_rec[protocol.ROUND])
    by_owner = {o: Instruction(rnd, float(q), int(n), z) for o, q, n, z in zip(wanted, rates, steps, zs)}
    missing = [o for o in owners if o not in by_owner]
    if missing:
        raise InstructionRefused(f"the train instruction is not addressed to owners {missing[:5]}")
    return {o: by_owner[o] for o in owners}


def charge_owners(cfg: JobConfig, context: Context, sizes: dict[int, OwnerSize],
                  instructions: dict[int, Instruction], session: str) -> None:
    """Every placement: the run is held to the node's policy before any data is read
    (:func:`~flwr_jdp.joint_dp.owner_guard.owner_policy`; :class:`InstructionRefused`
    if it breaks it). Local noise, and central noise under a node's own policy: every
    owner then checks its instruction against what it agreed to
    (:func:`~flwr_jdp.joint_dp.owner_guard.agreed_release`) and against its ledger, then
    records the release in its ledger and saves it, before anything is trained
    (:func:`flwr_jdp.privacy.guard.charge`). Any refusal refuses the whole message
    (nothing is recorded, trained or sent). ``session`` is noted in the ledger; it does
    not select it. With its node's policy every owner charges the node's one ledger,
    against ``min(max-epsilon, target-epsilon)``, accounted at the policy's delta, so the
    cap covers every run on the node's ``state-dir``, central ones included (their event
    is the noise the trusted server claims to add). Without a policy a central release is
    not charged here (the run config is trusted; the server's ledger accounts it).
    Distributed noise charges in :func:`~flwr_jdp.joint_dp.distributed.charge_distributed`."""
    policy = owner_policy(context, cfg)
    if not cfg.dp or cfg.placement is NoisePlacement.DISTRIBUTED:
        return
    if cfg.placement is NoisePlacement.CENTRAL and policy.trusts_run:
        return
    requests = {o: (agreed_release(cfg, sizes[o], policy.max_epsilon, policy.delta), instruction)
                for o, instruction in instructions.items()}
    charge(context, OWNER_LEDGERS, requests, cfg.privacy_unit, note=f"session {session}",
           node_ledger=not policy.trusts_run)
