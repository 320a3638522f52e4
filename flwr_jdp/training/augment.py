"""Random translation of image records, for the owners' non-private training.

Run-config ``augment-shift = k`` (pixels, 0 = off): every batch of plain SGD an
owner runs on its own records (its personal parameters under joint DP, per-silo
training, FedAvg, the adaptation after the last round) sees each image moved by an
independent, uniformly drawn offset in ``[-k, k]`` along each axis, the border
repeated into the uncovered strip (``replicate`` padding: the background of
Fashion-MNIST and MNIST).

Privacy: at the record and user units nothing augmented is released. Personal
parameters, the per-silo model and the adapted copy are the owner's own model, which
joint DP lets use its data freely; DP-SGD steps on shared parameters and central
clipped sums are computed on the unaugmented records, so each release, its
sensitivity (``C`` per unit) and its ledger event are those of a run without the key.
At the owner unit the release is the owner's whole local update, clipped to ``C``
before the noise: augmenting the training that produced it leaves that sensitivity,
and so the event, unchanged. FedAvg has no privacy guarantee either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_shift(x: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """``x`` (N, C, H, W) with every image translated by its own random offset in
    ``[-shift, shift]`` pixels per axis (``replicate`` border); ``shift = 0``
    returns ``x`` itself."""
    if shift <= 0 or len(x) == 0:
        return x
    if x.dim() != 4:
        raise ValueError(f"augment-shift needs image records (N, C, H, W), got shape {tuple(x.shape)}")
    n, _, h, w = x.shape
    padded = F.pad(x, (shift, shift, shift, shift), mode="replicate").permute(0, 2, 3, 1)
    dy = torch.randint(0, 2 * shift + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * shift + 1, (n,), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]  # (N, H, 1)
    cols = (dx[:, None] + torch.arange(w))[:, None, :]  # (N, 1, W)
    out = padded[torch.arange(n)[:, None, None], rows, cols]  # (N, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()
