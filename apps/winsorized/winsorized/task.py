"""The winsorized app's users and their data (synthetic, or a real data set's balanced
partition), its run config (:func:`parse_config`) and a user's local update (the
``task.py`` of a Flower app). Nothing here knows about privacy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from flwr_jdp.config_check import need, parse_dataclass
from flwr_jdp.models.linear import LinearModel

DATASETS = ("synthetic", "digits", "fashion-mnist", "mnist")


#: Side of the (square) images of the real data sets, and their number of classes.
IMAGE_SIDE = {"digits": 8, "fashion-mnist": 28, "mnist": 28}


REAL_CLASSES = 10


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class UserData:
    """One user's records (flattened features, integer labels as floats)."""

    user_id: int
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True)
class UserSource:
    """Where the users' records come from (hashable: a node builds its users once)."""

    dataset: str = "synthetic"
    num_users: int = 1000
    samples_per_user: int = 50
    test_samples: int = 50
    dim: int = 10
    classes: int = 4
    separation: float = 1.5
    data_dir: str = ""
    classes_per_user: int = 10
    max_records: int = 0
    pool: int = 2
    data_seed: int = 0

    def __post_init__(self) -> None:
        need(self.dataset in DATASETS, "dataset", f"one of {DATASETS}", self.dataset)
        need(self.num_users >= 2, "num-users", ">= 2", self.num_users)
        need(self.samples_per_user >= 1, "samples-per-user", ">= 1", self.samples_per_user)
        need(self.test_samples >= 1, "test-samples", ">= 1", self.test_samples)
        need(self.dim >= 1, "dim", ">= 1", self.dim)
        need(self.classes >= 2, "classes", ">= 2", self.classes)
        need(math.isfinite(self.separation) and self.separation >= 0, "separation", "finite and >= 0",
             self.separation)
        need(1 <= self.classes_per_user <= REAL_CLASSES, "classes-per-user", f"in [1, {REAL_CLASSES}]",
             self.classes_per_user)
        need(self.max_records >= 0, "max-records", ">= 0 (0 = all)", self.max_records)
        need(self.pool >= 1, "pool", ">= 1", self.pool)

    @property
    def features(self) -> int:
        if self.dataset == "synthetic":
            return self.dim
        side = IMAGE_SIDE[self.dataset]
        return (side // self.pool) ** 2 if self.pool > 1 else side * side

    @property
    def num_classes(self) -> int:
        return self.classes if self.dataset == "synthetic" else REAL_CLASSES

    def model(self) -> LinearModel:
        """Softmax regression with a bias on the flattened, unit-norm records."""
        return LinearModel("softmax", self.features, self.num_classes, bias=True)

    def users(self, user_ids: tuple[int, ...]) -> tuple[UserData, ...]:
        """The users ``user_ids`` (built once per process)."""
        return _users(self, tuple(int(k) for k in user_ids))


@dataclass(frozen=True)
class WinsorizedConfig:
    """Training and privacy settings of a run."""

    rounds: int = 5
    local_steps: int = 5
    lr: float = 0.5
    target_epsilon: float = 2.0
    delta: float = 1e-5
    bound: float = 1.0
    tau: float = 0.5
    range_share: float = 0.25
    noise_seed: int = -1
    secure_noise: bool = False
    results_dir: str = ""

    def __post_init__(self) -> None:
        need(self.rounds >= 1, "rounds", ">= 1", self.rounds)
        need(self.local_steps >= 1, "local-steps", ">= 1", self.local_steps)
        need(math.isfinite(self.lr) and self.lr > 0, "lr", "finite and > 0", self.lr)
        need(math.isfinite(self.target_epsilon) and self.target_epsilon > 0, "target-epsilon",
             "finite and > 0", self.target_epsilon)
        need(0 < self.delta < 1, "delta", "in (0, 1)", self.delta)
        need(math.isfinite(self.bound) and self.bound > 0, "bound", "finite and > 0", self.bound)
        need(math.isfinite(self.tau) and self.tau > 0, "tau", "finite and > 0", self.tau)
        need(0 < self.range_share < 1, "range-share", "in (0, 1)", self.range_share)
        need(self.noise_seed >= -1, "noise-seed", ">= -1 (-1: seeded from the OS CSPRNG)", self.noise_seed)
        need(not (self.secure_noise and self.noise_seed >= 0), "noise-seed",
             "-1 when secure-noise = true (secure noise cannot be seeded)", self.noise_seed)


def parse_config(run_config: dict[str, Any]) -> tuple[UserSource, WinsorizedConfig]:
    """``(users, settings)`` from a Flower run config; a bad value raises
    :class:`~flwr_jdp.config_check.ConfigError` naming its key and range."""
    return parse_dataclass(UserSource, run_config), parse_dataclass(WinsorizedConfig, run_config)


# ---------------------------------------------------------------- users' data
def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _synthetic_user(source: UserSource, user_id: int) -> UserData:
    """Gaussian classes around ``separation``-long random means (one distribution
    for every user), records scaled to unit norm; deterministic in ``(data-seed, user)``."""
    g = np.random.default_rng([source.data_seed, 0x5EED]).standard_normal((source.classes, source.dim))
    means = source.separation * g / np.linalg.norm(g, axis=1, keepdims=True)
    rng = np.random.default_rng([source.data_seed, user_id, 1])

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, source.classes, count)
        return _unit_rows(means[y] + rng.standard_normal((count, source.dim))), y.astype(float)

    x, y = draw(source.samples_per_user)
    xt, yt = draw(source.test_samples)
    return UserData(user_id, x, y, xt, yt)


def _flat(x: np.ndarray, pool: int) -> np.ndarray:
    """Images average-pooled over ``pool x pool`` blocks, flattened, unit norm
    (public per-record transforms)."""
    x = x.astype(np.float64)
    if pool > 1:
        h, w = (x.shape[-2] // pool) * pool, (x.shape[-1] // pool) * pool
        x = x[..., :h, :w].reshape(*x.shape[:-2], h // pool, pool, w // pool, pool).mean(axis=(-3, -1))
    return _unit_rows(x.reshape(len(x), -1))


@functools.lru_cache(maxsize=64)  # one entry per SuperNode a process runs
def _users(source: UserSource, user_ids: tuple[int, ...]) -> tuple[UserData, ...]:
    if source.dataset == "synthetic":
        return tuple(_synthetic_user(source, k) for k in user_ids)
    from flwr_jdp.data.partition import load_partitions

    owners = load_partitions(source.dataset, source.data_dir, source.num_users, source.classes_per_user,
                             source.max_records, 1, source.data_seed)
    return tuple(UserData(k, _flat(owners[k].x_train, source.pool), owners[k].y_train.astype(float),
                          _flat(owners[k].x_test, source.pool), owners[k].y_test.astype(float))
                 for k in user_ids)


def local_update(model: LinearModel, w: np.ndarray, user: UserData, steps: int, lr: float) -> np.ndarray:
    """``steps`` full-batch gradient steps of size ``lr`` from ``w`` on the user's records."""
    w = np.array(w, dtype=np.float64, copy=True)
    for _ in range(steps):
        w -= lr * model.loss_grad(w, user.x_train, user.y_train)[1]
    return w
