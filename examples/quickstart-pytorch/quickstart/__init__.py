"""A small Flower app: a CNN trained with FedAvg on Fashion-MNIST partitions."""
