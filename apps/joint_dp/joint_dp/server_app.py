"""flwr-jdp's own ServerApp (``flwr run apps/joint_dp``, ``flwr run .``): validates the
run config, builds the seed CNN and runs :class:`JointDP` on it, as a user's ServerApp does.

A bad configuration fails here, before any training, with a message naming the
run-config key and its allowed range.
"""

from __future__ import annotations

import logging
from logging import ERROR

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, JobConfig, parse_config
from flwr_jdp.params import split_parameters
from flwr_jdp.strategies import JointDP

from .task import initial_model

app = ServerApp()


def initial_arrays(cfg: JobConfig) -> ArrayRecord:
    """The seed CNN's parameters (the ClientApp builds the same model). Its personal
    parameters are the public values every owner starts from and computes its
    releases with; under ``release-personal = "zero-head"`` those of the model's
    head (FC layers) are zero."""
    model = initial_model(cfg)
    values = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    if cfg.release_personal == "zero-head":
        split = split_parameters(model, cfg.effective_personal_rule, allow_empty=True)
        head = tuple(getattr(model, "HEAD_PREFIXES", ()))
        for n in split.personal:
            if head and n.startswith(head):
                values[n] = np.zeros_like(values[n])
    return protocol.to_record(values)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run joint-DP training as configured in ``[tool.flwr.app.config]``."""
    # Flower prints through its own handler; a root handler that a library installed
    # would print every line a second time.
    logging.getLogger("flwr").propagate = False
    try:
        cfg = parse_config(context.run_config)
        strategy = JointDP(cfg)
        strategy.start(grid=grid, initial_arrays=initial_arrays(cfg))
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
