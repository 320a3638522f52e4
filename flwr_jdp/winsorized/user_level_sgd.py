"""User-level DP-SGD (Levy et al., Algorithm 4) for an owner that hosts many users.

Each step is one query: every user computes its *average* gradient over its own
``m`` records at the current model, and a user-level private mean estimator
answers the query; the model takes a gradient step with the answer. Two
estimators:

- ``winsorized``: :class:`flwr_jdp.winsorized.estimator.WinsorizedMean` (private
  range, winsorize, Gaussian noise, randomized rotation): its noise scales with
  the concentration radius ``tau`` of the users' average gradients, which shrinks
  like ``1/sqrt(m)``;
- ``clipped``: each user's average gradient clipped to L2 norm ``B`` and the
  Gaussian mechanism (sensitivity ``2B/n``), the naive user-level baseline.

Privacy guarantee: user level (one user's whole data; replace-one, ``n`` public):
``steps`` compositions of the estimator's events (both of the winsorized
estimator's releases each step), returned as one ``DpEvent`` for the ledger.
Every user takes part in every step (no amplification claimed).
"""

from __future__ import annotations

from dataclasses import dataclass

import dp_accounting as dpa
import numpy as np

from flwr_jdp.models.linear import LinearModel
from flwr_jdp.privacy import events as ev
from flwr_jdp.winsorized.estimator import WinsorizedMean, clipped_gaussian_mean


@dataclass(frozen=True)
class UserData:
    """One user's records."""

    x: np.ndarray
    y: np.ndarray


def average_gradients(model: LinearModel, w: np.ndarray, users: list[UserData]) -> np.ndarray:
    """Each user's mean gradient over its own records: shape ``(n, params)``."""
    return np.stack([model.loss_grad(w, u.x, u.y)[1] for u in users])


def user_level_dp_sgd(model: LinearModel, users: list[UserData], steps: int, lr: float,
                      estimator: WinsorizedMean | None, rng: np.random.Generator,
                      clip: float = 1.0, noise_multiplier: float = 1.0,
                      w0: np.ndarray | None = None) -> tuple[np.ndarray, dpa.DpEvent]:
    """Run ``steps`` user-level private gradient steps; return ``(w, event)``.

    ``estimator=None`` uses the clipped Gaussian mean (``clip``, ``noise_multiplier``)."""
    w = np.zeros(model.num_params) if w0 is None else np.asarray(w0, dtype=float).copy()
    for _ in range(int(steps)):
        grads = average_gradients(model, w, users)
        if estimator is not None:
            g = np.asarray(estimator.estimate(grads, rng)).ravel()
        else:
            g = clipped_gaussian_mean(grads, clip, noise_multiplier, rng)
        w = w - lr * g
    one = estimator.event() if estimator is not None else ev.gaussian(noise_multiplier)
    return w, (dpa.SelfComposedDpEvent(one, int(steps)) if steps > 1 else one)


__all__ = ["UserData", "average_gradients", "user_level_dp_sgd"]
