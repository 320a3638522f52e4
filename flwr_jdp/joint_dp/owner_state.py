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

import numpy as np
from flwr.app import Context
from torch import nn

from flwr_jdp.data.datasets import load_dataset
from flwr_jdp.data.partition import OwnerData, load_partitions
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig, parse_config
from flwr_jdp.joint_dp.owner_store import (  # noqa: F401 - re-exported for the apps
    SharedArrays,
    _restore_from_disk,
    load_owner_ledger,
    owner_generator,
    personal_fit_on,
    personal_key,
    save_owner_ledger,
    save_personal_arrays,
    shared_arrays,
    shared_digest,
    trained_rounds,
)
from flwr_jdp.models import build_model
from flwr_jdp.params import ParamSplit, get_arrays, set_arrays, split_parameters


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
    save_personal_arrays(context, owner_id, dict(get_arrays(model, split.personal)), session,
                         fit_on=fit_on, count_round=count_round)


