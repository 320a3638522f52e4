"""DP mean-regularized MTL (Algorithm 1): configuration, the aggregator's step,
each task's step, and a single-process reference loop.

Privacy guarantee: task-level (epsilon, delta)-joint DP (unit: one task's whole
data set; ``replace-one`` by default, as the JDP definition, or ``add-remove``).
The aggregator is trusted: it sees every sent ``w_k`` (each projected onto the
ball ``||w|| <= B``); other tasks see only the released means ``w~^1..T``, which
are (epsilon, delta)-DP (:mod:`.noise`); each personalized model is computed by
its own task from its data and those releases (billboard lemma), hence JDP.

The Flower strategy (:class:`flwr_jdp.strategies.DPMeanRegularizedMTL`) and the
ClientApp (the DP-MTL app, ``apps/dp_mtl``) call the same :class:`MeanServer` and
:func:`task_round` / :func:`evaluate_task` as :func:`run_single_process`, so the
two paths agree to rounding for the same noise seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flwr_jdp.config_check import need
from flwr_jdp.models.linear import LinearModel
from flwr_jdp.privacy.backends import ACCOUNTANTS, RELATIONS

from .local import finetune, local_pgd
from .noise import CALIBRATIONS, MeanRelease, plan_release
from .tasks import TaskData, excess_loss


@dataclass(frozen=True)
class MTLConfig:
    """Algorithm 1's knobs (run-config key ``x-y`` is field ``x_y``; ``lambda`` is ``lam``)."""

    lam: float = 1.0
    radius: float = 2.0
    rounds: int = 10
    local_steps: int = 1
    lr: float = 0.1
    finetune_steps: int = 50
    finetune_lr: float = 0.2
    target_epsilon: float = 1.0
    delta: float = 1e-5
    calibration: str = "tight"
    fraction_train: float = 1.0
    neighbouring: str = "replace-one"
    accountant: str = "pld"

    def __post_init__(self) -> None:
        need(self.lam >= 0 and math.isfinite(self.lam), "lambda", ">= 0 and finite", self.lam)
        need(self.radius > 0 and math.isfinite(self.radius), "radius", "> 0 and finite (the ball radius B)",
             self.radius)
        need(self.rounds >= 1, "rounds", ">= 1", self.rounds)
        need(self.local_steps >= 1, "local-steps", ">= 1", self.local_steps)
        need(self.lr > 0, "lr", "> 0", self.lr)
        need(self.finetune_steps >= 0, "finetune-steps", ">= 0", self.finetune_steps)
        need(self.finetune_lr > 0, "finetune-lr", "> 0", self.finetune_lr)
        need(self.target_epsilon > 0, "target-epsilon", "> 0 (inf: no noise)", self.target_epsilon)
        need(0 < self.delta < 1, "delta", "in (0, 1)", self.delta)
        need(self.calibration in CALIBRATIONS, "calibration", f"one of {CALIBRATIONS}", self.calibration)
        need(0 < self.fraction_train <= 1, "fraction-train", "in (0, 1]", self.fraction_train)
        need(self.neighbouring in RELATIONS, "neighbouring", f"one of {RELATIONS}", self.neighbouring)
        need(self.accountant in ACCOUNTANTS, "accountant", f"one of {ACCOUNTANTS}", self.accountant)
        need(self.calibration != "paper" or (self.fraction_train >= 1 and self.neighbouring == "replace-one"),
             "calibration", "'tight' unless fraction-train = 1 and neighbouring = 'replace-one' ('paper' is "
             "Theorem 2: every task every round, replace-one)", self.calibration)

    @property
    def private(self) -> bool:
        return math.isfinite(self.target_epsilon)

    def release(self, num_tasks: int) -> MeanRelease:
        """This configuration's per-round release for ``num_tasks`` tasks."""
        return plan_release(self.target_epsilon, self.delta, self.radius, self.rounds, num_tasks,
                            self.fraction_train, self.neighbouring, self.calibration, self.accountant)


class MeanServer:
    """The trusted aggregator: samples tasks and releases the noisy mean through
    ``release.mechanism(secure)`` (:class:`~flwr_jdp.privacy.mechanisms.GaussianSumMechanism`),
    whose event is the one the ledger records. ``secure``: noise from the OS CSPRNG."""

    def __init__(self, release: MeanRelease, rng: np.random.Generator, secure: bool = False) -> None:
        self.release, self.rng = release, rng
        self.mechanism = release.mechanism(secure)

    def sample(self, task_ids: list[int]) -> list[int]:
        """Poisson sampling at rate ``q`` (all tasks when ``q = 1``)."""
        if self.release.sample_rate >= 1.0:
            return list(task_ids)
        keep = self.rng.random(len(task_ids)) < self.release.sample_rate
        return [k for k, kept in zip(task_ids, keep) if kept]

    def noisy_mean(self, total: np.ndarray) -> np.ndarray:
        """``w~ = (total + N(0, (z B)^2 I)) / D``, i.e. ``total / D + N(0, sigma^2 I)``
        (Algorithm 1, line 8). Non-private (``z = 0``): ``total / D``, no draw."""
        mech = self.mechanism
        if mech.noise_multiplier == 0:
            return total / mech.denominator
        return mech.release_numpy([np.asarray(total, dtype=np.float64)], self.rng)[0]


def task_round(w: np.ndarray, mean: np.ndarray, task: TaskData, model: LinearModel,
               cfg: MTLConfig) -> np.ndarray:
    """One task's round: ``E`` projected gradient steps; the result is sent."""
    return local_pgd(w, mean, task, model, cfg.lam, cfg.lr, cfg.local_steps, cfg.radius)


def evaluate_task(w: np.ndarray, mean: np.ndarray, task: TaskData, model: LinearModel,
                  cfg: MTLConfig) -> dict[str, float]:
    """Fine-tune against ``w~`` (Algorithm 1, line 11) and measure the personalized
    model on the task's own test data (excess loss: synthetic tasks only)."""
    personal = finetune(w, mean, task, model, cfg.lam, cfg.finetune_lr, cfg.finetune_steps)
    return {"excess": excess_loss(model, personal, task),
            "loss": model.loss(personal, task.x_test, task.y_test),
            "accuracy": model.accuracy(personal, task.x_test, task.y_test)}


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average of per-task metrics (NaN-aware)."""
    out = {}
    for key in ("excess", "loss", "accuracy"):
        vals = np.array([r[key] for r in rows], dtype=float)
        out[key] = float(np.nanmean(vals)) if np.any(np.isfinite(vals)) else float("nan")
    return out


def run_single_process(tasks: tuple[TaskData, ...], model: LinearModel, cfg: MTLConfig,
                       noise_seed: int = 0, evaluate_every: bool = False) -> dict:
    """Algorithm 1 in one process (the reference the Flower run must match)."""
    release = cfg.release(len(tasks)) if cfg.private else MeanRelease(cfg.radius, len(tasks), cfg.fraction_train, 0.0, cfg.neighbouring)
    server = MeanServer(release, np.random.default_rng(noise_seed))
    ids = [t.task_id for t in tasks]
    by_id = {t.task_id: t for t in tasks}
    models = {k: np.zeros(model.num_params) for k in ids}
    mean = np.zeros(model.num_params)  # w~^0 = mean of the (data-free) initial models
    history = []
    for rnd in range(1, cfg.rounds + 1):
        total = np.zeros(model.num_params)
        for k in server.sample(ids):
            models[k] = task_round(models[k], mean, by_id[k], model, cfg)
            total += models[k]
        mean = server.noisy_mean(total)
        if evaluate_every or rnd == cfg.rounds:
            metrics = mean_metrics([evaluate_task(models[k], mean, by_id[k], model, cfg) for k in ids])
            history.append({"round": rnd, **metrics})
    eps = release.epsilon(cfg.rounds, cfg.delta, cfg.accountant) if cfg.private else math.inf
    exact = release.epsilon(cfg.rounds, cfg.delta, cfg.accountant, exact=True) if cfg.private else math.inf
    return {"history": history, "final": history[-1], "sigma": release.sigma, "epsilon": eps,
            "exact_epsilon": exact, "noise_multiplier": release.noise_multiplier, "mean": mean}


def local_only(tasks: tuple[TaskData, ...], model: LinearModel, cfg: MTLConfig) -> dict[str, float]:
    """Baseline: each task alone (no communication), ``rounds * local_steps +
    finetune_steps`` plain gradient steps on its own loss (lambda = 0)."""
    rows = []
    for task in tasks:
        w = finetune(np.zeros(model.num_params), np.zeros(model.num_params), task, model, 0.0,
                     cfg.finetune_lr, cfg.rounds * cfg.local_steps + cfg.finetune_steps)
        rows.append({"excess": excess_loss(model, w, task),
                     "loss": model.loss(w, task.x_test, task.y_test),
                     "accuracy": model.accuracy(w, task.x_test, task.y_test)})
    return mean_metrics(rows)


__all__ = ["MTLConfig", "MeanServer", "evaluate_task", "local_only", "mean_metrics",
           "run_single_process", "task_round"]
