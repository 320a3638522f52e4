"""Figure 2's baselines: each user alone, and one DP model for everyone.

- :func:`own_data_mse`: each user fits ``theta_j in R^d`` on its own ``m``
  samples only (minimum-norm least squares; ``m < d`` leaves it underdetermined).
  No sharing, so no privacy cost.
- :func:`single_model_mse`: one ``theta`` for all users by DP linear regression
  on sufficient statistics: ``sum_j c_j X_j^T X_j`` (Wigner noise) and
  ``sum_j c_j X_j^T y_j`` (Gaussian noise), one per-user factor ``c_j`` clipping
  both to ``(clip_a, clip_b)``; user-level (epsilon, delta)-DP with the budget
  split evenly between the two releases, calibrated by PLD.
"""

from __future__ import annotations

import numpy as np

from .plan import BudgetSplit, calibrate_plan
from .problem import ProblemSpec, Users, true_embedding
from .release import GaussianRelease
from .solver import _regularised_inverse_apply
from .statistics import clip_factors


def own_data_mse(users: Users, spec: ProblemSpec) -> float:
    theta_true = users.v_true @ true_embedding(spec).T
    theta = np.stack([np.linalg.lstsq(x, y, rcond=None)[0] for x, y in zip(users.x, users.y)])
    return float(np.mean(np.sum((theta - theta_true) ** 2, axis=1)))


def single_model_mse(
    users: Users, spec: ProblemSpec, target_epsilon: float, delta: float, clip_a: float, clip_b: float,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """``(mean excess MSE, noise multiplier)`` of one DP linear model for all users."""
    gram = np.einsum("jia,jib->jab", users.x, users.x)
    h = np.einsum("jia,ji->ja", users.x, users.y)
    if np.isfinite(target_epsilon):
        plan = calibrate_plan(BudgetSplit(0, 1.0), target_epsilon, delta)  # one overall z
        z = plan.noise_multiplier * np.sqrt(2.0)  # two equal-share releases
        c = np.minimum(clip_factors(np.linalg.norm(gram, axis=(1, 2)), clip_a),
                       clip_factors(np.linalg.norm(h, axis=1), clip_b))
        rel_a, rel_b = GaussianRelease(z, clip_a, symmetric=True), GaussianRelease(z, clip_b)
    else:
        z, c = 0.0, np.ones(len(users))
        rel_a, rel_b = GaussianRelease(0.0, 1.0, True), GaussianRelease(0.0, 1.0)
    a = rel_a.release(np.einsum("j,jab->ab", c, gram), rng)
    b = rel_b.release(np.einsum("j,ja->a", c, h), rng)
    theta = _regularised_inverse_apply(a, b, rel_a.std, 1.0)
    theta_true = users.v_true @ true_embedding(spec).T
    return float(np.mean(np.sum((theta[None, :] - theta_true) ** 2, axis=1))), float(z)
