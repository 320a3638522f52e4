"""The DP-MTL ServerApp: DP mean-regularized multi-task learning
(:class:`flwr_jdp.strategies.DPMeanRegularizedMTL`) as configured by the run config.
Run the app with ``flwr run apps/dp_mtl``.
"""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.config_check import ConfigError
from flwr_jdp.mtl.config import parse_mtl_config
from flwr_jdp.strategies import DPMeanRegularizedMTL

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Run DP mean-regularized MTL as configured by the run config."""
    try:
        source, cfg, extras = parse_mtl_config(context.run_config)
        num_params = source.model().num_params
    except (ConfigError, FileNotFoundError) as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
    strategy = DPMeanRegularizedMTL(source.num_tasks, num_params, cfg, extras["results-dir"],
                                    extras["noise-seed"], dict(context.run_config),
                                    resume=bool(context.run_config.get("resume", True)))
    strategy.start(grid)
