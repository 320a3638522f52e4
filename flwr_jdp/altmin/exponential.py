"""Algorithm 4: the exponential mechanism over a net of embeddings (reference).

For small problems (``k = 1``, ``d <= 5``) this samples ``U`` (a unit vector, up
to sign) from a net of the sphere with ``Pr[U] ~ exp(-eps * score(U) / (2 Delta))``:

- ``score(U) = sum_j min_{|v| <= C} (2/m) sum_{i <= m/2} (clip(y_ij, zeta) - v clip(U^T x_ij, L_f))^2``;
- each user's term lies in ``[0, zeta^2]`` (``v = 0`` is feasible), so adding,
  removing or replacing one user changes the score by at most ``Delta = zeta^2``;
- hence the release is **pure eps-DP at user level** (McSherry-Talwar). The
  paper's form ``exp(-eps n score_avg / (8 L_f C xi))`` bounds the same
  sensitivity through Lipschitzness; the bounded-range bound is tighter here.

Users then fit ``v_j`` on their second half with the released ``U`` (Theorem 5.1:
billboard model). The release is one pure eps-DP event; dp-accounting's PLD
has no exact event for a generic pure-DP mechanism under add/remove, so it is
reported on its own (eps, 0) and not composed in a ledger.

Net: grid points of spacing ``h`` on the faces ``{w : w_i = 1, |w|_inf <= 1}``
of the cube, normalised (one face per axis: ``U`` and ``-U`` are the same
subspace). Any unit ``u`` is within ``h sqrt(d - 1)`` of a net point, so
``h = phi / sqrt(d - 1)`` gives a ``phi``-net of ``d (2/h + 1)^(d-1)`` points.
That count is what stops it: ``d = 3, phi = 0.05``: ~10^4 points; ``d = 4,
phi = 0.1``: ~2 x 10^5; ``d = 6, phi = 0.2``: ~4 x 10^7 (each point costs a pass
over all ``n m / 2`` samples), and for ``k >= 2`` the exponent becomes
``dk - k(k+1)/2``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .problem import Users


def net_size(dim: int, phi: float) -> int:
    h = phi / math.sqrt(max(1, dim - 1))
    per_axis = int(math.floor(2.0 / h)) + 1
    return dim * per_axis ** (dim - 1)


def sphere_net(dim: int, phi: float, max_points: int = 2_000_000) -> np.ndarray:
    """Unit vectors forming a ``phi``-net of the sphere up to sign (rows)."""
    size = net_size(dim, phi)
    if size > max_points:
        raise ValueError(f"a {phi}-net in d={dim} has {size} points > max_points={max_points}")
    h = phi / math.sqrt(max(1, dim - 1))
    grid = np.linspace(-1.0, 1.0, int(math.floor(2.0 / h)) + 1)
    faces = []
    for axis in range(dim):
        pts = np.array(list(itertools.product(grid, repeat=dim - 1))) if dim > 1 else np.zeros((1, 0))
        face = np.insert(pts, axis, 1.0, axis=1)
        faces.append(face)
    net = np.concatenate(faces)
    return net / np.linalg.norm(net, axis=1, keepdims=True)


def scores(users: Users, net: np.ndarray, zeta: float, clip_feature: float, bound_v: float,
           chunk: int = 1024) -> np.ndarray:
    """``score(U)`` for every net point (rows of ``net``), ``k = 1``."""
    m = users.x.shape[1]
    half = m // 2
    x = users.x[:, :half]                       # (n, h, d)
    y = np.clip(users.y[:, :half], -zeta, zeta)  # (n, h)
    out = np.empty(net.shape[0])
    for start in range(0, net.shape[0], chunk):
        u = net[start:start + chunk]             # (p, d)
        s = np.clip(np.einsum("nhd,pd->pnh", x, u), -clip_feature, clip_feature)
        ss = np.sum(s * s, axis=2)
        sy = np.einsum("pnh,nh->pn", s, y)
        v = np.clip(np.where(ss > 0, sy / np.maximum(ss, 1e-300), 0.0), -bound_v, bound_v)
        loss = np.mean((y[None] - v[..., None] * s) ** 2, axis=2)  # (p, n)
        out[start:start + chunk] = np.sum(loss, axis=1)
    return out


def exponential_mechanism(score: np.ndarray, epsilon: float, sensitivity: float,
                          rng: np.random.Generator) -> int:
    """Index sampled with probability ``~ exp(-epsilon * score / (2 sensitivity))``."""
    logits = -epsilon * (score - score.min()) / (2.0 * sensitivity)
    p = np.exp(logits)
    return int(rng.choice(len(score), p=p / p.sum()))


def private_embedding(users: Users, epsilon: float, phi: float, zeta: float, clip_feature: float,
                      bound_v: float, rng: np.random.Generator) -> np.ndarray:
    """Algorithm 4's released ``U`` (``d x 1``); pure ``epsilon``-DP at user level."""
    net = sphere_net(users.x.shape[2], phi)
    idx = exponential_mechanism(scores(users, net, zeta, clip_feature, bound_v), epsilon, zeta ** 2, rng)
    return net[idx][:, None]
