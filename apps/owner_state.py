"""Owner-side runtime: data (cached per process), model, and personal state.

Personal parameters of owner ``o`` live in the node's ``context.state`` under
``personal.<o>`` as an ArrayRecord. They are read back at the start of every round
and written at its end; nothing here ever puts them into a message.

``context.state`` lives as long as the Flower run. A SuperNode started with node
config ``state-dir=<path>`` also keeps every owner's personal arrays on its own
disk (``<path>/<session>/personal-<o>.npz``, never sent anywhere; the session id
comes with every instruction and is kept by the server across restarts), so that
after the ServerApp is killed and the run resumed, the owners continue from their
personal state instead of a fresh one.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from torch import nn

from flwr_jdp import protocol
from flwr_jdp.config import JobConfig, parse_config
from flwr_jdp.data.datasets import load_dataset
from flwr_jdp.data.partition import OwnerData, load_partitions
from flwr_jdp.models import build_model
from flwr_jdp.params import ParamSplit, get_arrays, set_arrays, split_parameters
from flwr_jdp.privacy.mechanisms import torch_generator
from flwr_jdp.privacy.owner_guard import AgreedRelease, OwnerLedger


def personal_key(owner_id: int) -> str:
    """``context.state`` key of one owner's personal arrays."""
    return f"personal.{int(owner_id)}"


def node_job_config(context: Context) -> JobConfig:
    """The run config, with this node's ``data-dir`` (node config) taking precedence:
    each SuperNode may keep its data set in its own place."""
    cfg = parse_config(context.run_config)
    data_dir = context.node_config.get("data-dir")
    return dataclasses.replace(cfg, data_dir=str(data_dir)) if data_dir else cfg


def owner_data(cfg: JobConfig) -> tuple[OwnerData, ...]:
    """All owners' partitions for this configuration (loaded once per process)."""
    return load_partitions(
        cfg.dataset, cfg.data_dir, cfg.num_owners, cfg.classes_per_owner,
        cfg.max_records, cfg.records_per_user, cfg.seed, cfg.partitioner,
        cfg.validation_fraction, cfg.validation_source,
    )


def num_classes(cfg: JobConfig) -> int:
    """Number of classes of the configured data set."""
    return load_dataset(cfg.dataset, cfg.data_dir, cfg.seed).num_classes


def my_owners(cfg: JobConfig, context: Context) -> list[int]:
    """Owners this node hosts, from its node config (``partition-id``,
    ``num-partitions``; a node without them hosts every owner)."""
    pid = int(context.node_config.get("partition-id", 0))
    nparts = int(context.node_config.get("num-partitions", 1))
    if not 0 <= pid < nparts:
        raise ValueError(f"node config partition-id={pid} not in [0, num-partitions={nparts})")
    return protocol.hosted_owners(cfg.num_owners, pid, nparts)


@functools.lru_cache(maxsize=8)
def _initial_model(cfg: JobConfig, shape: tuple[int, ...]) -> tuple[nn.Module, ParamSplit]:
    model = build_model(cfg.model, shape, num_classes(cfg), cfg.norm, cfg.seed)
    split = split_parameters(model, cfg.effective_personal_rule, allow_empty=cfg.method != "joint-dp")
    return model, split


def new_model(cfg: JobConfig, data: OwnerData) -> tuple[nn.Module, ParamSplit]:
    """The seeded initial model and its shared/personal split: a fresh copy of a
    model built once per process and configuration (seeding and initialising a
    model costs more than copying one)."""
    model, split = _initial_model(cfg, tuple(data.x_train.shape[1:]))
    return copy.deepcopy(model), split


def public_personal(cfg: JobConfig, data: OwnerData) -> dict[str, np.ndarray]:
    """The public values of the personal parameters that a decoupled release is
    computed with (run-config ``release-personal``):

    - ``seeded``: their seeded initial values;
    - ``zero-head``: zero for the personal parameters of the model's head (its
      ``HEAD_PREFIXES``, e.g. FC1), the seeded initial values for the others (a
      personal conv layer at zero would zero the features the shared head sees).

    Either way they are fixed by the run config alone, before any data is seen, so
    a release computed with them does not depend on any owner's data or personal
    state: it stays plain DP-SGD (or a plain clipped sum) on the shared parameters,
    with the sensitivity and ledger event of :mod:`flwr_jdp.training.dp_sgd`. Read
    from the per-process initial model (never handed out, only copied), so they are
    fresh copies."""
    model, split = _initial_model(cfg, tuple(data.x_train.shape[1:]))
    values = dict(get_arrays(model, split.personal))
    if cfg.release_personal == "zero-head":
        head = tuple(getattr(model, "HEAD_PREFIXES", ()))
        values = {n: np.zeros_like(v) if head and n.startswith(head) else v for n, v in values.items()}
    return values


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


def load_owner_model(
    cfg: JobConfig, context: Context, data: OwnerData, shared: SharedArrays,
    session: str = "",
) -> tuple[nn.Module, ParamSplit]:
    """Model = global shared arrays + this owner's personal arrays from state
    (``context.state``, else the node's ``state-dir``, else the seeded init)."""
    model, split = new_model(cfg, data)
    key = personal_key(data.owner_id)
    if key not in context.state:
        _restore_from_disk(session, context, data.owner_id)
    if key in context.state:
        personal = context.state[key].to_numpy_ndarrays()
        set_arrays(model, dict(zip(split.personal, personal, strict=False)))
    arrays = shared_arrays(shared)
    if arrays:
        set_arrays(model, arrays)
    return model, split


def save_personal(context: Context, owner_id: int, model: nn.Module, split: ParamSplit,
                  session: str = "", *, fit_on: str = "", count_round: bool = True) -> None:
    """Keep the owner's personal arrays in ``context.state`` (never sent), and on
    the node's disk if it has a ``state-dir``; count the rounds trained
    (``count_round``) and record which broadcast they were fitted on (``fit_on``)."""
    arrays = get_arrays(model, split.personal)
    context.state[personal_key(owner_id)] = protocol.to_record(arrays)
    meta = f"{personal_key(owner_id)}.meta"
    rounds = int(context.state[meta]["trained-rounds"]) if meta in context.state else 0
    rounds += int(count_round)
    context.state[meta] = ConfigRecord({"trained-rounds": rounds, "fit-on": fit_on})
    _save_to_disk(session, context, owner_id, dict(arrays), rounds, fit_on)


def trained_rounds(context: Context, owner_id: int, session: str = "") -> int:
    """How many rounds this owner's personal state has been trained (0: fresh)."""
    if personal_key(owner_id) not in context.state:
        _restore_from_disk(session, context, owner_id)
    meta = f"{personal_key(owner_id)}.meta"
    return int(context.state[meta]["trained-rounds"]) if meta in context.state else 0


def _ledger_file(session: str, context: Context, owner_id: int) -> Path | None:
    """Node-local file of one owner's own privacy ledger, if the node keeps a state-dir."""
    personal = _state_file(session, context, owner_id)
    return None if personal is None else personal.with_name(f"ledger-{int(owner_id)}.json")


def load_owner_ledger(context: Context, owner_id: int, session: str, agreed: AgreedRelease,
                      unit: str) -> OwnerLedger:
    """The owner's own record of its releases: ``context.state`` (every release of
    this Flower run, whatever session the server names), else the node's
    ``state-dir`` for this session (after a restart), else empty."""
    key = f"ledger.{int(owner_id)}"
    text = None
    if key in context.state:
        text = str(context.state[key]["state"])
    else:
        path = _ledger_file(session, context, owner_id)
        if path is not None and path.is_file():
            text = path.read_text()
    return OwnerLedger.from_json(text, agreed, unit)


def save_owner_ledger(context: Context, owner_id: int, session: str, ledger: OwnerLedger) -> None:
    """Keep the owner's ledger in ``context.state`` and on the node's disk."""
    context.state[f"ledger.{int(owner_id)}"] = ConfigRecord({"state": ledger.to_json()})
    path = _ledger_file(session, context, owner_id)
    if path is not None:
        ledger.save(path)


def owner_generator(cfg: JobConfig, server_round: int, owner_id: int) -> torch.Generator:
    """Randomness for sampling and noise: OS CSPRNG unless ``noise-seed`` is set."""
    seed = cfg.noise_seed_or_none
    if seed is not None:
        digest = hashlib.sha256(f"{seed}/{server_round}/{owner_id}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1
    return torch_generator(seed)
