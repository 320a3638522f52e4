"""State a model keeps from one forward pass to the next: its buffers, and its modules'
attributes that can hold values computed from data (tensors other than parameters,
NumPy arrays and scalars, numbers, and lists, tuples and dicts holding one). A forward
pass that changes them carries one record into the next record's gradient, or into a
later step, without noise: the drop-in DP pass's dry run refuses a model whose forward
pass changes them (:func:`~flwr_jdp.training.dp_pass.plan.dry_run`), and the release
pass puts them back after each record's (micro-batches) or each batch's (``vmap``)
computation (:class:`ModelState`), so that no record's state reaches another's gradient
even where the owner's data triggers a change the synthetic records did not.

Not state: parameters, submodules, the module's hook dicts and ``training`` flag (what
every ``nn.Module`` has), and any other object (a config, a function, a string)."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

#: What every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, submodules,
#: hook dicts, the ``training`` flag): never state.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_MISSING = object()
#: How deep in lists, tuples and dicts a value is looked for.
_DEPTH = 8


def is_state(value: object, depth: int = 0) -> bool:
    """Whether ``value`` can carry data from one forward pass to the next: a tensor that is
    not a parameter, a NumPy array or scalar, a number, or a list, tuple or dict holding one."""
    if isinstance(value, nn.Parameter):
        return False
    if isinstance(value, torch.Tensor | np.ndarray | np.generic | numbers.Number):
        return True
    if depth >= _DEPTH:
        return False
    if isinstance(value, list | tuple):
        return any(is_state(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(is_state(v, depth + 1) for v in value.values())
    return False


def _copy(value):  # noqa: ANN001, ANN202 - a value of any of is_state's kinds
    """A copy of ``value`` that later changes of it (in place included) do not reach."""
    if isinstance(value, nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple):
        items = [_copy(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list | dict):
        out = copy.copy(value)
        for k in range(len(value)) if isinstance(value, list) else list(value):
            out[k] = _copy(value[k])
        return out
    return value


def equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values (NaN equals NaN), on ``a``'s device."""
    if b.device != a.device:
        b = b.to(a.device)
    if torch.equal(a, b):
        return True
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _same(now: object, saved: object) -> bool:
    """Whether ``now`` holds what ``saved`` (a :func:`_copy`) holds (NaN equals NaN)."""
    if now is saved:
        return True
    if isinstance(saved, torch.Tensor):
        return isinstance(now, torch.Tensor) and now.dtype == saved.dtype and equal_tensors(now.detach(), saved)
    if isinstance(saved, np.ndarray):
        return isinstance(now, np.ndarray) and now.shape == saved.shape and now.dtype == saved.dtype and \
            bool(np.array_equal(now, saved, equal_nan=saved.dtype.kind in "fc"))
    if isinstance(saved, list | tuple):
        return type(now) is type(saved) and len(now) == len(saved) and \
            all(_same(a, b) for a, b in zip(now, saved, strict=True))
    if isinstance(saved, dict):
        return type(now) is type(saved) and now.keys() == saved.keys() and all(_same(now[k], saved[k]) for k in saved)
    if type(now) is not type(saved):
        return False
    return bool(now == saved) or (now != now and saved != saved)  # noqa: PLR0124 - NaN


def _same_or_raises(now: object, saved: object) -> bool:
    """:func:`_same`; False where the comparison raises (a tensor escaped from a ``vmap``)."""
    try:
        return _same(now, saved)
    except RuntimeError:
        return False


class ModelState:
    """The state of ``model`` (every module's buffers and state attributes, :func:`is_state`;
    lists, tuples and dicts too, which may come to hold state) when it was made;
    :meth:`restore` puts it back, :meth:`changed` names the buffers and the state
    attributes that differ."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = [(name, b, b.detach().clone()) for name, b in model.named_buffers()]
        self.attributes = []  # (qualified name, module, {attribute: (object, copy or _MISSING)})
        for prefix, module in model.named_modules():
            saved = {k: (v, _copy(v) if is_state(v) or isinstance(v, list | tuple | dict) else _MISSING)
                     for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
            self.attributes.append((prefix, module, saved))

    def changed(self) -> tuple[list[str], list[str]]:
        """The buffers and the state attributes that differ from when this was made."""
        buffers = [name for name, b, value in self.buffers if not _same(b, value)]
        return buffers, [name for name, module, key, _, saved in self._attributes(compare=True)
                         if is_state(vars(module).get(key)) or is_state(saved)]

    def restore(self, *, compare: bool = True) -> None:
        """Every buffer and state attribute as it was. ``compare=False`` (inside a
        ``vmap`` transform, where values can neither be compared nor written in place):
        every attribute replaced or deleted, and every list, tuple, dict and number, is
        put back; buffers and tensors changed in place are put back by the next restore
        outside the transform."""
        with torch.no_grad():
            for _, b, value in self.buffers if compare else ():
                b.copy_(value)
            for _, module, key, obj, saved in self._attributes(compare=compare):
                now = vars(module).get(key, _MISSING)
                if saved is _MISSING:  # a new state attribute, or an object replaced by state
                    if obj is _MISSING:
                        del vars(module)[key]
                    else:
                        vars(module)[key] = obj
                elif now is obj and isinstance(obj, torch.Tensor) and obj.shape == saved.shape \
                        and obj.dtype == saved.dtype:
                    obj.copy_(saved)  # in place: whatever else holds this tensor sees it put back too
                elif now is obj and isinstance(obj, np.ndarray) and obj.shape == saved.shape \
                        and obj.dtype == saved.dtype:
                    np.copyto(obj, saved)
                else:
                    vars(module)[key] = _copy(saved)

    def _attributes(self, *, compare: bool):  # noqa: ANN202 - (qualified name, module, key, object, copy)
        """The attributes not as they were: a state value, a list, tuple or dict (compared by
        value; ``compare=False``: all of them), or any other object replaced by a state value
        or deleted; a new attribute holding state."""
        out = []
        for prefix, module, saved in self.attributes:
            attrs = vars(module)
            for key in [k for k in attrs if k not in _MODULE_INTERNALS and k not in saved]:
                if is_state(attrs[key]):
                    out.append((f"{prefix}.{key}" if prefix else key, module, key, _MISSING, _MISSING))
            for key, (obj, value) in saved.items():
                now = attrs.get(key, _MISSING)
                if value is _MISSING:
                    differs = now is not obj and (now is _MISSING or is_state(now))
                else:
                    differs = not _same_or_raises(now, value) if compare else \
                        now is not obj or not isinstance(obj, torch.Tensor | np.ndarray)
                if differs:
                    out.append((f"{prefix}.{key}" if prefix else key, module, key, obj, value))
        return out


@contextmanager
def state_kept(model: nn.Module) -> Iterator[ModelState]:
    """``model``'s buffers and state attributes put back as they were when the block ends."""
    state = ModelState(model)
    try:
        yield state
    finally:
        state.restore()
