"""What a DP-MTL run tells its user when the numbers cannot work.

- :func:`warn_if_noise_dominates`: once, at start-up (before round 1), one warning
  line when the noise planned for the released mean ``w~`` has a larger expected
  norm (``sigma sqrt(d)``) than the radius ``B`` that bounds the mean of the task
  models: the mean would then carry no signal, and ``lambda`` pulls every task
  towards noise. The ratio ``sigma sqrt(d) / B = z sqrt(d) / (q m)`` does not depend
  on ``B``: only more tasks ``m``, a larger epsilon (smaller ``z``), fewer rounds or a
  smaller model ``d`` lower it.
- :func:`ended_on_skipped_round` (the failure itself is raised by the strategy,
  :class:`~flwr_jdp.strategies.DPMeanRegularizedMTL`): a round in which
  tasks were asked and none sent a valid model ("0 tasks sent": every task dropped,
  refused or diverged) is a *skipped* round (``row["skipped"]``). The accounted
  loop fails the run after ``max-skipped-rounds`` of them in a row; a run whose
  final round is skipped ends ``failed`` too, not ``completed`` (its last mean is
  noise only), with the epsilon spent saved.
- :func:`divergence_hint`: why a task's training became non-finite, naming the
  likely cause (a noise-dominated mean that ``lambda`` pulls towards, or the train
  function's own loss / learning rate).
"""

from __future__ import annotations

import math
from logging import WARNING

import numpy as np
from flwr.common import log

from .algorithm import MTLConfig
from .noise import MeanRelease

#: Where the user reads how to choose ``radius`` and ``lambda``.
GUIDE = "docs/configuration.md#choosing-radius-and-lambda"


def expected_noise_norm(release: MeanRelease, num_params: int) -> float:
    """``E ||N(0, sigma^2 I_d)|| ~ sigma sqrt(d)``: the norm of the noise added to the mean."""
    return float(release.sigma) * math.sqrt(max(int(num_params), 0))


def noise_warning(release: MeanRelease | None, num_params: int | None, cfg: MTLConfig,
                  prefix: str = "") -> str | None:
    """The warning's text when the planned noise norm exceeds the radius, else ``None``."""
    if release is None or not num_params or not cfg.private or release.sigma <= 0:
        return None
    noise = expected_noise_norm(release, num_params)
    if noise <= cfg.radius:
        return None
    ratio = noise / cfg.radius
    m = release.num_tasks
    return (f"DP-MTL: the released mean will carry no signal: its noise has norm ~{noise:.4g} (sigma "
            f"{release.sigma:.4g} x sqrt({num_params} parameters)), {ratio:.3g}x the radius {cfg.radius:g} that "
            f"bounds the mean of the task models, and {prefix}lambda={cfg.lam:g} pulls every task towards it. "
            f"The ratio does not depend on the radius (one above the models' norm only adds noise): use more tasks (~{math.ceil(m * ratio)} instead of {m} "
            f"at this epsilon), a larger {prefix}target-epsilon (now {cfg.target_epsilon:g}), fewer "
            f"{prefix}rounds (now {cfg.rounds}) or a smaller model; meanwhile keep {prefix}lambda small. "
            f"See {GUIDE}")


def warn_if_noise_dominates(release: MeanRelease | None, num_params: int | None, cfg: MTLConfig,
                            prefix: str = "") -> str | None:
    """Log :func:`noise_warning` (one WARNING line) if it applies; return it."""
    text = noise_warning(release, num_params, cfg, prefix)
    if text is not None:
        log(WARNING, "%s", text)
    return text


# ------------------------------------------------------------ skipped rounds
def ended_on_skipped_round(history: list[dict], status: str) -> bool:
    """``status`` would say ``completed`` although the final round was skipped."""
    return status == "completed" and bool(history) and bool(history[-1].get("skipped"))


def trailing_skipped(history: list[dict]) -> int:
    """How many rounds in a row, up to the last, were skipped."""
    n = 0
    for row in reversed(history):
        if not row.get("skipped"):
            break
        n += 1
    return n


def tasks_sent(row: dict) -> str:
    """The round line's ``N tasks sent`` (``skipped`` when tasks were asked and none trained)."""
    return f"{row['tasks']} tasks sent" + (" (skipped: no task trained)" if row.get("skipped") else "")


# ------------------------------------------------------------ a task's divergence
def divergence_hint(mean: np.ndarray, cfg: MTLConfig) -> str:
    """Why training became non-finite: a noise-dominated broadcast mean pulled towards
    by ``lambda``, else the train function's loss or learning rate."""
    norm = float(np.linalg.norm(mean))
    if cfg.lam > 0 and norm > cfg.radius:
        return (f"the broadcast mean has norm {norm:.4g}, over jdp.radius={cfg.radius:g} (no task model is "
                f"larger: the mean is mostly DP noise) and jdp.lambda={cfg.lam:g} pulls the model towards it: "
                "lower jdp.lambda, or lower the noise (the server's start-up warning says how; see "
                f"{GUIDE})")
    return ("a diverging or non-finite loss: the train function's learning rate, or "
            f"jdp.lambda={cfg.lam:g} too large for it (learning rate x lambda must stay well below 1)")


__all__ = ["GUIDE", "divergence_hint", "ended_on_skipped_round", "expected_noise_norm",
           "noise_warning", "tasks_sent", "trailing_skipped", "warn_if_noise_dominates"]
