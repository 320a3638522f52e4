"""The ServerApp: the strategy runs the rounds over the nodes."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.strategies import JointDP
from quickstart.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = JointDP.from_run_config(context.run_config)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                            num_rounds=context.run_config["num-server-rounds"],
                            train_config=ConfigRecord({"lr": context.run_config["learning-rate"]}))
    print(f"final evaluation: {result.evaluate_metrics_clientapp}")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
