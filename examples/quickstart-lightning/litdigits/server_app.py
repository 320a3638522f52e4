"""The ServerApp: JointDP runs the rounds (under FedAvg: ``FedAvg()``, the same ``start``)."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_jdp.strategies import JointDP
from litdigits.task import LitClassifier

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = JointDP.from_run_config(context.run_config)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(LitClassifier().state_dict()),
                            num_rounds=context.run_config["num-server-rounds"])
    print(f"final evaluation: {result.evaluate_metrics_clientapp}")
