"""The ServerApp: DP mean-regularized MTL over the nodes (the trusted aggregator
releases only a noisy mean of the tasks' models)."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.strategies import DPMeanRegularizedMTL
from quickstart.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = DPMeanRegularizedMTL.from_run_config(context.run_config)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                            num_rounds=context.run_config["num-server-rounds"],
                            train_config=ConfigRecord({"lr": context.run_config["learning-rate"]}))
    print(f"final evaluation: {result.evaluate_metrics_clientapp}")
