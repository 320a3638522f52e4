"""The ClientApp: each node trains and evaluates on its own partition."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart.task import Net, load_data
from quickstart.task import test as test_fn
from quickstart.task import train as train_fn

torch.set_num_threads(1)
app = ClientApp()


def _data(context: Context):
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                     data_dir=context.run_config["data-dir"], records=context.run_config["num-records"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = _data(context)
    loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"])
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss,
                                                   "num-examples": len(trainloader.dataset)})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = _data(context)
    loss, accuracy = test_fn(model, testloader)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
