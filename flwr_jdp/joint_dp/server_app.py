"""The joint-DP ServerApp: validates the run config, then runs :class:`JointDP`.

A bad configuration fails here, before any training, with a message naming the
run-config key and its allowed range.
"""

from __future__ import annotations

import logging
from logging import ERROR

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.strategy import JointDP

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run joint-DP training as configured in ``[tool.flwr.app.config]``."""
    # Flower prints through its own handler; a root handler that a library installed
    # would print every line a second time.
    logging.getLogger("flwr").propagate = False
    try:
        cfg = parse_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
    strategy = JointDP(cfg)
    try:
        strategy.start(grid=grid)
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
