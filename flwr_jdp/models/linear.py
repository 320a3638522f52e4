"""Linear task models on a flat parameter vector (convex losses, numpy).

A task model is a vector ``w`` of ``num_params`` entries: a ``dim x outputs``
weight matrix (row-major) followed, with ``bias``, by ``outputs`` biases. Losses
are means over the task's records:

- ``squared``: ``0.5 (x.w - y)^2`` (one output; linear regression);
- ``logistic``: binary cross-entropy, labels in {0, 1} (one output);
- ``softmax``: multinomial cross-entropy, labels in ``0..outputs-1``.

All three are convex in ``w``; gradients are exact, so the paper's Theorem 3
setting (convex, smooth local losses) holds for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("squared", "logistic", "softmax")


@dataclass(frozen=True)
class LinearModel:
    """Shape and loss of a linear task model."""

    kind: str
    dim: int
    outputs: int = 1
    bias: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"model kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "softmax" and self.outputs != 1:
            raise ValueError(f"'{self.kind}' has one output, got {self.outputs}")

    @property
    def num_params(self) -> int:
        return self.dim * self.outputs + (self.outputs if self.bias else 0)

    def _split(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        weights = w[: self.dim * self.outputs].reshape(self.dim, self.outputs)
        bias = w[self.dim * self.outputs:] if self.bias else np.zeros(self.outputs)
        return weights, bias

    def scores(self, w: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``x W + b``: shape ``(records, outputs)``."""
        weights, bias = self._split(w)
        return x @ weights + bias

    def loss_grad(self, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Mean loss over the records and its gradient in ``w``."""
        n = max(len(y), 1)
        s = self.scores(w, x)
        if self.kind == "squared":
            r = s[:, 0] - y
            loss = 0.5 * float(np.mean(r ** 2)) if len(y) else 0.0
            ds = r[:, None] / n
        elif self.kind == "logistic":
            z = s[:, 0]
            loss = float(np.mean(np.logaddexp(0.0, z) - y * z)) if len(y) else 0.0
            ds = (1.0 / (1.0 + np.exp(-z)) - y)[:, None] / n
        else:
            s = s - s.max(axis=1, keepdims=True)
            logp = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
            yi = y.astype(int)
            loss = -float(np.mean(logp[np.arange(len(yi)), yi])) if len(y) else 0.0
            ds = np.exp(logp)
            ds[np.arange(len(yi)), yi] -= 1.0
            ds /= n
        grad_w = x.T @ ds
        parts = [grad_w.ravel()]
        if self.bias:
            parts.append(ds.sum(axis=0))
        return loss, np.concatenate(parts)

    def loss(self, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        return self.loss_grad(w, x, y)[0]

    def accuracy(self, w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Classification accuracy (``logistic``: threshold 0; ``softmax``: argmax)."""
        if self.kind == "squared" or not len(y):
            return float("nan")
        s = self.scores(w, x)
        pred = (s[:, 0] > 0).astype(int) if self.kind == "logistic" else s.argmax(axis=1)
        return float(np.mean(pred == y.astype(int)))


__all__ = ["KINDS", "LinearModel"]
