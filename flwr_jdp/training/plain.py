"""Non-private local training and evaluation.

Used for personal parameters (an owner may use its own data freely) and for the
non-private baselines. Only the parameters passed in ``params`` are updated.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .augment import random_shift


def to_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Numpy arrays to torch tensors (no copy where possible)."""
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def record_losses(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every record, averaged over its positions when a record
    holds several predictions (sequence models: logits (N, C, L), targets (N, L)).
    With one label per record this is plain per-record cross-entropy."""
    losses = F.cross_entropy(out, target, reduction="none")
    return losses.reshape(len(target), -1).mean(1)


def correct_fraction(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-record fraction of correctly predicted positions (0 or 1 with one label)."""
    hits = (out.argmax(1) == target).to(torch.float64)
    return hits.reshape(len(target), -1).mean(1)


def train_plain(
    model: nn.Module,
    params: list[torch.nn.Parameter],
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    augment_shift: int = 0,
) -> float:
    """Mini-batch SGD on ``params`` for ``epochs`` epochs; returns the mean loss.

    ``augment_shift`` > 0 translates every batch's images at random by up to that
    many pixels (:func:`~.augment.random_shift`; the owner's own training only).

    The update is plain SGD (``p -= lr * grad``, what ``torch.optim.SGD`` does
    without momentum or weight decay, bit for bit), written out to save building an
    optimizer on every call (thousands of calls per round at hundreds of owners)."""
    if not params or len(y) == 0:
        return float("nan")
    xt, yt = to_tensors(x, y)
    wanted = {id(p) for p in params}
    frozen = [p for p in model.parameters() if id(p) not in wanted and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    model.train()
    losses = []
    try:
        for _ in range(epochs):
            order = torch.randperm(len(yt), generator=generator)
            for start in range(0, len(yt), batch_size):
                idx = order[start : start + batch_size]
                for p in params:
                    p.grad = None
                loss = record_losses(model(random_shift(xt[idx], augment_shift, generator)), yt[idx]).mean()
                loss.backward()
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-lr)
                losses.append(float(loss.detach()))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return float(np.mean(losses)) if losses else float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1024) -> tuple[float, float]:
    """Return (mean cross-entropy, accuracy) of ``model`` on ``(x, y)``; for
    sequence records both are over all predicted positions (every record has as
    many)."""
    if len(y) == 0:
        return float("nan"), float("nan")
    xt, yt = to_tensors(x, y)
    model.eval()
    loss, correct = 0.0, 0.0
    for start in range(0, len(yt), batch_size):
        out = model(xt[start : start + batch_size])
        target = yt[start : start + batch_size]
        loss += float(record_losses(out, target).sum())
        correct += float(correct_fraction(out, target).sum())
    return loss / len(yt), correct / len(yt)
