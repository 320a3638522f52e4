"""A small Flower app: one CNN per node, trained by DP mean-regularized MTL on Fashion-MNIST partitions."""
