"""LocalGroupDP's noise (Marathe et al., Algorithm 3 and Corollary B.2).

Group privacy: an (eps, delta)-DP mechanism is (g eps, g e^{(g-1) eps} delta)-DP
for groups of ``g`` records. To make a silo's whole run (``steps`` batches at
record rate ``q``) (E, D)-DP for groups of size ``Z``, the paper calibrates the
record-level noise to ``(E / Z, D / (Z e^{(Z-1) E / Z}))``; ``Z`` is the largest
number of records of one subject in the current batch.

Caveat (stated, not fixed): ``Z`` is read from the batch, so the noise scale
depends on the data (it reveals the largest group in the batch). The paper's
guarantee assumes a fixed group size; the ledger cannot certify a data-dependent
noise, so LocalGroupDP's epsilon is reported as the paper's *claimed* budget.
"""

from __future__ import annotations

import functools
import math

from ..privacy.calibration import calibrate
from ..privacy.events import dp_sgd


def group_to_record_budget(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """Corollary B.2: the record-level (eps, delta) that gives (epsilon, delta)
    for groups of ``group_size`` records."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    g = int(group_size)
    return epsilon / g, delta / (g * math.exp((g - 1) * epsilon / g))


def record_to_group_budget(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """Group privacy: record-level (eps, delta) -> (g eps, g e^{(g-1) eps} delta)."""
    g = int(group_size)
    return g * epsilon, g * math.exp((g - 1) * epsilon) * delta


@functools.lru_cache(maxsize=256)
def group_noise_multiplier(group_size: int, epsilon: float, delta: float, sample_rate: float,
                           steps: int, accountant: str = "pld") -> float:
    """``sigma_Z``: the noise multiplier whose ``steps`` Poisson(``q``) steps are
    record-level (E/Z, D/(Z e^{(Z-1)E/Z}))-DP."""
    eps_z, delta_z = group_to_record_budget(epsilon, delta, group_size)
    return calibrate(eps_z, delta_z, lambda z: dp_sgd(z, sample_rate, steps), accountant)


def noise_per_subject_sensitivity(epsilon: float, delta: float, sample_rate: float, steps: int,
                                  max_group: int, accountant: str = "pld") -> list[tuple[int, float, float]]:
    """``(Z, sigma_Z, sigma_Z / Z)`` for ``Z = 1 .. max_group``.

    A subject with ``Z`` records in a LocalGroupDP batch moves its clipped sum by up to
    ``Z C`` while the noise is ``sigma_Z C``, so ``sigma_Z / Z`` is the noise multiplier
    per unit of that subject's sensitivity: the number to set beside the subject-level
    noise multiplier an accounted mechanism (HiGradAvgDP, sensitivity ``C``) needs for
    the same budget. Every subject in a batch has at most ``Z`` records there, so a
    batch is at least as private for every subject as a Gaussian sum of multiplier
    ``min_Z sigma_Z / Z`` at sensitivity 1, *if* the group size ``Z`` were not read
    from the data (it is; see the module caveat)."""
    return [(g, s, s / g) for g in range(1, int(max_group) + 1)
            for s in [group_noise_multiplier(g, epsilon, delta, sample_rate, steps, accountant)]]
