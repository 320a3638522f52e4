"""The ClientApp: each node is one task; it trains and evaluates its own model."""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.client import MTLClient
from quickstart.task import Net, load_data
from quickstart.task import test as test_fn
from quickstart.task import train as train_fn

torch.set_num_threads(1)
app = ClientApp()


def _data(context: Context):
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                     data_dir=context.run_config["data-dir"], records=context.run_config["num-records"])


mtl = MTLClient(app, model_fn=Net, train_data=lambda context: _data(context)[0])


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainloader, _ = _data(context)
    return mtl.train(msg, context, Net(), trainloader, lambda net, loader: train_fn(
        net, loader, context.run_config["local-epochs"], msg.content["config"]["lr"]))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, testloader = _data(context)
    model = mtl.load(Net(), msg, context)
    loss, accuracy = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
