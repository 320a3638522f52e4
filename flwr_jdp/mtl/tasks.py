"""Tasks for DP-MTL: synthetic convex tasks and real owners with label skew.

Synthetic (where the theory applies)
    ``m`` tasks of linear regression (or logistic regression) in ``d`` dimensions:
    ``w_k* = w_bar + spread * g_k / sqrt(d)`` with ``g_k ~ N(0, I)``, records
    ``x ~ N(0, I_d)`` and ``y = x . w_k* + noise * N(0, 1)`` (logistic: ``y ~
    Bernoulli(sigmoid(x . w_k*))``). Task ``k`` is generated from ``(seed, k)``
    alone, so a SuperNode generates exactly the tasks it hosts. The excess loss of
    a model ``w`` for task ``k`` is its population loss minus that of ``w_k*``:
    exactly ``||w - w_k*||^2 / 2`` for linear regression (``x ~ N(0, I)``), and
    the test-set difference for logistic regression.

Real (owners with label skew)
    The project's owner partition (:func:`flwr_jdp.data.partition.load_partitions`:
    each owner holds records of ``classes-per-owner`` classes, its test split the
    same classes), images optionally average-pooled, flattened and scaled to unit
    L2 norm per record (public, per-record transformations), for a
    softmax-regression task model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from flwr_jdp.config_check import need
from flwr_jdp.models.linear import LinearModel


@dataclass(frozen=True)
class TaskData:
    """One task's arrays (``true_w``: the generating model, synthetic tasks only)."""

    task_id: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    true_w: np.ndarray | None = None


@dataclass(frozen=True)
class SyntheticSpec:
    """``num_tasks`` related regression tasks (see module docstring)."""

    num_tasks: int = 100
    samples_per_task: int = 50
    dim: int = 20
    kind: str = "squared"
    mean_norm: float = 1.0
    spread: float = 0.3
    noise: float = 0.5
    test_samples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        need(self.num_tasks >= 2, "num-tasks", ">= 2", self.num_tasks)
        need(self.samples_per_task >= 1, "samples-per-task", ">= 1", self.samples_per_task)
        need(self.dim >= 1, "dim", ">= 1", self.dim)
        need(self.mean_norm >= 0, "mean-norm", ">= 0", self.mean_norm)
        need(self.spread >= 0, "spread", ">= 0", self.spread)
        need(self.noise >= 0, "noise", ">= 0", self.noise)
        need(self.test_samples >= 1, "test-samples", ">= 1", self.test_samples)
        need(self.kind in ("squared", "logistic"), "kind", "'squared' or 'logistic'", self.kind)

    def model(self) -> LinearModel:
        return LinearModel(self.kind, self.dim)


def _mean_model(spec: SyntheticSpec) -> np.ndarray:
    g = np.random.default_rng([spec.seed, 0x5EED]).standard_normal(spec.dim)
    return spec.mean_norm * g / np.linalg.norm(g)


def synthetic_task(spec: SyntheticSpec, task_id: int) -> TaskData:
    """Task ``task_id`` of ``spec`` (deterministic in ``(spec.seed, task_id)``)."""
    rng = np.random.default_rng([spec.seed, int(task_id), 1])
    w_true = _mean_model(spec) + spec.spread * rng.standard_normal(spec.dim) / np.sqrt(spec.dim)
    n, nt = spec.samples_per_task, spec.test_samples if spec.kind == "logistic" else 1

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((count, spec.dim))
        z = x @ w_true
        if spec.kind == "squared":
            y = z + spec.noise * rng.standard_normal(count)
        else:
            y = (rng.random(count) < 1.0 / (1.0 + np.exp(-z))).astype(float)
        return x, y

    x, y = draw(n)
    xt, yt = draw(nt)
    return TaskData(int(task_id), x, y, xt, yt, w_true)


@functools.lru_cache(maxsize=8)
def synthetic_tasks(spec: SyntheticSpec, task_ids: tuple[int, ...] | None = None) -> tuple[TaskData, ...]:
    """Tasks ``task_ids`` (default: all) of ``spec``, built once per process."""
    ids = range(spec.num_tasks) if task_ids is None else task_ids
    return tuple(synthetic_task(spec, k) for k in ids)


def excess_loss(model: LinearModel, w: np.ndarray, task: TaskData) -> float:
    """Population loss of ``w`` minus that of the task's generating model."""
    if task.true_w is None:
        return float("nan")
    if model.kind == "squared":
        diff = w - task.true_w
        return 0.5 * float(diff @ diff)
    return model.loss(w, task.x_test, task.y_test) - model.loss(task.true_w, task.x_test, task.y_test)


@functools.lru_cache(maxsize=4)
def label_skew_tasks(dataset: str, data_dir: str, num_tasks: int, classes_per_owner: int,
                     max_records: int, seed: int, validation_fraction: float = 0.0,
                     pool: int = 1) -> tuple[TaskData, ...]:
    """The project's owners of ``dataset`` as tasks (flattened, unit-norm records;
    ``pool > 1``: images average-pooled over ``pool x pool`` blocks first, a fixed
    public transform that shrinks the model, hence the noise norm ``sigma sqrt(d)``).
    ``validation_fraction > 0``: each task's test split is a held-out part of its
    training records instead (for tuning without the test split)."""
    from flwr_jdp.data.partition import load_partitions

    owners = load_partitions(dataset, data_dir, num_tasks, classes_per_owner, max_records, 1, seed,
                             "balanced", validation_fraction)

    def flat(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        if pool > 1:
            h, w = (x.shape[-2] // pool) * pool, (x.shape[-1] // pool) * pool
            x = x[..., :h, :w].reshape(*x.shape[:-2], h // pool, pool, w // pool, pool).mean(axis=(-3, -1))
        x = x.reshape(len(x), -1)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    return tuple(TaskData(o.owner_id, flat(o.x_train), o.y_train.astype(float), flat(o.x_test),
                          o.y_test.astype(float)) for o in owners)


__all__ = ["SyntheticSpec", "TaskData", "excess_loss", "label_skew_tasks", "synthetic_task",
           "synthetic_tasks"]
