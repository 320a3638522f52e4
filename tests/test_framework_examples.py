"""Apps whose training a framework runs: PyTorch Lightning (``Trainer.fit`` on a
``LightningModule``, examples/quickstart-lightning) and Hugging Face transformers
(``net(**batch).loss``, examples/quickstart-huggingface), under joint DP through
``JointDPClient.train(..., loss_fn=...)``.

The ``loss_fn`` helpers and the Lightning behaviour the DP pass has to meet (the loader
object iterated as given; ``optimizer.step(closure=...)`` called before the batch's
``training_step``; ``self.log`` failing outside the loop once a trainer is attached) are
checked here; the in-process runs need ``JointDPClient.train``'s ``loss_fn`` argument."""

from __future__ import annotations

import inspect
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.common.config import flatten_dict

from flwr_jdp.client import JointDPClient, huggingface_loss, lightning_loss
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.strategies import JointDP, load_results

pl = pytest.importorskip("pytorch_lightning")
transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
needs_loss_fn = pytest.mark.skipif(
    "loss_fn" not in inspect.signature(JointDPClient.train).parameters,
    reason="needs JointDPClient.train(..., loss_fn=...) (the DP pass's loss_fn API, branch dppass): a "
           "LightningModule must reach Trainer.fit unwrapped and step(closure) be accepted")


def _example(folder: str, package: str):
    sys.path.insert(0, str(EXAMPLES / folder))
    try:
        client_app = __import__(f"{package}.client_app", fromlist=["app"])
        task = __import__(f"{package}.task", fromlist=["load_data"])
    finally:
        sys.path.remove(str(EXAMPLES / folder))
    return client_app, task


@pytest.fixture(scope="module")
def lit():
    return _example("quickstart-lightning", "litdigits")


@pytest.fixture(scope="module")
def hf():
    return _example("quickstart-huggingface", "hftext")


def test_lightning_loss_is_the_modules_training_step_without_logging(lit):
    _, task = lit
    torch.manual_seed(0)
    model = task.LitClassifier()
    loader, _ = task.load_data(0, 3)
    task.trainer(1).fit(model, loader)  # a trainer is attached: training_step's self.log now raises outside it
    batch = next(iter(loader))
    with pytest.raises(Exception, match="self.log"):
        model.training_step(batch, 0)
    x, y = batch
    loss = lightning_loss(model, batch)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(model(x), y))
    assert loss.requires_grad
    assert "log" not in model.__dict__ and "log_dict" not in model.__dict__  # the module's own methods again

    class DictStep(task.LitClassifier):
        def training_step(self, batch, batch_idx):
            return {"loss": super().training_step(batch, batch_idx) * 2}

    doubled = DictStep()
    doubled.load_state_dict(model.state_dict())
    torch.testing.assert_close(lightning_loss(doubled, batch), 2 * loss)  # a dict's "loss" is taken
    with pytest.raises(TypeError, match="not a loss tensor"):
        lightning_loss(type("M", (), {"training_step": lambda self, b, i: None})(), batch)


def test_what_lightning_does_to_the_model_loader_and_optimizer(lit):
    """Trainer.fit iterates the loader object it is given (no new DataLoader on one
    device), trains the module object itself, and calls the optimizer's
    ``step(closure=...)`` before the batch's ``training_step`` runs (inside the closure)."""
    _, task = lit
    events: list[str] = []
    loader, _ = task.load_data(0, 3)
    iterated = []

    class Spy(type(loader)):
        def __iter__(self):
            iterated.append(self)
            yield from super().__iter__()

    spy = Spy(loader.dataset, batch_size=64)

    class Traced(task.LitClassifier):
        def training_step(self, batch, batch_idx):
            events.append("training_step")
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            opt = super().configure_optimizers()
            step = opt.step

            def traced_step(closure=None):
                events.append("step(closure)" if closure is not None else "step()")
                return step(closure)

            opt.step = traced_step
            return opt

    model = Traced()
    task.trainer(1).fit(model, spy)
    assert iterated == [spy]
    assert model.trainer is not None  # the object given was trained
    assert events == ["step(closure)", "training_step"] * len(spy)


def test_huggingface_loss_is_the_models_own_loss(hf):
    _, task = hf
    torch.manual_seed(0)
    net = task.build_model()
    assert not list(net.named_buffers())  # flwr-jdp's DP pass refuses models with buffers
    batch = next(iter(task.load_data(0, 3)[0]))
    out = net(**batch)
    torch.testing.assert_close(huggingface_loss(net, batch), out.loss)
    one = {k: v[:1] for k, v in batch.items()}  # the pass evaluates batches of one record
    torch.testing.assert_close(huggingface_loss(net, one),
                               torch.nn.functional.cross_entropy(net(**one).logits, one["labels"]))


def _run(example, folder: str, tmp_path, nodes: int, **overrides):
    client_app, task = example
    raw = tomllib.loads((EXAMPLES / folder / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    run_config = flatten_dict(raw)
    run_config.update({"num-server-rounds": 2, "jdp.results-dir": str(tmp_path / "run"), "jdp.noise-seed": 1,
                       **overrides})
    torch.manual_seed(0)
    grid = InProcessGrid(client_app.app, nodes, run_config)
    strategy = JointDP.from_run_config(run_config, node_settle_s=0.0)
    model = client_app.jdp.model_fn()
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=2)
    return strategy, grid, result, run_config


def _check_run(strategy, grid, result, run_config, personal: str, nodes: int):
    assert load_results(run_config["jdp.results-dir"])["status"] == "completed"
    assert 0 < strategy.ledger.epsilon() <= run_config["jdp.target-epsilon"]
    assert result.evaluate_metrics_clientapp[2]["owners"] == nodes
    sent = 0
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        arrays = reply.content.get("arrays")
        if isinstance(arrays, ArrayRecord):
            sent += 1
            assert not any(k.startswith(personal) for k in arrays.keys())
            assert all(np.isfinite(a).all() for a in arrays.to_numpy_ndarrays())
    assert sent == 2 * nodes


@needs_loss_fn
def test_the_lightning_app_trains_under_joint_dp(lit, tmp_path):
    strategy, grid, result, run_config = _run(lit, "quickstart-lightning", tmp_path, nodes=2)
    _check_run(strategy, grid, result, run_config, "head.", nodes=2)
    assert result.evaluate_metrics_clientapp[2]["accuracy"] > 0.2  # 10 classes: chance is 0.1


@needs_loss_fn
def test_the_huggingface_app_trains_under_joint_dp(hf, tmp_path):
    strategy, grid, result, run_config = _run(hf, "quickstart-huggingface", tmp_path, nodes=2)
    _check_run(strategy, grid, result, run_config, "score.", nodes=2)
