"""The ServerApp: JointDP runs the rounds.

Under FedAvg this app's ServerApp was Flower's legacy ``server_fn``::

    def server_fn(context: Context):
        num_rounds = context.run_config["num-server-rounds"]
        parameters = ndarrays_to_parameters(get_weights(Net()))
        strategy = FedAvg(fraction_evaluate=1.0, initial_parameters=parameters,
                          evaluate_metrics_aggregation_fn=weighted_average)
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=num_rounds))

    app = ServerApp(server_fn=server_fn)

JointDP is a Message-API strategy: the ServerApp becomes a ``main`` function that
starts it with the same initial model and number of rounds. The owners' metrics are
averaged weighted by their ``num-examples`` as ``weighted_average`` did (the accuracy
so averaged is ``accuracy-weighted``; ``accuracy``, which the round lines print, is the
plain mean over owners).
"""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from digits.task import Net
from flwr_jdp.strategies import JointDP

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = JointDP.from_run_config(context.run_config)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                            num_rounds=context.run_config["num-server-rounds"])
    print(f"final evaluation: {result.evaluate_metrics_clientapp}")
