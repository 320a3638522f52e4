"""Data sets and their partitions among owners and users."""

from .datasets import DATASETS, ArrayDataset, load_dataset, read_idx
from .partition import OwnerData, assign_users, load_partitions

__all__ = ["DATASETS", "ArrayDataset", "OwnerData", "assign_users", "load_dataset", "load_partitions", "read_idx"]
