"""The FedAvg baseline's ServerApp: Flower's own ``FedAvg`` on every parameter of
the joint-DP app's model, without DP."""

from __future__ import annotations

import time
from logging import INFO

from flwr.app import ArrayRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_jdp.joint_dp.config import parse_config

from .task import initial_model

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_config(context.run_config)
    model = initial_model(cfg)
    strategy = FedAvg(min_train_nodes=cfg.num_owners, min_evaluate_nodes=cfg.num_owners,
                      min_available_nodes=cfg.num_owners)
    t0 = time.time()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=cfg.num_rounds)
    log(INFO, "FedAvg finished in %.1fs; accuracy %s", time.time() - t0,
        result.evaluate_metrics_clientapp.get(cfg.num_rounds))
