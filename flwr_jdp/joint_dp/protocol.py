"""Keys of the messages between the joint-DP ServerApp and its ClientApps.

A SuperNode hosts one or more owners: owner ``o`` lives on the node whose
``partition-id`` equals ``o % num-partitions`` (one owner per node when there are
as many nodes as owners). Per owner, a reply carries:

- ``owner.<o>`` ArrayRecord: the owner's release, with exactly the shared
  parameter names (never a personal one);
- ``metrics.<o>`` MetricRecord: ``num-examples`` (and, in evaluation, accuracy).

Train messages carry the global shared arrays (``shared``) and a ConfigRecord
(``config``) with the round, the owners to train, and per owner the sample rate and
number of DP-SGD steps the server accounts for, plus the noise multiplier: one float
when every owner the message addresses adds the same (always so for one owner), else
a list with one value per owner of ``owners`` (owners capped by their node's
``max-epsilon`` add more noise, :mod:`flwr_jdp.joint_dp.budgets`). An owner reads
either form (:func:`noise_multipliers`).

The set-up (query) reply lists, per owner, its id, sizes and its node's cap
``max-epsilon`` (0.0: none), all public metadata.
"""

from __future__ import annotations

from flwr_jdp.records import hosted_owners, to_record  # noqa: F401 - re-exported

SHARED = "arrays"  # Flower's standard key: the global shared parameters
CONFIG = "config"
SETUP = "setup"

# Config keys of a train/evaluate message.
ROUND = "server-round"
OWNERS = "owners"
SAMPLE_RATES = "sample-rates"
STEPS = "steps"
NOISE_MULTIPLIER = "noise-multiplier"
SESSION = "session"  # id of a training session (kept across ServerApp restarts)
SCALE = "scale"  # distributed noise: integers per unit of gradient (gamma)

# Metric keys.
NUM_EXAMPLES = "num-examples"
ACCURACY = "accuracy"
LOSS = "loss"
PERSONAL_ROUNDS = "personal-rounds"  # rounds the owner's personal state was trained

# Setup (query) reply keys.
OWNER_IDS = "owner-ids"
NUM_RECORDS = "num-records"
NUM_USERS = "num-users"
MAX_EPSILON = "max-epsilon"  # the node's cap on each owner's budget (0.0: none)
PARAM_NAMES = "param-names"  # drop-in client: the model's parameter names and shapes
PARAM_SHAPES = "param-shapes"

# Set-up (query) message: the public initial values of the personal parameters
# (from the user's ``initial_arrays``; data-independent, sent server -> owners only).
PUBLIC_PERSONAL = "public-personal"

# A drop-in owner's train reply uses Flower's standard keys for its one owner.
ARRAYS = "arrays"
METRICS = "metrics"

# What a train reply's arrays mean.
KIND_PARAMS = "params"  # updated shared parameters (DP-SGD done locally, or no DP)
KIND_GRAD_SUM = "grad-sum"  # sum of clipped per-unit gradients (central noise)
KIND_DELTA = "delta"  # clipped (and, locally, noised) update of the shared parameters
KIND_SECURE_SUM = "secure-sum"  # rounded clipped sum plus a noise share, modulo 2**31, via SecAgg+


def owner_key(owner_id: int) -> str:
    """Record key of one owner's reply."""
    return f"owner.{int(owner_id)}"


def metrics_key(owner_id: int) -> str:
    """Record key of one owner's metrics."""
    return f"metrics.{int(owner_id)}"


def noise_value(multipliers: list[float]) -> float | list[float]:
    """The ``noise-multiplier`` value of a message whose owners add ``multipliers``
    (in the order of ``owners``): one float if they are all equal, else the list."""
    values = [float(z) for z in multipliers]
    return values[0] if values and all(z == values[0] for z in values) else values


def noise_multipliers(value: object, count: int) -> list[float] | None:
    """Per owner, the noise multipliers of a ``noise-multiplier`` value addressed to
    ``count`` owners (one float for all, or one per owner); None if a list's length
    is not ``count``."""
    if isinstance(value, list | tuple):
        return [float(z) for z in value] if len(value) == count else None
    return [float(value)] * count  # type: ignore[arg-type]


def parse_owner_key(key: str, prefix: str = "owner") -> int | None:
    """Owner id of a record key ``<prefix>.<id>``, or None if it is not one."""
    head, _, rest = key.partition(".")
    if head != prefix or not rest.isdigit():
        return None
    return int(rest)


#: How an owner's error reply begins when its train function breaks a rule of the DP
#: pass (checked on synthetic records, so the same code breaks it every round).
BROKEN_RULE = "the train function breaks a rule of the DP pass"
