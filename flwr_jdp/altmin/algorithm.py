"""Priv-AltMin end to end, as server steps and client steps.

The Flower strategy (:mod:`flwr_jdp.strategies.priv_altmin`) and the
single-process reference (:func:`run_single_process`) call the same functions:
clients compute clipped sums over the users they host
(:func:`flwr_jdp.altmin.statistics.init_statistic`,
:func:`~flwr_jdp.altmin.statistics.altmin_statistics`); the server adds the noise
once to the total (:func:`server_init`, :func:`server_update`). Sums are additive,
so splitting users over SuperNodes changes nothing but floating-point order.

Privacy: user-level (eps, delta)-DP of the released embeddings ``U^(t)`` in the
billboard model (joint DP for the users' ``v_j``), with a trusted aggregator
that sees only per-node sums of clipped statistics (the paper's "central
algorithm implemented by a trusted party or MPC").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flwr_jdp.config_check import need

from .plan import EPOCH_WEIGHTS, BudgetSplit, NoisePlan, calibrate_plan
from .problem import ProblemSpec, Users, subset, true_embedding, user_groups
from .release import GaussianRelease
from .solver import (
    embedding_from_init,
    embedding_from_sums,
    excess_mse,
    final_v,
    newton_update,
    subspace_distance,
)
from .statistics import SPLITS, AltMinSums, SampleSplit, altmin_statistics, init_statistic, newton_statistics

U_STEPS = ("newton", "statistics")


@dataclass(frozen=True)
class AltMinConfig:
    """Hyperparameters of one Priv-AltMin run (all public)."""

    epochs: int = 5
    groups: int = 1              # T of Algorithm 1: disjoint user groups, one per epoch (1 = full batch)
    u_step: str = "newton"       # newton | statistics (Algorithm 2 as the paper)
    zeta: float = 3.0            # init: |y| clip per sample
    clip_init: float = 0.0       # init: per-user Frobenius clip (0 = (m/2) zeta^2)
    clip_a: float = 200.0        # per-user |A_j|_F clip
    clip_b: float = 40.0         # per-user |b_j| clip (statistics step)
    clip_g: float = 5.0          # per-user gradient clip in epoch 1 (newton step)
    clip_decay: float = 0.5      # gradient clip in epoch e: clip_g * clip_decay^(e-1)
    sample_split: str = "full"
    init_share: float = 0.2
    epoch_weights: str = "even"
    a_share: float = 0.3
    ridge_factor: float = 1.0
    target_epsilon: float = 5.0  # inf = non-private (no noise, no clipping)
    delta: float = 1e-6
    accountant: str = "pld"

    def __post_init__(self) -> None:
        need(self.epochs >= 0, "epochs", ">= 0", self.epochs)
        need(self.groups == 1 or self.groups == self.epochs, "groups", f"1 or equal to epochs ({self.epochs})",
             self.groups)
        need(self.zeta > 0, "zeta", "> 0", self.zeta)
        need(self.clip_init >= 0, "clip-init", ">= 0 (0 = (m/2) zeta^2)", self.clip_init)
        need(self.clip_a > 0, "clip-a", "> 0", self.clip_a)
        need(self.clip_b > 0, "clip-b", "> 0", self.clip_b)
        need(self.clip_g > 0, "clip-g", "> 0", self.clip_g)
        need(0 < self.clip_decay <= 1, "clip-decay", "in (0, 1]", self.clip_decay)
        need(self.ridge_factor >= 0, "ridge-factor", ">= 0", self.ridge_factor)
        need(self.target_epsilon > 0, "target-epsilon", "> 0 (inf = non-private)", self.target_epsilon)
        need(0 < self.delta < 1, "delta", "in (0, 1)", self.delta)
        need(self.sample_split in SPLITS, "sample-split", f"one of {SPLITS}", self.sample_split)
        need(self.u_step in U_STEPS, "u-step", f"one of {U_STEPS}", self.u_step)
        need(self.epochs == 0 or 0 < self.init_share < 1, "init-share", "in (0, 1) (unused with epochs = 0)",
             self.init_share)
        need(self.epoch_weights in EPOCH_WEIGHTS, "epoch-weights", f"one of {EPOCH_WEIGHTS}", self.epoch_weights)
        need(0 < self.a_share < 1, "a-share", "in (0, 1)", self.a_share)
        self.budget_split()

    @property
    def private(self) -> bool:
        return bool(np.isfinite(self.target_epsilon))

    def budget_split(self) -> BudgetSplit:
        """The releases one user takes part in: with ``groups = T > 1`` every user
        is in the initialisation and in one epoch only (parallel composition
        over the disjoint groups), so the budget covers init + one epoch."""
        epochs = 1 if self.groups > 1 else self.epochs
        return BudgetSplit(epochs, self.init_share if epochs else 1.0, self.epoch_weights, self.a_share)

    def split(self) -> SampleSplit:
        return SampleSplit(self.sample_split)

    def init_clip(self, samples_per_user: int) -> float:
        if not self.private:
            return np.inf
        return self.clip_init or (samples_per_user // 2) * self.zeta ** 2

    def clips(self, epoch: int) -> tuple[float, float]:
        """Sensitivities ``(S_A, S_2)`` of epoch ``epoch`` (0-based) releases; the
        second is ``b``'s (statistics step) or the gradient's (newton step)."""
        if not self.private:
            return (np.inf, np.inf)
        if self.u_step == "statistics":
            return (self.clip_a, self.clip_b)
        return (self.clip_a, self.clip_g * self.clip_decay ** epoch)

    def noise_plan(self) -> NoisePlan:
        if not self.private:
            return NoisePlan(self.budget_split(), 0.0)
        return calibrate_plan(self.budget_split(), self.target_epsilon, self.delta, self.accountant)


# ----------------------------------------------------------------- server steps
def init_release(cfg: AltMinConfig, plan: NoisePlan, samples_per_user: int) -> GaussianRelease:
    return GaussianRelease(plan.init_multiplier(), max(cfg.init_clip(samples_per_user), 1e-12)
                           if cfg.private else 1.0, symmetric=True)


def epoch_releases(cfg: AltMinConfig, plan: NoisePlan, epoch: int) -> tuple[GaussianRelease, GaussianRelease]:
    za, zb = plan.epoch_multipliers(0 if cfg.groups > 1 else epoch)
    sa, sb = cfg.clips(epoch) if cfg.private else (1.0, 1.0)
    return GaussianRelease(za, sa, symmetric=True), GaussianRelease(zb, sb)


def client_statistics(users: Users, embedding: np.ndarray, cfg: AltMinConfig, epoch: int,
                      num_users: int = 0) -> AltMinSums:
    """What a SuperNode sends in epoch ``epoch``: clipped sums over its users (with
    ``groups > 1``: over its users in group ``S_epoch`` of ``num_users`` users)."""
    if cfg.groups > 1:
        users = subset(users, user_groups(users.ids, num_users, cfg.groups) == epoch)
    clip_a, clip_2 = cfg.clips(epoch)
    stats = newton_statistics if cfg.u_step == "newton" else altmin_statistics
    return stats(users, embedding, clip_a, clip_2, cfg.split())


def server_init(total_m: np.ndarray, release: GaussianRelease, rank: int, rng: np.random.Generator) -> np.ndarray:
    """Algorithm 3 on the server: noise the summed ``M``, top-``k`` eigenvectors."""
    return embedding_from_init(release.release(total_m, rng), rank)


def server_update(
    sums: AltMinSums, releases: tuple[GaussianRelease, GaussianRelease], embedding: np.ndarray,
    cfg: AltMinConfig, rng: np.random.Generator,
) -> np.ndarray:
    """Noise ``A`` (Wigner) and the second statistic, then post-process:
    Algorithm 2 (``statistics``: solve for ``U``, QR) or a Newton step
    (``newton``: ``vec(U) - A~^{-1} g~``, QR)."""
    rel_a, rel_2 = releases
    a = rel_a.release(sums.a, rng)
    second = rel_2.release(sums.b, rng)
    dim, rank = embedding.shape
    if cfg.u_step == "statistics":
        return embedding_from_sums(a, second, dim, rank, rel_a.std, cfg.ridge_factor)
    return newton_update(embedding, a, second, rel_a.std, cfg.ridge_factor)


# --------------------------------------------------------- single-process run
@dataclass
class AltMinResult:
    embedding: np.ndarray
    mse: float
    subspace_distance: float
    noise_multiplier: float
    epsilon: float
    zcdp: float
    history: list[dict] = field(default_factory=list)


def evaluate_users(users: Users, embedding: np.ndarray, spec: ProblemSpec, split: SampleSplit) -> np.ndarray:
    """Each user's excess population MSE with its final local ``v_j``."""
    v = final_v(users.x, users.y, embedding, split)
    return excess_mse(embedding, v, true_embedding(spec), users.v_true)


def run_single_process(
    spec: ProblemSpec, users: Users, cfg: AltMinConfig, rng: np.random.Generator,
    plan: NoisePlan | None = None, eval_users: Users | None = None,
) -> AltMinResult:
    """The whole algorithm in one process over ``users`` (reference for the
    Flower strategy, and the fast path of the experiments). MSE is measured on
    ``eval_users`` (default: ``users``), each fitting ``v_j`` on its own data."""
    plan = plan or cfg.noise_plan()
    split = cfg.split()
    m = users.x.shape[1]
    u_star = true_embedding(spec)
    total = init_statistic(users, cfg.zeta, cfg.init_clip(m), split)
    emb = server_init(total, init_release(cfg, plan, m), spec.rank, rng)
    history = [{"epoch": 0, "subspace_distance": subspace_distance(emb, u_star)}]
    for e in range(cfg.epochs):
        sums = client_statistics(users, emb, cfg, e, spec.num_users)
        emb = server_update(sums, epoch_releases(cfg, plan, e), emb, cfg, rng)
        history.append({"epoch": e + 1, "subspace_distance": subspace_distance(emb, u_star),
                        "clipped_fraction": sums.clipped / max(1, sums.count)})
    mse = float(np.mean(evaluate_users(eval_users or users, emb, spec, split)))
    eps = plan.epsilon(cfg.delta, cfg.accountant) if cfg.private else float("inf")
    return AltMinResult(emb, mse, subspace_distance(emb, u_star), plan.noise_multiplier, eps,
                        plan.zcdp, history)
