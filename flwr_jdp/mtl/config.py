"""Run-config keys of the DP-MTL app, validated at start-up.

Every key has a default; a bad value raises :class:`flwr_jdp.config.ConfigError`
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
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from flwr_jdp.config import ConfigError, build_from_run_config, coerce_value

from .algorithm import MTLConfig
from .models import LinearModel
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
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_tasks < 2:
            raise ValueError(f"num-tasks must be >= 2, got {self.num_tasks}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"validation-fraction must be in [0, 1), got {self.validation_fraction}")
        if self.pool < 1:
            raise ValueError(f"pool must be >= 1, got {self.pool}")
        if not 1 <= self.classes_per_owner:
            raise ValueError(f"classes-per-owner must be >= 1, got {self.classes_per_owner}")

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
    source = build_from_run_config(TaskSource, _keys(TaskSource), run_config)
    if source.dataset == "synthetic":
        try:
            source.synthetic_spec()
        except ValueError as err:
            raise ConfigError(f"run-config key {err}") from None
    cfg = build_from_run_config(MTLConfig, _keys(MTLConfig), run_config)
    extras = {k: run_config.get(k, v) for k, v in EXTRA_DEFAULTS.items()}
    extras["noise-seed"] = coerce_value("noise-seed", extras["noise-seed"], -1)
    extras["results-dir"] = str(extras["results-dir"])
    return source, cfg, extras


__all__ = ["DATASETS", "TaskSource", "parse_mtl_config"]
