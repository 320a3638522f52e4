"""What every part of the DP pass shares: its error, and comparisons of tensors and
optimizer settings."""

from __future__ import annotations

import inspect

import torch

from ..model_state import equal_tensors


class UserLoopError(RuntimeError):
    """The user's training loop does something DP-SGD cannot account for.
    ``structural``: a rule of the DP pass the train function's code breaks (it will
    break it again next round)."""

    def __init__(self, message: str, *, structural: bool = False) -> None:
        super().__init__(message)
        self.structural = structural


_equal = equal_tensors


def _settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _same_setting(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b, strict=True))
    return a == b


#: Warnings given once per process.
_WARNED = {"epochs": False}


def new_optimizer(cls: type[torch.optim.Optimizer], groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over ``groups`` (each with its settings), passing the
    constructor only the defaults it takes (AdamW's hold one its constructor does not)."""
    accepted = inspect.signature(cls.__init__).parameters
    return cls(groups, **{k: v for k, v in defaults.items() if k in accepted})
