"""What a task does locally: projected gradient descent and fine-tuning.

Both minimise the task's mean-regularized objective (paper eq. 3, with the
task's *mean* loss)

    f_k(w; w~) = l_k(w) + (lambda / 2) ||w - w~||^2

against the broadcast noisy mean ``w~``. Only :func:`local_pgd`'s output is ever
sent, and it lies in the ball ``||w|| <= B`` by construction (:func:`project_ball`):
that is what bounds the sensitivity of the aggregator's mean. Fine-tuning is not
projected (its result never leaves the task).
"""

from __future__ import annotations

import numpy as np

from flwr_jdp.models.linear import LinearModel

from .tasks import TaskData


def project_ball(w: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection onto ``{w : ||w|| <= radius}``."""
    norm = float(np.linalg.norm(w))
    return w if norm <= radius else w * (radius / norm)


def objective_grad(w: np.ndarray, mean: np.ndarray, task: TaskData, model: LinearModel,
                   lam: float) -> tuple[float, np.ndarray]:
    """``f_k(w; w~)`` and its gradient."""
    loss, grad = model.loss_grad(w, task.x_train, task.y_train)
    diff = w - mean
    return loss + 0.5 * lam * float(diff @ diff), grad + lam * diff


def local_pgd(w: np.ndarray, mean: np.ndarray, task: TaskData, model: LinearModel, lam: float,
              lr: float, steps: int, radius: float) -> np.ndarray:
    """``steps`` iterations of ``w <- Pi_B(w - lr (grad l_k(w) + lambda (w - w~)))``
    (Algorithm 1, line 5). The result satisfies ``||w|| <= radius``."""
    w = project_ball(np.asarray(w, dtype=float), radius)
    for _ in range(int(steps)):
        _, grad = objective_grad(w, mean, task, model, lam)
        w = project_ball(w - lr * grad, radius)
    return w


def finetune(w: np.ndarray, mean: np.ndarray, task: TaskData, model: LinearModel, lam: float,
             lr: float, steps: int) -> np.ndarray:
    """Algorithm 1, line 11: local gradient steps against the final ``w~``; the
    personalized model, which never leaves the task."""
    w = np.asarray(w, dtype=float).copy()
    for _ in range(int(steps)):
        _, grad = objective_grad(w, mean, task, model, lam)
        w = w - lr * grad
    return w


__all__ = ["finetune", "local_pgd", "objective_grad", "project_ball"]
