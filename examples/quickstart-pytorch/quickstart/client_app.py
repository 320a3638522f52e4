"""The ClientApp: each node trains and evaluates on its own partition."""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.client import JointDPClient
from quickstart.task import Net, load_data
from quickstart.task import test as test_fn
from quickstart.task import train as train_fn

torch.set_num_threads(1)
app = ClientApp()
jdp = JointDPClient(app, model_fn=Net, train_data=lambda context: _data(context)[0])


def _data(context: Context):
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                     data_dir=context.run_config["data-dir"], records=context.run_config["num-records"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainloader, _ = _data(context)
    return jdp.train(msg, context, Net(), trainloader, lambda net, loader: train_fn(
        net, loader, context.run_config["local-epochs"], msg.content["config"]["lr"]))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    trainloader, testloader = _data(context)
    model = jdp.load(Net(), msg, context, fit=lambda net: train_fn(
        net, trainloader, context.run_config["local-epochs"], context.run_config["learning-rate"]))
    loss, accuracy = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
