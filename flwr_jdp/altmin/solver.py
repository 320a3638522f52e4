"""Post-processing of the released statistics (no privacy cost) and local fits.

- :func:`embedding_from_init`: top-``k`` eigenvectors of the released ``M``
  (Algorithm 3, line 3).
- :func:`embedding_from_sums`: ``Z = argmin_u u^T A u - 2 u^T b`` on the released
  ``(A, b)`` and ``U = Q`` of ``QR(Z)`` (Algorithm 2, lines 3-4). The released
  ``A`` may be indefinite; a ridge proportional to the (public) noise level,
  ``ridge_factor * 2 sqrt(dk) * std_A`` (about the spectral norm of the Wigner
  noise), keeps the solve stable.
- :func:`final_v` / :func:`excess_mse`: each user's final model from its own data
  and its population excess risk ``E_x <x, U v_j - U* v_j*>^2 = |U v_j - U* v_j*|^2``
  for ``x ~ N(0, I)`` (the field noise ``sigma_F^2`` is not included).
"""

from __future__ import annotations

import numpy as np

from .statistics import SampleSplit, fit_v


def orthonormal(z: np.ndarray) -> np.ndarray:
    """The Q factor of the reduced QR decomposition (orthonormal columns)."""
    q, _ = np.linalg.qr(z)
    return q


def embedding_from_init(m_released: np.ndarray, rank: int) -> np.ndarray:
    """Top-``rank`` eigenvectors (by eigenvalue) of a symmetric matrix, as columns."""
    sym = 0.5 * (m_released + m_released.T)
    vals, vecs = np.linalg.eigh(sym)
    return vecs[:, np.argsort(vals)[::-1][:rank]]


def embedding_from_sums(
    a: np.ndarray, b: np.ndarray, dim: int, rank: int, noise_std_a: float = 0.0,
    ridge_factor: float = 1.0,
) -> np.ndarray:
    """``U = Q(QR(reshape(argmin_u u^T A u - 2 u^T b)))``."""
    u = _regularised_inverse_apply(a, b, noise_std_a, ridge_factor)
    return orthonormal(u.reshape(dim, rank))


def _regularised_inverse_apply(a: np.ndarray, rhs: np.ndarray, noise_std_a: float, ridge_factor: float) -> np.ndarray:
    n = a.shape[0]
    sym = 0.5 * (a + a.T)
    ridge = ridge_factor * 2.0 * np.sqrt(n) * noise_std_a + 1e-9 * max(1.0, float(np.trace(sym)) / n)
    vals, vecs = np.linalg.eigh(sym)
    vals = np.maximum(vals, 0.0) + ridge  # PSD part of A plus a noise-level ridge
    return vecs @ ((vecs.T @ rhs) / vals)


def newton_update(
    embedding: np.ndarray, a: np.ndarray, grad: np.ndarray, noise_std_a: float, ridge_factor: float = 1.0
) -> np.ndarray:
    """``Q(QR(reshape(vec(U) - A~^{-1} g~)))`` (the Newton step; post-processing)."""
    step = _regularised_inverse_apply(a, grad, noise_std_a, ridge_factor)
    return orthonormal((embedding.reshape(-1) - step).reshape(embedding.shape))


def final_v(x: np.ndarray, y: np.ndarray, embedding: np.ndarray, split: SampleSplit) -> np.ndarray:
    m = x.shape[1]
    return fit_v(x[:, split.final(m)], y[:, split.final(m)], embedding)


def excess_mse(embedding: np.ndarray, v: np.ndarray, true_embedding: np.ndarray, v_true: np.ndarray) -> np.ndarray:
    """Per-user ``|U v_j - U* v_j*|^2``."""
    diff = v @ embedding.T - v_true @ true_embedding.T
    return np.sum(diff * diff, axis=1)


def subspace_distance(embedding: np.ndarray, true_embedding: np.ndarray) -> float:
    """``|(I - U* U*^T) U|_F``."""
    resid = embedding - true_embedding @ (true_embedding.T @ embedding)
    return float(np.linalg.norm(resid))
