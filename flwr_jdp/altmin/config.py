"""Run-config keys of the Priv-AltMin app, validated at start-up.

Every key has a default; a bad value raises :class:`flwr_jdp.joint_dp.config.ConfigError`
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

from flwr_jdp.config_check import coerce, need, parse_dataclass

from .algorithm import AltMinConfig
from .problem import ProblemSpec

PROBLEM_KEYS = {"num-users": "num_users", "samples-per-user": "samples_per_user", "dim": "dim",
                "rank": "rank", "field-noise": "field_noise", "data-seed": "seed"}
EXTRA_DEFAULTS = {"results-dir": "results/altmin-run", "noise-seed": -1}


def _algorithm_keys() -> dict[str, str]:
    return {f.name.replace("_", "-"): f.name for f in fields(AltMinConfig)}


def parse_altmin_config(run_config: dict[str, Any]) -> tuple[ProblemSpec, AltMinConfig, dict[str, Any]]:
    """``(problem, algorithm config, extras)`` from a Flower run config."""
    spec = parse_dataclass(ProblemSpec, run_config, PROBLEM_KEYS)
    cfg = parse_dataclass(AltMinConfig, run_config, _algorithm_keys())
    extras = {k: run_config.get(k, v) for k, v in EXTRA_DEFAULTS.items()}
    extras["noise-seed"] = coerce("noise-seed", extras["noise-seed"], -1)
    need(math.isfinite(cfg.target_epsilon) or cfg.epochs >= 1, "epochs",
         ">= 1 for non-private AltMin (target-epsilon = inf)", cfg.epochs)
    return spec, cfg, extras
