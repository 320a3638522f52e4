import logging
import os

import pytest
import torch

torch.set_num_threads(1)
logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture
def run_config(tmp_path):
    """A small, fast, seeded run config (digits, 4 owners on 2 nodes)."""
    return {
        "num-owners": 4,
        "num-rounds": 2,
        "local-epochs": 1,
        "batch-size": 32,
        "results-dir": str(tmp_path / "results"),
        "noise-seed": 7,
        "noise-multiplier": 1.0,
        "target-epsilon": 50.0,
    }


def pytest_configure(config):
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
