"""The FedAvg baseline's ClientApp: plain Flower training on the same data and model
as the joint-DP app, without DP.

One owner per SuperNode (owner id = ``partition-id``); every parameter is sent and
averaged by Flower's own ``FedAvg`` (:mod:`fedavg.server_app`). Used by the
benchmarks to measure what joint DP costs over plain Flower.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_store import owner_generator
from flwr_jdp.training import evaluate, train_plain

from .task import initial_model, owner_data

client = ClientApp()


def _model(context: Context, msg: Message):
    cfg = parse_config(context.run_config)
    data = owner_data(cfg)[int(context.node_config["partition-id"])]
    model = initial_model(cfg)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return cfg, data, model


@client.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    cfg, data, model = _model(context, msg)
    train_plain(model, list(model.parameters()), data.x_train, data.y_train,
                epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.learning_rate,
                generator=owner_generator(cfg, int(msg.content["config"]["server-round"]), data.owner_id))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": len(data.y_train)})})
    return Message(content, reply_to=msg)


@client.evaluate()
def evaluate_owner(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    _, data, model = _model(context, msg)
    loss, acc = evaluate(model, data.x_test, data.y_test)
    content = RecordDict({"metrics": MetricRecord(
        {"num-examples": len(data.y_test), "accuracy": acc, "loss": loss})})
    return Message(content, reply_to=msg)
