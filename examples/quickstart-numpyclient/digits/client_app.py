"""The ClientApp: a NumPyClient built by client_fn, as Flower's examples write it.

Under FedAvg the last line was ``app = ClientApp(client_fn=client_fn)``; under joint DP
it is ``app = numpy_client_app(client_fn)``. Nothing else changes: ``fit`` trains
``self.net`` on ``self.trainloader`` (flwr-jdp points them at the model and loader of
each of its passes; what ``fit`` returns is not sent), ``evaluate`` tests the owner's
model (its personal layers included) on ``self.valloader``.
"""

import torch
from flwr.app import Context
from flwr.client import NumPyClient

from digits.task import Net, get_weights, load_data, set_weights, test, train
from flwr_jdp.client import numpy_client_app

torch.set_num_threads(1)


class FlowerClient(NumPyClient):
    def __init__(self, net, trainloader, valloader, local_epochs, lr):
        self.net = net
        self.trainloader = trainloader
        self.valloader = valloader
        self.local_epochs = local_epochs
        self.lr = lr
        self.device = torch.device("cpu")
        self.net.to(self.device)

    def fit(self, parameters, config):
        set_weights(self.net, parameters)
        train_loss = train(self.net, self.trainloader, self.local_epochs, self.lr, self.device)
        return get_weights(self.net), len(self.trainloader.dataset), {"train_loss": train_loss}

    def evaluate(self, parameters, config):
        set_weights(self.net, parameters)
        loss, accuracy = test(self.net, self.valloader, self.device)
        return loss, len(self.valloader.dataset), {"accuracy": accuracy}


def client_fn(context: Context):
    net = Net()
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, valloader = load_data(partition_id, num_partitions)
    local_epochs = context.run_config["local-epochs"]
    lr = context.run_config["learning-rate"]
    return FlowerClient(net, trainloader, valloader, local_epochs, lr).to_client()


app = numpy_client_app(client_fn)
