"""The ClientApp: a transformers model trained by the app's own loop, under joint DP.

The FedAvg original (Flower's quickstart-huggingface style)::

    @app.train()
    def train(msg, context):
        net = build_model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        trainloader, _ = load_data(...)
        train(net, trainloader, epochs, lr)
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                   "metrics": MetricRecord({"num-examples": ...})}), reply_to=msg)

Under joint DP: one line creates ``jdp``; train hands the model, the loader, the loop
and the loss (``net(**batch).loss``: ``huggingface_loss``) to ``jdp.train``; evaluate
loads the owner's model with ``jdp.load`` instead of ``load_state_dict``.
"""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.client import JointDPClient, huggingface_loss
from hftext.task import build_model, load_data
from hftext.task import test as test_fn
from hftext.task import train as train_fn

torch.set_num_threads(1)
app = ClientApp()
jdp = JointDPClient(app, model_fn=build_model, train_data=lambda context: _data(context)[0])


def _data(context: Context):
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"])


def _train_fn(context: Context):
    return lambda net, loader: train_fn(net, loader, context.run_config["local-epochs"],
                                        context.run_config["learning-rate"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainloader, _ = _data(context)
    return jdp.train(msg, context, build_model(), trainloader, _train_fn(context), loss_fn=huggingface_loss)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    trainloader, testloader = _data(context)
    net = jdp.load(build_model(), msg, context, fit=lambda m: _train_fn(context)(m, trainloader))
    loss, accuracy = test_fn(net, testloader)
    metrics = MetricRecord({"loss": loss, "accuracy": accuracy, "num-examples": len(testloader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
