"""Per-user sufficient statistics of Priv-AltMin, clipped at the user level.

Privacy unit: one **user** (all of the user's samples); neighbouring data sets add
or remove one user. Every statistic below is a sum over users of a per-user
contribution whose norm is bounded by a clipping threshold, so that threshold is
the L2 sensitivity of the sum (upper triangle of a symmetric matrix: its
Frobenius norm bounds the L2 norm of the upper triangle).

Initialisation (Algorithm 3)
    ``M_j = sum_pairs sym(x_a x_b^T / (|x_a| |x_b|)) clip(y_a, zeta) clip(y_b, zeta)``
    over disjoint sample pairs ``(a, b)``, ``sym(A) = (A + A^T) / 2``; each pair's
    term has Frobenius norm <= zeta^2. The user's ``M_j`` is then scaled to
    Frobenius norm <= ``C_init`` (by default ``(m/2) zeta^2``, the paper's bound,
    which then never binds).

Alternating-minimization step (Algorithm 2)
    ``w_ij = vec(x_ij v_j^T)`` (row-major, so ``<w_ij, vec(U)> = x_ij^T U v_j``),
    ``A_j = sum_i w_ij w_ij^T = G_j (x) v_j v_j^T`` with ``G_j = sum_i x_ij x_ij^T``,
    ``b_j = sum_i y_ij w_ij = h_j (x) v_j`` with ``h_j = sum_i y_ij x_ij``.
    flwr-jdp clips the user's *pair* ``(A_j, b_j)`` by one factor
    ``c_j = min(1, C_A / |A_j|_F, C_b / |b_j|)``, so ``|c_j A_j|_F <= C_A`` and
    ``|c_j b_j| <= C_b``. Clipping per user rather than per sample (the paper clips
    each ``w_ij`` to ``eta`` and each ``y_ij`` to ``zeta``, bounding a user by
    ``m eta^2`` and ``m zeta eta``) uses that a user's ``m`` rank-one terms are
    nearly orthogonal: ``|A_j|_F ~ sqrt(m) eta^2``. Scaling ``A_j`` and ``b_j`` by
    the *same* factor keeps the normal equations consistent (``A_j u* = b_j``
    without field noise), so clipping reweights users instead of biasing ``U``.

Newton step (flwr-jdp's default ``u-step``; beyond the paper)
    Release ``A`` as above and, instead of ``b``, the clipped per-user gradient
    ``g_j = A_j vec(U) - b_j`` at the current ``U``; the server takes
    ``vec(U) - A~^{-1} g~`` and orthonormalises. Without noise this is exactly
    Algorithm 2's solve (``A^{-1} b``). With noise, the error of ``A~`` multiplies
    the (shrinking) distance to the optimum instead of ``vec(U)`` itself, and
    ``g_j`` is a residual whose norm falls as ``U`` converges, so a decreasing
    public clipping schedule ``clip_g * decay^epoch`` buys small noise late in
    training. Sensitivities: ``clip_a`` for ``A``, ``clip_g`` for the gradient sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import Users

SPLITS = ("full", "paper")


@dataclass(frozen=True)
class SampleSplit:
    """Which samples of a user are used where (public, data-independent).

    ``full``: every sample for fitting ``v_j``, for the statistics and for the final
    ``v_j`` (section 6's full-batch experiment). ``paper``: Algorithm 1's split:
    ``v_j`` on the first quarter, statistics on the second quarter, the final ``v_j``
    on the second half, the initialisation on the first half.
    """

    name: str = "full"

    def __post_init__(self) -> None:
        if self.name not in SPLITS:
            raise ValueError(f"sample-split must be one of {SPLITS}, got {self.name!r}")

    def fit(self, m: int) -> slice:
        return slice(0, m) if self.name == "full" else slice(0, max(1, m // 4))

    def stats(self, m: int) -> slice:
        return slice(0, m) if self.name == "full" else slice(m // 4, max(m // 4 + 1, m // 2))

    def final(self, m: int) -> slice:
        return slice(0, m) if self.name == "full" else slice(m // 2, m)

    def init(self, m: int) -> slice:
        return slice(0, m) if self.name == "full" else slice(0, max(2, m // 2))


def clip_scalar(y: np.ndarray, bound: float) -> np.ndarray:
    return np.clip(y, -bound, bound)


def clip_factors(norms: np.ndarray, bound: float) -> np.ndarray:
    """``min(1, bound / norm)`` per user (1 for zero norms)."""
    norms = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.minimum(1.0, np.where(norms > 0, bound / np.maximum(norms, 1e-300), 1.0))


def init_statistic(users: Users, zeta: float, clip_init: float, split: SampleSplit) -> np.ndarray:
    """``sum_j c_j M_j`` over ``users`` (``d x d``); each ``|c_j M_j|_F <= clip_init``."""
    m = users.x.shape[1]
    x = users.x[:, split.init(m)]
    y = users.y[:, split.init(m)]
    pairs = x.shape[1] // 2
    xa, xb = x[:, 0 : 2 * pairs : 2], x[:, 1 : 2 * pairs : 2]
    ya = clip_scalar(y[:, 0 : 2 * pairs : 2], zeta)
    yb = clip_scalar(y[:, 1 : 2 * pairs : 2], zeta)
    na = np.linalg.norm(xa, axis=2, keepdims=True)
    nb = np.linalg.norm(xb, axis=2, keepdims=True)
    ua = xa / np.maximum(na, 1e-300) * ya[..., None]
    ub = xb / np.maximum(nb, 1e-300) * yb[..., None]
    per_user = np.einsum("jpa,jpb->jab", ua, ub)
    per_user = 0.5 * (per_user + per_user.transpose(0, 2, 1))
    c = clip_factors(np.linalg.norm(per_user, axis=(1, 2)), clip_init)
    return np.einsum("j,jab->ab", c, per_user)


def fit_v(x: np.ndarray, y: np.ndarray, embedding: np.ndarray, ridge: float = 1e-9) -> np.ndarray:
    """Per-user least squares ``argmin_v |y_j - x_j U v|^2`` (``(n, k)``), local."""
    feats = np.einsum("jid,dk->jik", x, embedding)
    gram = np.einsum("jik,jil->jkl", feats, feats) + ridge * np.eye(embedding.shape[1])
    rhs = np.einsum("jik,ji->jk", feats, y)
    return np.linalg.solve(gram, rhs[..., None])[..., 0]


@dataclass
class AltMinSums:
    """Sums over users of clipped ``A_j`` (``dk x dk``) and of the second statistic
    (``b_j`` for the statistics step, ``g_j`` for the Newton step; ``dk``)."""

    a: np.ndarray
    b: np.ndarray
    count: int
    clipped: int

    def __add__(self, other: AltMinSums) -> AltMinSums:
        return AltMinSums(self.a + other.a, self.b + other.b, self.count + other.count,
                          self.clipped + other.clipped)


_MOMENTS: list[tuple[np.ndarray, np.ndarray, str, np.ndarray, np.ndarray]] = []


def user_moments(users: Users, split: SampleSplit) -> tuple[np.ndarray, np.ndarray]:
    """``G_j = sum_i x_ij x_ij^T`` and ``h_j = sum_i y_ij x_ij`` on the statistics
    samples; fixed over epochs, so cached per process (a SuperNode computes them
    once). The cache holds the data arrays themselves and matches by identity, so
    a freed array's reused ``id`` can never return another user set's moments."""
    for x_ref, y_ref, name, gram, h in _MOMENTS:
        if x_ref is users.x and y_ref is users.y and name == split.name:
            return gram, h
    m = users.x.shape[1]
    xs, ys = users.x[:, split.stats(m)], users.y[:, split.stats(m)]
    entry = (users.x, users.y, split.name, np.einsum("jia,jib->jab", xs, xs), np.einsum("jia,ji->ja", xs, ys))
    _MOMENTS.insert(0, entry)
    del _MOMENTS[4:]
    return entry[3], entry[4]


def _local_v(users: Users, embedding: np.ndarray, split: SampleSplit) -> np.ndarray:
    m = users.x.shape[1]
    return fit_v(users.x[:, split.fit(m)], users.y[:, split.fit(m)], embedding)


def _sum_a(c: np.ndarray, gram: np.ndarray, v: np.ndarray) -> np.ndarray:
    d, k = gram.shape[1], v.shape[1]
    return np.einsum("j,jab,jc,je->acbe", c, gram, v, v, optimize=True).reshape(d * k, d * k)


def altmin_statistics(
    users: Users, embedding: np.ndarray, clip_a: float, clip_b: float, split: SampleSplit
) -> AltMinSums:
    """Algorithm 2's statistics: fit every user's ``v_j`` locally on ``embedding``
    and sum the jointly clipped ``(A_j, b_j)``. ``clip_a = clip_b = inf``: the
    non-private sums."""
    d, k = embedding.shape
    v = _local_v(users, embedding, split)
    gram, h = user_moments(users, split)
    vnorm2 = np.sum(v * v, axis=1)
    norm_a = np.linalg.norm(gram, axis=(1, 2)) * vnorm2
    norm_b = np.linalg.norm(h, axis=1) * np.sqrt(vnorm2)
    c = np.minimum(clip_factors(norm_a, clip_a), clip_factors(norm_b, clip_b))
    b = np.einsum("j,ja,jc->ac", c, h, v).reshape(d * k)
    return AltMinSums(_sum_a(c, gram, v), b, len(users), int(np.sum(c < 1.0)))


def newton_statistics(
    users: Users, embedding: np.ndarray, clip_a: float, clip_g: float, split: SampleSplit
) -> AltMinSums:
    """The Newton step's statistics: ``A_j`` clipped to ``clip_a`` (as Algorithm 2)
    and the user's gradient of its squared loss in ``U`` at the current ``U``,
    ``g_j = vec((G_j U v_j - h_j) v_j^T) = A_j vec(U) - b_j``, clipped to ``clip_g``
    (each with its own factor: two separate releases). ``g_j`` is a residual, so it
    shrinks as ``U`` converges and a small ``clip_g`` (small noise) suffices late."""
    v = _local_v(users, embedding, split)
    gram, h = user_moments(users, split)
    vnorm2 = np.sum(v * v, axis=1)
    c_a = clip_factors(np.linalg.norm(gram, axis=(1, 2)) * vnorm2, clip_a)
    resid = np.einsum("jab,bk,jk->ja", gram, embedding, v) - h
    norm_g = np.linalg.norm(resid, axis=1) * np.sqrt(vnorm2)
    c_g = clip_factors(norm_g, clip_g)
    g = np.einsum("j,ja,jc->ac", c_g, resid, v).reshape(-1)
    return AltMinSums(_sum_a(c_a, gram, v), g, len(users), int(np.sum(c_g < 1.0)))


def user_statistic_norms(users: Users, embedding: np.ndarray, split: SampleSplit) -> tuple[np.ndarray, np.ndarray]:
    """``(|A_j|_F, |b_j|)`` per user (to choose clipping thresholds on held-out users)."""
    v = _local_v(users, embedding, split)
    gram, h = user_moments(users, split)
    vnorm2 = np.sum(v * v, axis=1)
    return np.linalg.norm(gram, axis=(1, 2)) * vnorm2, np.linalg.norm(h, axis=1) * np.sqrt(vnorm2)
