"""The Priv-AltMin ServerApp: :class:`flwr_jdp.strategies.PrivAltMin` as configured by
the run config. Run the app with ``flwr run apps/priv_altmin``.
"""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.altmin.config import parse_altmin_config
from flwr_jdp.config_check import ConfigError
from flwr_jdp.strategies import PrivAltMin

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Run Priv-AltMin as configured by the run config."""
    try:
        spec, cfg, extras = parse_altmin_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "Invalid configuration: %s", err)
        raise
    PrivAltMin(spec, cfg, extras["results-dir"], extras["noise-seed"]).start(grid)
