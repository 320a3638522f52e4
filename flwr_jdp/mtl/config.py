"""Run-config keys of the DP-MTL app, validated at start-up.

Every key has a default; a bad value raises :class:`flwr_jdp.joint_dp.config.ConfigError`
naming the key and its allowed range.

- Tasks: ``dataset`` (``synthetic`` | ``digits`` | ``fashion-mnist`` | ``mnist``),
  ``num-tasks``; synthetic tasks: ``samples-per-task``, ``dim``, ``kind``
  (``squared`` | ``logistic``), ``mean-norm``, ``spread``, ``noise``,
  ``test-samples``; real tasks: ``data-dir``, ``classes-per-owner``,
  ``max-records``, ``validation-fraction`` (> 0: evaluate on held-out training
  records, for tuning), ``pool`` (average-pool images over ``pool x pool``
  blocks); both: ``data-seed``.
- Algorithm 1: the :class:`~flwr_jdp.mtl.algorithm.MTLConfig` fields (``lambda``,
  ``radius``, ``rounds``, ``local-steps``, ``lr``, ``finetune-steps``,
  ``finetune-lr``, ``target-epsilon``, ``delta``, ``calibration``,
  ``fraction-train``, ``neighbouring``, ``accountant``).
- ``results-dir``, ``noise-seed`` (-1: the OS CSPRNG).

A user's own Flower app (:class:`flwr_jdp.mtl.client.MTLClient` and
:meth:`DPMeanRegularizedMTL.from_run_config <flwr_jdp.strategies.DPMeanRegularizedMTL.from_run_config>`)
puts the keys in a ``[tool.flwr.app.config.jdp]`` table, which Flower flattens to
``jdp.<key>``: :func:`namespaced_mtl_config`. There the tasks are the app's own
(one per node, ``num-tasks = 0``: as many as the nodes' ``num-partitions``) and its
own train function does the local work, so the keys of the numpy app's tasks and
steps (``dataset``, ``local-steps``, ``lr``, ``finetune-steps``, ...) are refused, and
so are ``lambda``, ``radius``, ``calibration`` and the privacy keys written outside
the ``jdp`` table (:data:`MTL_KEYS_REFUSED_OUTSIDE`), naming the table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from flwr_jdp.config_check import (
    PRIVACY_KEYS,
    ConfigError,
    coerce,
    namespace,
    need,
    parse_dataclass,
    refuse_misplaced,
)
from flwr_jdp.models.linear import LinearModel

from .algorithm import MTLConfig
from .tasks import SyntheticSpec, TaskData, label_skew_tasks, synthetic_tasks

DATASETS = ("synthetic", "digits", "fashion-mnist", "mnist")


@dataclass(frozen=True)
class TaskSource:
    """Where the tasks come from (hashable: tasks are cached per process)."""

    dataset: str = "synthetic"
    num_tasks: int = 100
    samples_per_task: int = 50
    dim: int = 20
    kind: str = "squared"
    mean_norm: float = 1.0
    spread: float = 0.3
    noise: float = 0.5
    test_samples: int = 2000
    data_dir: str = ""
    classes_per_owner: int = 8
    max_records: int = 0
    validation_fraction: float = 0.0
    pool: int = 1
    data_seed: int = 0

    def __post_init__(self) -> None:
        need(self.dataset in DATASETS, "dataset", f"one of {DATASETS}", self.dataset)
        need(self.num_tasks >= 2, "num-tasks", ">= 2", self.num_tasks)
        need(0 <= self.validation_fraction < 1, "validation-fraction", "in [0, 1)", self.validation_fraction)
        need(self.pool >= 1, "pool", ">= 1", self.pool)
        need(self.classes_per_owner >= 1, "classes-per-owner", ">= 1", self.classes_per_owner)

    def synthetic_spec(self) -> SyntheticSpec:
        return SyntheticSpec(self.num_tasks, self.samples_per_task, self.dim, self.kind,
                             self.mean_norm, self.spread, self.noise, self.test_samples, self.data_seed)

    def tasks(self, task_ids: tuple[int, ...] | None = None) -> tuple[TaskData, ...]:
        """The tasks ``task_ids`` (default all), built once per process."""
        if self.dataset == "synthetic":
            return synthetic_tasks(self.synthetic_spec(), task_ids)
        every = label_skew_tasks(self.dataset, self.data_dir, self.num_tasks, self.classes_per_owner,
                                 self.max_records, self.data_seed, self.validation_fraction,
                                 self.pool)
        return every if task_ids is None else tuple(every[k] for k in task_ids)

    def model(self) -> LinearModel:
        if self.dataset == "synthetic":
            return self.synthetic_spec().model()
        first = self.tasks((0,))[0]
        num_classes = {"digits": 10, "fashion-mnist": 10, "mnist": 10}[self.dataset]
        return LinearModel("softmax", first.x_train.shape[1], num_classes, bias=True)


EXTRA_DEFAULTS = {"results-dir": "results/mtl-run", "noise-seed": -1}


def _keys(cls) -> dict[str, str]:  # noqa: ANN001
    return {("lambda" if f.name == "lam" else f.name.replace("_", "-")): f.name for f in fields(cls)}


def parse_mtl_config(run_config: dict[str, Any]) -> tuple[TaskSource, MTLConfig, dict[str, Any]]:
    """``(task source, Algorithm 1 config, extras)`` from a Flower run config."""
    source = parse_dataclass(TaskSource, run_config, _keys(TaskSource))
    if source.dataset == "synthetic":
        source.synthetic_spec()  # its checks name the synthetic keys
    cfg = parse_dataclass(MTLConfig, run_config, _keys(MTLConfig))
    extras = {k: run_config.get(k, v) for k, v in EXTRA_DEFAULTS.items()}
    extras["noise-seed"] = coerce("noise-seed", extras["noise-seed"], -1)
    extras["results-dir"] = str(extras["results-dir"])
    return source, cfg, extras


#: Keys of the numpy app only: the drop-in app's data, local steps and fine-tuning
#: are its own (its data loaders and train function).
NUMPY_APP_ONLY = tuple(k for k in _keys(TaskSource) if k != "num-tasks") + (
    "local-steps", "lr", "finetune-steps", "finetune-lr")
#: ``jdp.*`` keys of a drop-in DP-MTL app, with the defaults that differ from the numpy app's.
DROPIN_EXTRAS: dict[str, Any] = {"num-tasks": 0, "results-dir": "", "noise-seed": -1, "resume": True,
                                 "max-skipped-rounds": 3}
NAMESPACE = "jdp"
#: DP-MTL keys no app is likely to use for itself (besides :data:`PRIVACY_KEYS`): one
#: outside the ``jdp`` table is refused naming the table, not silently ignored. Keys
#: an app may well keep for itself (``rounds``, ``fraction-train``, ``num-tasks``,
#: ``results-dir``, ``resume``) are left to the app.
MTL_KEYS_REFUSED_OUTSIDE = ("lambda", "radius", "calibration")


def dropin_keys() -> tuple[str, ...]:
    """The ``jdp.*`` keys (without the prefix) a drop-in DP-MTL app may set."""
    return tuple(sorted(set(_keys(MTLConfig)) - set(NUMPY_APP_ONLY) | set(DROPIN_EXTRAS)))


def namespaced_mtl_config(run_config: dict[str, Any]) -> tuple[int, MTLConfig, dict[str, Any]]:
    """``(num_tasks, Algorithm 1 config, extras)`` from the ``jdp.*`` keys of a user's
    run config (other keys are the app's own and ignored). ``num_tasks`` 0: one task
    per node, as many as the nodes' ``num-partitions`` (learnt at set-up, before
    the noise is calibrated). Extras: ``results-dir`` ("": a new folder per run),
    ``noise-seed``, ``resume``, ``max-skipped-rounds``. An unknown key, a key of
    the numpy app's tasks, or a bad value fails naming the ``jdp.*`` key."""
    prefix = f"{NAMESPACE}."
    for key in run_config:
        if key.startswith(prefix) and key[len(prefix):] in NUMPY_APP_ONLY:
            raise ConfigError(f"run-config key '{key}' is a key of the numpy DP-MTL app ((apps/dp_mtl)); "
                              "with MTLClient the ClientApp's own data loaders and train function define "
                              "the tasks, their local steps and learning rate")
    refuse_misplaced(run_config, prefix, set(dropin_keys()) & {*PRIVACY_KEYS, *MTL_KEYS_REFUSED_OUTSIDE})
    values = namespace(run_config, prefix, dropin_keys(), "the DP-MTL keys")
    extras = {k: coerce(prefix + k, values.get(k, v), v) for k, v in DROPIN_EXTRAS.items()}
    need(extras["num-tasks"] == 0 or extras["num-tasks"] >= 2, f"{prefix}num-tasks",
         "0 (one task per node) or >= 2", extras["num-tasks"])
    need(extras["max-skipped-rounds"] >= 1, f"{prefix}max-skipped-rounds", ">= 1", extras["max-skipped-rounds"])
    resolved = {prefix + k: v for k, v in values.items()}  # "rounds = 'num-server-rounds'": that key's value
    cfg = parse_dataclass(MTLConfig, resolved, _keys(MTLConfig), prefix)
    return int(extras.pop("num-tasks")), cfg, extras


__all__ = ["DATASETS", "DROPIN_EXTRAS", "TaskSource", "dropin_keys", "namespaced_mtl_config",
           "parse_mtl_config"]
