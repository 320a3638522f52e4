"""The ClientApp: a LightningModule trained by Trainer.fit, under joint DP.

The FedAvg original (Flower's quickstart-pytorch-lightning style)::

    @app.train()
    def train(msg, context):
        model = LitClassifier(lr)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        trainloader, _ = load_data(...)
        trainer(max_epochs).fit(model, trainloader)
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": ...})}), reply_to=msg)

Under joint DP: one line creates ``jdp``; train hands the model, the loader, the
``Trainer.fit`` call and the loss (the module's own ``training_step``:
``lightning_loss``) to ``jdp.train``; evaluate loads the owner's model with
``jdp.load`` instead of ``load_state_dict``.
"""

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.client import JointDPClient, lightning_loss
from litdigits.task import LitClassifier, load_data, trainer

torch.set_num_threads(1)
app = ClientApp()
jdp = JointDPClient(app, model_fn=LitClassifier, train_data=lambda context: _data(context)[0])


def _data(context: Context):
    return load_data(context.node_config["partition-id"], context.node_config["num-partitions"])


def _fit(context: Context):
    return lambda model, loader: trainer(context.run_config["max-epochs"]).fit(model, loader)


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainloader, _ = _data(context)
    return jdp.train(msg, context, LitClassifier(context.run_config["learning-rate"]), trainloader, _fit(context),
                     loss_fn=lightning_loss)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    trainloader, testloader = _data(context)
    model = jdp.load(LitClassifier(context.run_config["learning-rate"]), msg, context,
                     fit=lambda m: _fit(context)(m, trainloader))
    results = trainer().test(model, testloader, verbose=False)[0]
    metrics = MetricRecord({"loss": results["test_loss"], "accuracy": results["test_acc"],
                            "num-examples": len(testloader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
