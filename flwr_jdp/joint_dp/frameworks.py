"""``loss_fn`` helpers for models trained by a framework's own loop.

:meth:`~flwr_jdp.joint_dp.client.JointDPClient.train` takes ``loss_fn(model, batch)``:
the loss of a batch as the loader yields it, which the DP pass evaluates on batches of
one record. For a PyTorch Lightning ``LightningModule`` trained by ``Trainer.fit`` in
the user's train function, that is its own ``training_step``; for a Hugging Face
transformers model called as ``net(**batch)``, it is ``outputs.loss``. Neither helper
imports its framework.

What Lightning does around a ``Trainer.fit`` (checked on pytorch-lightning 2.6, single
device; ``tests/test_framework_examples.py``):

- it trains the ``LightningModule`` object it is given (it must be one: ``Trainer.fit``
  refuses anything else) and iterates the ``DataLoader`` object it is given (it builds
  a new one only for a distributed strategy, to put a ``DistributedSampler`` in);
- the optimizer is the one ``configure_optimizers`` returns, built anew at each
  ``fit``; Lightning hands it to the loop as a ``LightningOptimizer`` wrapper, and its
  automatic optimization calls the wrapped optimizer's ``step(closure=...)``, the
  closure running ``zero_grad``, ``training_step`` and ``backward``: the step is
  called before the batch's loss exists;
- ``training_step``'s ``self.log`` needs the trainer (without one, a warning);
  :func:`lightning_loss` turns logging off while the pass evaluates the loss (a
  per-record value is not a metric to log).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def lightning_loss(model: Any, batch: Any) -> torch.Tensor:
    """``loss_fn`` of a ``LightningModule``: its own ``training_step(batch, 0)`` (the
    ``"loss"`` of a dict it returns), with ``self.log`` / ``self.log_dict`` off for the call."""
    saved = {name: model.__dict__[name] for name in ("log", "log_dict") if name in model.__dict__}
    model.__dict__["log"] = model.__dict__["log_dict"] = _no_log
    try:
        out = model.training_step(batch, 0)
    finally:
        for name in ("log", "log_dict"):
            model.__dict__.pop(name, None)
        model.__dict__.update(saved)
    loss = out["loss"] if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"training_step returned {type(out).__name__}, not a loss tensor (or a dict with 'loss')")
    return loss


def huggingface_loss(model: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """``loss_fn`` of a Hugging Face transformers model: ``model(**batch).loss`` (the
    batch holds its ``labels``)."""
    return model(**batch).loss


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


__all__ = ["huggingface_loss", "lightning_loss"]
