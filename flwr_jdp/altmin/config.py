"""Run-config keys of the Priv-AltMin app, validated at start-up.

Every key has a default; a bad value raises :class:`flwr_jdp.config.ConfigError`
naming the key and its allowed range. Problem keys (``num-users``,
``samples-per-user``, ``dim``, ``rank``, ``field-noise``, ``data-seed``) describe
the synthetic users every SuperNode generates for itself; the others are
:class:`~flwr_jdp.altmin.algorithm.AltMinConfig` fields (``x_y`` is key ``x-y``)
plus ``results-dir`` and ``noise-seed``.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from flwr_jdp.config import ConfigError, build_from_run_config

from .algorithm import AltMinConfig
from .problem import ProblemSpec

PROBLEM_KEYS = {"num-users": "num_users", "samples-per-user": "samples_per_user", "dim": "dim",
                "rank": "rank", "field-noise": "field_noise", "data-seed": "seed"}
EXTRA_DEFAULTS = {"results-dir": "results/altmin-run", "noise-seed": -1}


def _algorithm_keys() -> dict[str, str]:
    return {f.name.replace("_", "-"): f.name for f in fields(AltMinConfig)}


def parse_altmin_config(run_config: dict[str, Any]) -> tuple[ProblemSpec, AltMinConfig, dict[str, Any]]:
    """``(problem, algorithm config, extras)`` from a Flower run config."""
    spec = build_from_run_config(ProblemSpec, PROBLEM_KEYS, run_config)
    cfg = build_from_run_config(AltMinConfig, _algorithm_keys(), run_config)
    extras = {k: run_config.get(k, v) for k, v in EXTRA_DEFAULTS.items()}
    try:
        extras["noise-seed"] = int(extras["noise-seed"])
    except (TypeError, ValueError):
        raise ConfigError(f"run-config key 'noise-seed' must be an int, got {extras['noise-seed']!r}") from None
    if not math.isfinite(cfg.target_epsilon) and cfg.epochs < 1:
        raise ConfigError("run-config key 'epochs' must be >= 1 for non-private AltMin")
    return spec, cfg, extras
