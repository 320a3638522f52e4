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


def _shared_data(folder: str, probe: str):
    """``$FLWR_JDP_DATA_DIR/<folder>`` or ``../shared/data/<folder>`` from the
    repository root, if it holds ``probe``; tests that need it are skipped without it."""
    from pathlib import Path

    roots = [os.environ.get("FLWR_JDP_DATA_DIR", ""), str(Path(__file__).resolve().parents[2] / "shared" / "data")]
    for root in filter(None, roots):
        path = Path(root) / folder
        if (path / probe).is_file():
            return path
    pytest.skip(f"{folder} data not found (set FLWR_JDP_DATA_DIR)")


@pytest.fixture
def femnist_dir():
    """The FEMNIST folder (writers as subjects)."""
    return _shared_data("femnist", "femnist_leaf_subset_300writers.npz")


@pytest.fixture
def shakespeare_dir():
    """The Tiny Shakespeare folder (characters as subjects)."""
    return _shared_data("tinyshakespeare", "input.txt")


@pytest.fixture
def fashion_mnist_dir():
    """The Fashion-MNIST folder (IDX .gz files)."""
    return _shared_data("fashion-mnist", "train-images-idx3-ubyte.gz")


@pytest.fixture(autouse=True)
def _flwr_logs_reach_caplog(request):
    """Flower logs to its own ``flwr`` logger, which a JointDP run detaches from the
    root logger (no duplicated lines): hand its records to ``caplog`` directly, so a
    test's log checks do not depend on whether a run happened earlier in the process."""
    if "caplog" not in request.fixturenames:
        yield
        return
    import logging

    caplog = request.getfixturevalue("caplog")
    logger = logging.getLogger("flwr")
    old = logger.propagate
    logger.propagate = False
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = old
