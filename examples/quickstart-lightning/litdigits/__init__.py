"""A Flower / PyTorch Lightning app: an MLP classifier on scikit-learn's digits."""
