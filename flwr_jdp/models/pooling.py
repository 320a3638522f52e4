"""2x2 max pooling with a fast inference path (CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MaxPool2x2(nn.Module):
    """``nn.MaxPool2d(2)``, with a faster path where no gradient is taken.

    On CPU, the element-wise maximum of the four strided 2x2 sub-grids is several
    times faster than ``max_pool2d``'s kernel and gives the same values (a maximum
    is exact). With a gradient to take (training), ``max_pool2d`` is used: its
    backward is the faster one. No parameters, so state dicts are unchanged.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.max_pool2d(x, 2)
        h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
        x = x[..., :h, :w]
        return torch.maximum(torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2]),
                             torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2]))
