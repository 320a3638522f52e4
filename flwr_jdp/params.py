"""Split a model's parameters into shared and personal by a name rule.

The rule is a regular expression matched (``re.search``) against parameter names
from ``model.named_parameters()``; matching parameters are *personal*: they are
trained by their owner on its own data, stay in the owner's ``context.state`` and
never appear in any outgoing message. All other parameters are *shared*.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ParamSplit:
    """Names of the shared and personal parameters, in model order."""

    shared: tuple[str, ...]
    personal: tuple[str, ...]

    def is_personal(self, name: str) -> bool:
        return name in self.personal


def split_parameters(model: nn.Module, rule: str, *, allow_empty: bool = False) -> ParamSplit:
    """Split ``model``'s parameters by the regular expression ``rule``.

    Raises ``ValueError`` if the rule matches no parameter or every parameter
    (unless ``allow_empty``, used by the full-DP, FedAvg and per-silo baselines).
    """
    return split_names([n for n, _ in model.named_parameters()], rule, allow_empty=allow_empty)


def split_names(names: list[str], rule: str, *, allow_empty: bool = False,
                what: str = "the model") -> ParamSplit:
    """:func:`split_parameters` on parameter names (the server's view of a model:
    the names of the user's ``initial_arrays``)."""
    try:
        pattern = re.compile(rule) if rule else None
    except re.error as err:
        raise ValueError(f"personal-layers rule {rule!r} is not a regular expression: {err}") from err
    personal = tuple(n for n in names if pattern is not None and pattern.search(n))
    shared = tuple(n for n in names if n not in personal)
    if not allow_empty and not personal:
        raise ValueError(
            f"personal-layers rule {rule!r} matches no parameter of {what}; its parameters are {names}"
        )
    if not allow_empty and not shared:
        raise ValueError(
            f"personal-layers rule {rule!r} matches every parameter of {what}; at least one must be shared"
        )
    return ParamSplit(shared, personal)


def get_arrays(model: nn.Module, names: tuple[str, ...]) -> OrderedDict[str, np.ndarray]:
    """Copy the named parameters out of ``model`` as numpy arrays."""
    params = dict(model.named_parameters())
    return OrderedDict((n, params[n].detach().cpu().numpy().copy()) for n in names)


def set_arrays(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load named numpy arrays into ``model``'s parameters."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in arrays.items():
            params[name].copy_(torch.as_tensor(np.asarray(value), dtype=params[name].dtype))
