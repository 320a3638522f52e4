"""A Flower app with a NumPyClient: an MLP on scikit-learn's digits partitions."""
