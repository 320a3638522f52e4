"""The run configuration: every knob of a joint-DP run, validated at start-up.

Keys are the Flower run-config keys of ``pyproject.toml`` (``[tool.flwr.app.config]``);
:func:`parse_config` turns a run config into a :class:`JobConfig` and raises
:class:`ConfigError` naming the key and its allowed range for any bad value.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from flwr_jdp.config_check import (  # noqa: F401 - re-exported
    IGNORED_KEYS,
    PRIVACY_KEYS,
    ConfigError,
    coerce,
    config_digest,
    config_key,
    did_you_mean,
    key_prefix,
    namespace,
    parse_dataclass,
    refuse_misplaced,
    run_folder,
)
from flwr_jdp.config_check import need as require
from flwr_jdp.data.datasets import DATASETS
from flwr_jdp.data.partition import VALIDATION_SOURCES
from flwr_jdp.privacy.backends import ACCOUNTANTS, RELATIONS
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit

METHODS = ("joint-dp", "full-dp", "fedavg", "per-silo")
#: How personal parameters relate to the shared release (see
#: :mod:`flwr_jdp.joint_dp.release`): only ``decoupled`` (record/user-level DP
#: holds); the joint-DP paper's Algorithm 1 (``interleaved``) is refused.
COUPLINGS = ("decoupled",)
#: The public values a decoupled release holds the personal parameters at (see
#: :func:`apps.joint_dp.joint_dp.server_app.initial_arrays`): ``seeded`` (the seeded
#: initialisation) or ``zero-head`` (personal parameters of the model's head at zero,
#: so the release trains the shared layers without a fixed random head beside them).
RELEASE_PERSONAL = ("seeded", "zero-head")
UNITS = tuple(u.value for u in PrivacyUnit if u is not PrivacyUnit.SUBJECT)
PLACEMENTS = tuple(p.value for p in NoisePlacement)


#: Default ``finetune-learning-rate`` (the per-silo learning rate of the joint-DP
#: reproduction); the one value every module uses.
FINETUNE_LEARNING_RATE = 0.05

#: Largest allowed ``augment-shift`` (pixels of random translation).
MAX_AUGMENT_SHIFT = 8


@dataclass(frozen=True)
class JobConfig:
    """Validated run configuration (field ``x_y`` is run-config key ``x-y``)."""

    method: str = "joint-dp"
    num_owners: int = 16
    num_rounds: int = 5
    local_epochs: int = 2
    batch_size: int = 16
    learning_rate: float = 0.1
    personal_learning_rate: float = 0.1
    server_learning_rate: float = 1.0
    ema_decay: float = 0.0
    #: Joint DP only: before it is evaluated after the last round, each owner's model
    #: (broadcast shared + personal parameters) is adapted to the owner's own training
    #: records by this many epochs of plain SGD on *all* parameters (0 = none). The
    #: adapted copy is the owner's own model: it is never stored or sent, so it costs
    #: no privacy.
    finetune_epochs: int = 0
    finetune_learning_rate: float = FINETUNE_LEARNING_RATE
    #: Pixels of random translation applied to the owner's own (non-private) training
    #: batches of image records: personal parameters, per-silo, FedAvg, adaptation
    #: (0 = none). DP-SGD releases are never augmented, so no privacy cost.
    augment_shift: int = 0
    personal_layers: str = r"^fc1\."
    personal_coupling: str = "decoupled"
    #: Decoupled joint DP: the public values of the personal parameters in the model
    #: a release is computed on (:data:`RELEASE_PERSONAL`). Either is a constant known
    #: before any data is seen, so the release is plain DP-SGD (or a plain clipped
    #: sum) on the shared parameters and its ledger event is the same.
    release_personal: str = "seeded"
    privacy_unit: str = "record"
    records_per_user: int = 1
    user_batch_size: float = 0.0
    noise_placement: str = "local"
    target_epsilon: float = 8.0
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    clipping_norm: float = 1.0
    accountant: str = "pld"
    #: The neighbouring relation epsilon is stated for (:data:`RELATIONS`):
    #: ``add-remove`` (one unit present or absent) or ``replace-one`` (one unit's data
    #: replaced, the joint-DP paper's definition). The ledger and the calibration use it.
    neighbouring: str = "add-remove"
    fraction_train: float = 1.0
    #: Distributed noise: the fraction of a round's owners that may drop out (after the
    #: set-up of secure aggregation) while the round is still released; every owner's
    #: noise share is planned for the fewest survivors, ``ceil((1 - f) n)``.
    dropout_tolerance: float = 0.1
    #: Distributed noise: owners that may pool their noise shares with the server; the
    #: noise the other survivors bring still meets the target.
    colluding_owners: int = 0
    min_valid_fraction: float = 0.5
    round_timeout: float = 3600.0
    #: Rounds in a row with no usable reply (every owner dropped, or the round
    #: skipped for too few valid replies) after which the run ends as failed.
    max_skipped_rounds: int = 3
    dataset: str = "digits"
    data_dir: str = ""
    max_records: int = 0
    classes_per_owner: int = 8
    partitioner: str = "balanced"
    validation_fraction: float = 0.0
    #: Where the validation split comes from when ``validation_fraction`` > 0:
    #: ``carve`` (the owner's own training records) or ``pool`` (training-set
    #: records outside ``max_records``, dealt like the test split; see
    #: :mod:`flwr_jdp.data.partition`).
    validation_source: str = "carve"
    model: str = "seed-cnn"
    norm: str = "group"
    results_dir: str = ""  # "": a new folder per run (run_folder)
    resume: bool = True
    seed: int = 0
    noise_seed: int = -1
    #: Every Gaussian noise draw of a release (and the DP-SGD Poisson sampling) straight
    #: from the OS CSPRNG in float64, as the sum of four draws
    #: (:func:`flwr_jdp.privacy.mechanisms.secure_gaussian`); needs ``noise-seed`` < 0.
    secure_noise: bool = False

    # ----------------------------------------------------------- derived
    @property
    def dp(self) -> bool:
        """True for the private methods (joint-DP and full-DP)."""
        return self.method in ("joint-dp", "full-dp")

    @property
    def effective_personal_rule(self) -> str:
        """The personal rule the method uses: full-DP and FedAvg share everything,
        per-silo keeps everything personal."""
        if self.method in ("full-dp", "fedavg"):
            return ""
        if self.method == "per-silo":
            return ".*"
        return self.personal_layers

    @property
    def decoupled(self) -> bool:
        """True when the shared release must not see the owner's trained personal
        parameters: a private method, personal parameters, a record or user unit and
        ``personal-coupling = decoupled``. (With the owner unit the whole owner is
        the unit, so its personal state may shape its clipped update.)"""
        return (self.dp and self.method == "joint-dp" and self.unit is not PrivacyUnit.OWNER
                and self.personal_coupling == "decoupled")

    @property
    def unit(self) -> PrivacyUnit:
        return PrivacyUnit(self.privacy_unit)

    @property
    def placement(self) -> NoisePlacement:
        return NoisePlacement(self.noise_placement)

    @property
    def calibrate(self) -> bool:
        """True when the noise multiplier is calibrated from the target epsilon."""
        return self.noise_multiplier == 0.0

    @property
    def noise_seed_or_none(self) -> int | None:
        """Seed for noise and sampling; None means the OS CSPRNG."""
        return None if self.noise_seed < 0 else self.noise_seed

    def to_dict(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}


PARTITIONERS = ("balanced", "pathological")


_key = config_key


def parse_config(run_config: dict[str, Any]) -> JobConfig:
    """Build and validate a :class:`JobConfig` from a Flower run config.

    Unknown keys are ignored (other apps may share the run config); every known key
    is type-checked and range-checked (:mod:`flwr_jdp.config_check`).
    """
    cfg = parse_dataclass(JobConfig, run_config)
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Range checks; raises :class:`ConfigError` naming the key and allowed range."""
    def need(ok: bool, name: str, allowed: str) -> None:
        require(ok, config_key(name), allowed, getattr(cfg, name))

    def finite(name: str) -> bool:
        return math.isfinite(getattr(cfg, name))

    need(cfg.method in METHODS, "method", f"one of {METHODS}")
    need(cfg.num_owners >= 0, "num_owners", ">= 0 (0: every node that answers the set-up, drop-in apps)")
    need(cfg.num_rounds >= 1, "num_rounds", ">= 1")
    need(cfg.local_epochs >= 1, "local_epochs", ">= 1")
    need(cfg.batch_size >= 1, "batch_size", ">= 1")
    for name in ("learning_rate", "personal_learning_rate", "server_learning_rate"):
        need(finite(name) and getattr(cfg, name) > 0, name, "> 0 and finite")
    need(finite("ema_decay") and 0 <= cfg.ema_decay < 1, "ema_decay",
         "in [0, 1) (0 = evaluate the last aggregate; no privacy cost either way)")
    need(cfg.finetune_epochs >= 0, "finetune_epochs", ">= 0 epochs (0 = evaluate without adapting)")
    need(cfg.finetune_epochs == 0 or cfg.method == "joint-dp", "finetune_epochs",
         "0 unless method = 'joint-dp' (an adapted model uses its owner's data without noise, "
         "which only joint DP allows)")
    need(finite("finetune_learning_rate") and cfg.finetune_learning_rate > 0, "finetune_learning_rate",
         "> 0 and finite")
    need(0 <= cfg.augment_shift <= MAX_AUGMENT_SHIFT, "augment_shift",
         f"in [0, {MAX_AUGMENT_SHIFT}] pixels of random translation of the owner's own training images (0 = none)")
    need(cfg.privacy_unit in UNITS, "privacy_unit", f"one of {UNITS}")
    need(cfg.records_per_user >= 1, "records_per_user", ">= 1")
    need(finite("user_batch_size") and cfg.user_batch_size >= 0, "user_batch_size",
         ">= 0 expected users per DP batch (user unit; 0 = batch-size / records-per-user)")
    need(cfg.noise_placement in PLACEMENTS, "noise_placement", f"one of {PLACEMENTS}")
    need(finite("target_epsilon") and cfg.target_epsilon > 0, "target_epsilon", "> 0 and finite")
    need(finite("noise_multiplier") and cfg.noise_multiplier >= 0, "noise_multiplier",
         ">= 0 (0 = calibrate to target-epsilon)")
    need(finite("delta") and 0 < cfg.delta < 1, "delta", "in (0, 1)")
    need(finite("clipping_norm") and cfg.clipping_norm > 0, "clipping_norm", "> 0 and finite")
    need(cfg.accountant in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}")
    need(cfg.neighbouring in RELATIONS, "neighbouring", f"one of {RELATIONS}")
    if cfg.dp and cfg.accountant == "rdp" and cfg.neighbouring == "replace-one" and samples(cfg):
        raise ConfigError(
            "run-config keys 'accountant'='rdp' and 'neighbouring'='replace-one' cannot be combined "
            f"when releases are Poisson-sampled (privacy-unit={cfg.privacy_unit!r}, "
            f"noise-placement={cfg.noise_placement!r}, fraction-train={cfg.fraction_train!r}): "
            "RDP has no replace-one bound for sampled releases; use accountant='pld'"
        )
    if cfg.secure_noise and cfg.noise_seed >= 0:
        raise ConfigError(
            "run-config keys 'secure-noise'=true and 'noise-seed'="
            f"{cfg.noise_seed} cannot be combined: secure noise is drawn from the OS CSPRNG and "
            "cannot be seeded; set noise-seed = -1 or secure-noise = false"
        )
    need(finite("fraction_train") and 0 < cfg.fraction_train <= 1, "fraction_train", "in (0, 1]")
    need(finite("dropout_tolerance") and 0 <= cfg.dropout_tolerance < 0.5, "dropout_tolerance",
         "in [0, 0.5) (the fraction of a round's owners that may drop out; secure aggregation "
         "needs a majority)")
    need(cfg.colluding_owners >= 0, "colluding_owners", ">= 0 owners that may pool their noise shares")
    if cfg.dp and cfg.placement is NoisePlacement.DISTRIBUTED:
        need(cfg.privacy_unit in ("record", "user"), "noise_placement",
             "'local' or 'central' for privacy-unit='owner' ('distributed' secures the central protocol's "
             "one step of all owners' Poisson samples: record or user unit)")
        need(cfg.neighbouring == "add-remove", "neighbouring",
             "'add-remove' with noise-placement='distributed' (its Renyi accounting of Poisson-sampled "
             "Skellam releases has no replace-one bound)")
        need(cfg.num_owners >= 2, "num_owners",
             ">= 2 with noise-placement='distributed': every owner plans its noise share from it")
        survivors = minimum_survivors(cfg.num_owners, cfg.dropout_tolerance)
        need(survivors - cfg.colluding_owners >= 1, "colluding_owners",
             f"< {survivors} (the fewest survivors of a round, from num-owners and dropout-tolerance)")
        need(not cfg.secure_noise, "secure_noise",
             "false with noise-placement='distributed' (its integer noise comes from each owner's generator)")
    need(finite("min_valid_fraction") and 0 <= cfg.min_valid_fraction <= 1,
         "min_valid_fraction", "in [0, 1]")
    need(finite("round_timeout") and cfg.round_timeout > 0, "round_timeout",
         "> 0 seconds (replies later than this are dropped)")
    need(cfg.max_skipped_rounds >= 1, "max_skipped_rounds",
         ">= 1 rounds in a row without enough valid replies before the run fails")
    need(cfg.dataset in DATASETS, "dataset", f"one of {DATASETS}")
    need(cfg.max_records >= 0, "max_records", ">= 0 (0 = all)")
    need(cfg.classes_per_owner >= 1, "classes_per_owner", ">= 1")
    need(cfg.partitioner in PARTITIONERS, "partitioner", f"one of {PARTITIONERS}")
    need(finite("validation_fraction") and 0 <= cfg.validation_fraction < 1,
         "validation_fraction", "in [0, 1) (0 = evaluate on the test split)")
    need(cfg.validation_source in VALIDATION_SOURCES, "validation_source", f"one of {VALIDATION_SOURCES}")
    need(cfg.validation_source == "carve" or cfg.validation_fraction > 0, "validation_source",
         "'carve' unless 'validation-fraction' > 0 (it switches validation on)")
    need(cfg.model == "seed-cnn", "model", "'seed-cnn'")
    need(cfg.norm in ("group", "none"), "norm", "'group' or 'none'")
    if cfg.method == "joint-dp":
        try:
            re.compile(cfg.personal_layers)
            compiles = True
        except re.error:
            compiles = False
        need(compiles, "personal_layers", "a valid regular expression")
        need(bool(cfg.personal_layers), "personal_layers", "a non-empty regular expression")
    need(cfg.personal_coupling in COUPLINGS, "personal_coupling",
         "'decoupled' (the joint-DP paper's Algorithm 1, 'interleaved', takes the release's gradients "
         "through personal parameters fitted without noise, which voids the guarantee; not supported)")
    need(cfg.release_personal in RELEASE_PERSONAL, "release_personal", f"one of {RELEASE_PERSONAL}")
    need(cfg.release_personal == "seeded" or cfg.decoupled, "release_personal",
         "'seeded' unless the release is decoupled (method 'joint-dp', privacy-unit 'record' or "
         "'user', personal-coupling 'decoupled', noise on): only a decoupled release holds the "
         "personal parameters at public values")
    need(cfg.fraction_train >= 1 or cfg.privacy_unit == "owner", "fraction_train",
         "1.0 unless privacy-unit='owner' (owner sampling amplifies only owner-level privacy)")


def minimum_survivors(num_owners: int, dropout_tolerance: float) -> int:
    """The fewest owners of a round whose vectors the server unmasks (distributed noise)."""
    return max(1, math.ceil((1.0 - dropout_tolerance) * num_owners - 1e-9))


def samples(cfg: JobConfig) -> bool:
    """True when the run's releases may be Poisson-sampled: the record and user units
    (DP-SGD batches, or the server's sample), and the owner unit with central noise
    and ``fraction-train`` < 1 (owner sampling). The owner unit with local noise, or
    with every owner every round, releases unsampled Gaussians."""
    if cfg.privacy_unit != "owner":
        return True
    return cfg.noise_placement != "local" and cfg.fraction_train < 1


# ------------------------------------------------ other apps' dataclass configs
#: ``value`` as the type of ``default``, or a :class:`ConfigError` naming ``key``
#: (:func:`flwr_jdp.config_check.coerce`).
coerce_value = coerce


def build_from_run_config(cls: type, keymap: dict[str, str], run_config: dict[str, Any]) -> Any:
    """Instantiate the frozen dataclass ``cls`` from the run-config keys of
    ``keymap`` (run-config key -> field name; absent keys keep their defaults;
    :func:`flwr_jdp.config_check.parse_dataclass`)."""
    return parse_dataclass(cls, run_config, keymap)


#: Table of a user's Flower app config that holds flwr-jdp's keys:
#: ``[tool.flwr.app.config.jdp]`` in pyproject.toml, flattened by Flower to
#: ``jdp.<key>`` (for example ``jdp.target-epsilon``), so they never collide with the
#: app's own keys (``learning-rate``, ``local-epochs``, ...).
NAMESPACE = "jdp"

#: Defaults of a drop-in app that differ from the project's own app.
DROPIN_DEFAULTS: dict[str, Any] = {"num-owners": 0, "num-rounds": 3, "local-epochs": 1,
                                   "batch-size": 32, "learning-rate": 0.1, "results-dir": ""}

#: Keys only flwr-jdp's own app reads (its data set, model and training of the
#: personal layers): a drop-in app's own code owns these, so a ``jdp.*`` key among
#: them is refused rather than silently unused.
OWN_APP_KEYS = ("dataset", "data-dir", "max-records", "classes-per-owner", "partitioner",
                "validation-fraction", "validation-source", "model", "norm", "seed",
                "augment-shift", "personal-learning-rate", "finetune-epochs",
                "finetune-learning-rate", "release-personal")


def namespaced_config(run_config: dict[str, Any], **overrides: Any) -> JobConfig:
    """A :class:`JobConfig` from the ``jdp.*`` keys of a user's run config (other
    keys are the app's own and ignored), then keyword ``overrides`` (Python names,
    ``target_epsilon=2.0``). An unknown ``jdp.*`` key or override, or one of
    flwr-jdp's own app (:data:`OWN_APP_KEYS`), fails naming it."""
    prefix = f"{NAMESPACE}."
    known = {_key(f.name) for f in fields(JobConfig)} - set(OWN_APP_KEYS)
    for key in run_config:
        if key.startswith(prefix) and key[len(prefix):] in OWN_APP_KEYS:
            raise ConfigError(f"run-config key '{key}' is a setting of flwr-jdp's own app (its data set, "
                              "model and personal-layer training); in your app your own code owns it: remove it")
    values = dict(DROPIN_DEFAULTS)
    values.update(namespace(run_config, prefix, known))
    values.update(_overrides(overrides, known))
    refuse_misplaced(run_config, prefix, PRIVACY_KEYS)
    with key_prefix(prefix):
        cfg = parse_config(values)
    if "personal-layers" not in values and cfg.method == "joint-dp":
        raise ConfigError(
            f"run-config key '{prefix}personal-layers' is not set: name the layers that stay on each node "
            "by a regular expression on your model's parameter names, e.g. personal-layers = \"^fc3\\\\.\" "
            f"in [tool.flwr.app.config.{NAMESPACE}]")
    return cfg


def with_settings(cfg: JobConfig, **overrides: Any) -> JobConfig:
    """``cfg`` with keyword ``overrides`` (Python names), validated again."""
    values = cfg.to_dict()
    values.update(_overrides(overrides, set(values)))
    return parse_config(values)


def _overrides(overrides: dict[str, Any], known: set[str]) -> dict[str, Any]:
    values = {}
    for name, value in overrides.items():
        key = _key(name)
        if key not in known:
            hint = did_you_mean(name, [k.replace("-", "_") for k in known])
            raise ConfigError(f"unknown flwr-jdp setting '{name}'{hint}; settings are "
                              f"{', '.join(sorted(k.replace('-', '_') for k in known))}")
        values[key] = value
    return values


def dropin_record(cfg: JobConfig) -> dict[str, Any]:
    """The settings a drop-in run uses, as ``results.json`` records them: without
    :data:`OWN_APP_KEYS`, and without the server step sizes the run's release does not
    use (``learning-rate``: central noise, record or user unit; ``server-learning-rate``:
    owner unit)."""
    unused = set(OWN_APP_KEYS)
    if not (cfg.dp and cfg.unit is not PrivacyUnit.OWNER and cfg.placement is not NoisePlacement.LOCAL):
        unused.add("learning-rate")
    if not (cfg.dp and cfg.placement is NoisePlacement.DISTRIBUTED):
        unused.update(("dropout-tolerance", "colluding-owners"))
    if not (cfg.dp and cfg.unit is PrivacyUnit.OWNER):
        unused.add("server-learning-rate")
    return {k: v for k, v in cfg.to_dict().items() if k not in unused}
