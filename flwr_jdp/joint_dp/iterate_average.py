"""Exponential moving average (EMA) of the server's shared parameters.

Privacy: none spent. The average is a function of the shared parameters the
server has already produced, each of which is a post-processing of the round's
DP release (the owners' noised updates under local noise, the server's noised sum
under central noise). By the post-processing property the EMA is (epsilon,
delta)-DP for the run's unit, like the aggregates it averages, and the ledger
records nothing for it. What owner j then computes from it with its own data (its
personal layers, its predictions) is seen by j alone, so joint DP still holds: all
that the other owners see remains DP with respect to j's data.

Why: under DP every round adds fresh noise to the shared parameters, and the last
round's model carries all of it. Averaging the recent iterates (as De et al. 2022
do for DP-SGD) cancels part of that noise at no privacy cost. Training continues from
the raw aggregate; only the model the owners are evaluated with (and build their
personal layers on for evaluation) is the average.

With decay ``beta`` in [0, 1) the average after round ``t`` is the bias-corrected
``m_t / (1 - beta**t)`` of ``m_t = beta * m_{t-1} + (1 - beta) * x_t``, ``m_0 = 0``:
a weighted mean of the round-1..t aggregates with weights proportional to
``beta**(t - i)``, so it does not depend on the initial model. ``beta = 0`` is
the last aggregate itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class SharedParameterEMA:
    """Bias-corrected exponential moving average of named arrays.

    Parameters
    ----------
    decay : float
        ``beta`` in [0, 1) (run-config key ``ema-decay``).
    """

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema-decay must be in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.steps = 0
        self._sum: dict[str, np.ndarray] = {}

    def update(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Fold in one round's aggregate; return the current average."""
        if self._sum and set(arrays) != set(self._sum):
            raise ValueError(f"EMA keys changed: {sorted(arrays)} vs {sorted(self._sum)}")
        b = self.decay
        for k, v in arrays.items():
            x = np.asarray(v, dtype=np.float64)
            self._sum[k] = b * self._sum.get(k, np.zeros_like(x)) + (1.0 - b) * x
        self.steps += 1
        return self.average(like=arrays)

    def average(self, like: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The bias-corrected average (dtypes of ``like`` when given)."""
        if self.steps == 0:
            raise ValueError("no round has been averaged yet")
        scale = 1.0 / (1.0 - self.decay ** self.steps)
        return {k: (s * scale).astype(like[k].dtype if like is not None else np.float32)
                for k, s in self._sum.items()}

    def restore(self, average: Mapping[str, np.ndarray], steps: int) -> None:
        """Continue from a saved :meth:`average` after ``steps`` rounds (resume)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps = int(steps)
        keep = 1.0 - self.decay ** self.steps
        self._sum = {k: np.asarray(v, dtype=np.float64) * keep for k, v in average.items()}


__all__ = ["SharedParameterEMA"]
