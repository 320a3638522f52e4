"""What an owner's release is, and the model it is computed on.

A train reply's arrays (``release_kind``): the shared parameters after DP-SGD
(record/user unit, local noise; or no DP), the sum of clipped per-unit gradients of
one Poisson sample (record/user unit, central noise: the server adds the noise), or
the owner's clipped update (owner unit; noised by the owner under local noise).

Personal coupling: a release is computed with the owner's personal parameters at
their *public* initial values and frozen (:func:`public_personal_swapped`), so the
shared release is plain DP-SGD or a plain clipped sum and the ledger's event is
exact; the owner fits its own personal parameters separately on the broadcast
shared parameters (public DP output and its own data: the billboard model). The
joint-DP paper's Algorithm 1 (personal parameters trained on the same batches, the
shared gradients taken through them) is refused: removing one record would change
the personal parameters and through them every other record's shared gradient, so
one step's sensitivity would no longer be bounded by the clipping norm.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.params import ParamSplit, set_arrays
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit


def release_kind(cfg: JobConfig) -> str:
    """What the arrays of a train reply mean under ``cfg``."""
    if not cfg.dp:
        return protocol.KIND_PARAMS
    if cfg.unit is PrivacyUnit.OWNER:
        return protocol.KIND_DELTA
    if cfg.placement is NoisePlacement.CENTRAL:
        return protocol.KIND_GRAD_SUM
    if cfg.placement is NoisePlacement.DISTRIBUTED:
        return protocol.KIND_SECURE_SUM
    return protocol.KIND_PARAMS



def _set_public_frozen(model: nn.Module, split: ParamSplit,
                       public_personal: dict[str, np.ndarray]) -> None:
    """Set ``model``'s personal parameters to ``public_personal`` and freeze them."""
    missing = set(split.personal) - set(public_personal)
    if missing:
        raise ValueError(f"public values missing for personal parameters {sorted(missing)}")
    set_arrays(model, {n: public_personal[n] for n in split.personal})
    params = dict(model.named_parameters())
    for n in split.personal:
        params[n].requires_grad_(False)



@contextmanager
def public_personal_swapped(model: nn.Module, split: ParamSplit,
                            public_personal: dict[str, np.ndarray]) -> Iterator[nn.Module]:
    """``model`` itself with its personal parameters replaced, for the block: its
    personal parameters hold the public values ``public_personal`` and are frozen.

    On exit every parameter and buffer of ``model`` holds its value from before
    the block again, with its ``requires_grad`` flag and each submodule's training
    mode, so the owner's model is left as it came (its gradients are cleared).
    Same release as on the copy (tests/test_fast_paths.py checks it bit for bit),
    without copying the model for every owner and round."""
    params = dict(model.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    flags = {n: p.requires_grad for n, p in params.items()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    modes = [(m, m.training) for m in model.modules()]
    try:
        _set_public_frozen(model, split, public_personal)
        yield model
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
                p.requires_grad_(flags[n])
                p.grad = None
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for m, mode in modes:
            m.training = mode


__all__ = ["public_personal_swapped", "release_kind"]
