"""The dry run and its plan: the train function on a few synthetic records shaped as the
owner's (none of the owner's data), which checks every rule of the DP pass (so a refusal
cannot depend on the data) and fixes the loss, the optimizer, the model's modes and
device (:class:`_Plan`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING

import numpy as np
import torch
from flwr.common import log
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from .. import per_sample
from ..dp_sgd import UnitBatch
from ..model_state import ModelState
from .batches import BY_ROWS_HINT, PoissonBatches, PoissonLoader, _not_by_rows, _tensors_of
from .capture import LOSS_FN_HINT, PrivateModule, _discarding_closure, _DPPass
from .capture_types import _LossCall
from .common import UserLoopError, _settings
from .gradients import LossFn


@dataclass(frozen=True)
class Plan:
    """What the DP pass takes from the dry run (the train function on synthetic records):
    the loss (the torch loss call it intercepted, or the user's ``loss_fn``), the
    optimizer, the model's modes and device. Nothing in it depends on the owner's data,
    so neither does anything decided from it."""

    call: _LossCall | None
    optimizer: tuple[type, dict, list[tuple[dict, list[str]]]] | None  # class, defaults, groups
    modes: dict[str, bool]
    device: torch.device
    loss_fn: LossFn | None = None


class _LossFnDry(_DPPass):
    """The dry run of a loop with ``loss_fn``: the train function trains the model itself
    (a copy, its class unchanged); its first optimizer step over the model's trainable
    parameters fixes the optimizer (checked as :meth:`_DPPass._copy` checks it), the modes
    and the device; ``step(closure)`` runs the closure, whose gradients are discarded."""

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
        if self.inside or not self.owns(optimizer):
            return None
        if self.user_optimizer is None:
            self.user_optimizer, self.first_settings = optimizer, _settings(optimizer)
            self._copy(optimizer)
            self.modes = {name: m.training for name, m in self.model.named_modules()}
            self.device = next(iter(self.params)).device
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None
        return _discarding_closure(optimizer, args, kwargs)

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        pass


#: The value of every string of a synthetic record.
PLACEHOLDER = "synthetic"


def _synthetic(item, generator: torch.Generator):  # noqa: ANN001, ANN202
    """``item`` (one record, as the data set gives it) with its values replaced, torch
    tensors and NumPy arrays alike (same shapes and dtypes): floats drawn from U(0, 1),
    integers and booleans zero, values every torch loss accepts as a target (a
    probability for ``BCELoss``, class 0 for ``CrossEntropyLoss`` and ``NLLLoss``) and
    that tell the float tensors apart; strings :data:`PLACEHOLDER`. Only the structure,
    shapes and dtypes of the owner's data are kept: a value of any other type (an image
    object, a custom class) is refused, whatever the data (its type is the data set's
    code), as the dry run cannot replace it and must read none of the owner's data."""
    if isinstance(item, torch.Tensor):
        if item.is_floating_point():
            return torch.rand(item.shape, generator=generator, dtype=item.dtype)
        return torch.zeros_like(item)
    if isinstance(item, np.ndarray | np.generic) and item.dtype.kind in "fiubc":
        if item.dtype.kind == "f":
            values = torch.rand(item.shape, generator=generator, dtype=torch.float64).numpy().astype(item.dtype)
        else:
            values = np.zeros(item.shape, dtype=item.dtype)
        return values if isinstance(item, np.ndarray) else values[()]
    if isinstance(item, np.ndarray) and item.dtype.kind == "U":
        return np.full(item.shape, PLACEHOLDER, dtype=item.dtype)
    if isinstance(item, dict):
        return type(item)({k: _synthetic(v, generator) for k, v in item.items()})
    if isinstance(item, list | tuple):
        values = [_synthetic(v, generator) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
    if isinstance(item, bool | int):
        return type(item)(0)
    if isinstance(item, float):
        return 0.0
    if isinstance(item, str):
        return PLACEHOLDER
    if item is None:
        return None
    dtype = f" of dtype {item.dtype}" if hasattr(item, "dtype") else ""
    raise UserLoopError(f"a record of the data set holds a value of type {type(item).__qualname__}{dtype}, which the "
                        "DP pass cannot replace by a synthetic value for its dry run (the dry run reads none of "
                        "your data): return torch tensors or NumPy arrays of numbers from the Dataset's "
                        "__getitem__ (convert images and other objects in its transform, e.g. "
                        "torchvision.transforms.ToTensor())", structural=True)


def _counts(item) -> tuple[int, int]:  # noqa: ANN001
    """The dry run's two batch sizes: the two smallest integers from 2 on that are no
    dimension of a tensor of ``item`` (one record), so that a collated tensor whose dim 0
    is not the records (time first, a padded length, a constant) has a dim 0 other than
    the batch size at one of them at least, whatever the data."""
    dims = set()

    def visit(x) -> None:  # noqa: ANN001
        if isinstance(x, torch.Tensor) or hasattr(x, "shape") and hasattr(x, "dtype"):  # NumPy arrays too
            dims.update(int(d) for d in x.shape)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)

    visit(item)
    free = (k for k in range(2, 2 + len(dims) + 2) if k not in dims)
    return next(free), next(free)


class _AllRecords(PoissonBatches):
    """The dry run's batches: every synthetic record, every time (no sampling)."""

    def draw(self) -> list[int]:
        if self.drawn >= self.steps:
            raise UserLoopError("the private loader has yielded every batch of this round")
        self.current = UnitBatch(torch.arange(self.num_units), torch.arange(self.num_units), self.num_units)
        self.drawn += 1
        return list(range(self.num_units))


def _all_records(count: int) -> _AllRecords:
    return _AllRecords(torch.arange(count), count, 1.0, 1, torch.Generator().manual_seed(0), False, 1)


class _SyntheticSet(torch.utils.data.Dataset):
    """Synthetic records shaped as the owner's (the dry run's data): ``count`` of them
    (:func:`_counts`, the larger one), the dry run's batches the first ``self.count``; its
    length is the owner's (public) data size, as a train function may read it."""

    def __init__(self, dataset, size: int) -> None:  # noqa: ANN001
        g = torch.Generator().manual_seed(0)
        first = dataset[0]
        self.count, self.other = _counts(first)
        self.items = [_synthetic(first, g) for _ in range(self.other)]
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):  # noqa: ANN204
        return self.items[i % len(self.items)]

    def batch(self, collate, count: int | None = None):  # noqa: ANN001, ANN201
        """The first ``count`` records (default: the dry run's batch size) collated."""
        from torch.utils.data import default_collate

        return (collate or default_collate)(self.items[:count or self.count])


def _check_by_rows(dataset: _SyntheticSet, loader: DataLoader, call: _LossCall | None) -> None:
    """The collated synthetic records at both batch sizes of :func:`_counts`: with
    ``loss_fn`` (``call`` None) every leaf of the batch, else the model's input and the
    loss's target, must be a tensor with the records along dim 0, so that the release pass
    splits each batch by record (refused otherwise, whatever the data)."""
    for count in (dataset.count, dataset.other):
        batch = dataset.batch(loader.collate_fn, count)
        if call is None:
            bad = _not_by_rows(batch, count)
        else:
            tensors = _tensors_of(batch)
            bad = [f"a tensor of shape {tuple(tensors[s.index].shape) if s.index < len(tensors) else '?'}"
                   for s in (*call.inputs, call.target) if not s.fits(tensors, count)]
        if bad:
            what = "the batch" if call is None else "the model's input or the loss's target"
            raise UserLoopError(f"{what} holds {bad[0]} for a batch of {count} records, so the DP pass cannot "
                                f"give each record's loss that record alone: {BY_ROWS_HINT}", structural=True)


def dry_run(model: nn.Module, loader: DataLoader, train_fn: Callable, *, capture: bool,
            loss_fn: LossFn | None = None) -> Plan:
    """The train function on a copy of the model and a few synthetic records: every rule of
    the DP pass is checked here (a refusal is structural: it cannot depend on the owner's
    data), and the loss, optimizer, modes and device it used become the plan. The
    parameters with ``requires_grad`` are the ones made private. With ``loss_fn`` the
    train function gets the model itself, and ``loss_fn`` must give each synthetic
    record's gradient on that record alone."""
    import copy

    if not any(p.requires_grad for p in model.parameters()):
        raise UserLoopError("no trainable parameter to train privately")
    dry_model = copy.deepcopy(model)
    dataset = _SyntheticSet(loader.dataset, len(loader.dataset))  # type: ignore[arg-type]
    if loss_fn is not None:
        _check_by_rows(dataset, loader, None)
    dry_loader = PoissonLoader(dataset, _all_records(dataset.count), loader.collate_fn)
    dry = (_LossFnDry if loss_fn is not None else _DPPass)(dry_model, dry_loader, 1.0, None,
                                                            torch.Generator().manual_seed(0), capture=True)
    dry.dry = True
    handles = [register_optimizer_step_pre_hook(dry.before_step), register_optimizer_step_post_hook(dry.after_step)]
    try:
        try:
            train_fn(dry_model if loss_fn is not None else PrivateModule(dry_model, dry), dry_loader)
        except UserLoopError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's code
            log(WARNING, "The train function raised on synthetic records: %s: %s", type(err).__name__, err)
            dry.refuse(f"the train function raised {type(err).__name__} on synthetic records shaped as yours "
                       "(its message is in the node's log)")
        if dry.refusal is not None:
            raise UserLoopError(dry.refusal, structural=True)
        if loss_fn is None and (dry.last_loss is None or dry.modes is None):
            dry.refuse("the train function computed no torch loss on the model's output" + LOSS_FN_HINT)
        if dry.user_optimizer is None and not capture:
            dry.refuse("the train function took no optimizer.step(): take one step per batch of the loader")
        if dry.modes is None:  # loss_fn without a step (central noise): the model as it came
            dry.modes = {name: m.training for name, m in model.named_modules()}
            dry.device = next(iter(dry.params)).device
        if loss_fn is None:
            _check_by_rows(dataset, loader, dry.last_loss)
        _check_gradients(model, dataset, loader, loss_fn, dry.last_loss, dry.modes)
        _check_state_constant(model, dataset, loader, dry.last_loss, loss_fn, dry.modes)
    finally:
        for h in handles:
            h.remove()
        dry.close()
    optimizer = None
    if dry.user_optimizer is not None:
        names = {id(p): n for n, p in dry_model.named_parameters()}
        groups = []
        for g, settings in zip(dry.user_optimizer.param_groups, dry.first_settings, strict=True):
            ps = [names[id(p)] for p in g["params"] if names.get(id(p)) in dry.trainable]
            if ps:
                groups.append((settings, ps))
        optimizer = (type(dry.user_optimizer), dict(dry.user_optimizer.defaults), groups)
    return Plan(dry.last_loss, optimizer, dict(dry.modes), dry.device, loss_fn)


def _check_gradients(model: nn.Module, dataset: _SyntheticSet, loader: DataLoader, loss_fn: LossFn | None,
                     call: _LossCall | None, modes: dict[str, bool]) -> None:
    """Each synthetic record's gradient of the planned loss (``loss_fn``, else the torch
    loss call) on that record alone, on a fresh copy of the model in the plan's modes, as
    the release pass computes it (``vmap`` or micro-batches): a model or ``loss_fn`` that
    cannot compute a record's gradient on a batch of one, or a ``loss_fn`` that returns no
    scalar, is refused here, whatever the data (on the owner's data such a record's
    gradient would be zero)."""
    import copy

    if call is None and loss_fn is None:
        return
    batch, n = dataset.batch(loader.collate_fn), dataset.count
    key = _gradient_check_key(model, batch, call, modes) if loss_fn is None else None
    if key is not None and key in _GRADIENTS_CHECKED:
        return
    check = copy.deepcopy(model)
    for name, m in check.named_modules():
        m.training = modes.get(name, m.training)
    probe = _DPPass(check, PoissonLoader(dataset, _all_records(n), loader.collate_fn), 1.0, None,
                    torch.Generator().manual_seed(0), capture=True)
    try:
        if loss_fn is not None:
            probe._loss_fn_gradients(batch, n, loss_fn)  # noqa: SLF001
        else:
            tensors = _tensors_of(batch)
            with torch.no_grad():
                fwd = probe._pending(check, tuple(s.of(tensors, n) for s in call.inputs), call.inputs, n, 0)._fwd  # noqa: SLF001
            probe._gradients(fwd, call.target.of(tensors, n), call)  # noqa: SLF001
    finally:
        probe.close()
    if key is not None:
        if len(_GRADIENTS_CHECKED) >= 256:
            _GRADIENTS_CHECKED.clear()
        _GRADIENTS_CHECKED.add(key)


#: The keys (:func:`_gradient_check_key`) of the gradient checks passed in this process.
_GRADIENTS_CHECKED: set[tuple] = set()


def _gradient_check_key(model: nn.Module, batch: object, call: _LossCall,
                        modes: dict[str, bool]) -> tuple | None:
    """Everything :func:`_check_gradients` depends on without ``loss_fn`` (None where a part
    cannot be keyed): the per-record path in force, the model's code (its modules' classes,
    ``forward`` functions and hooks' code), the parameters' names, shapes, dtypes and which
    are trainable, the modes, the synthetic batch's tensors (their values: a fixed seed and
    the owner's record layout, never its data) and the loss call (function, arguments,
    where its input and target come from). The check computes a record's gradient on
    synthetic records: with the same key it has the same outcome, so a passed check is
    not run again in a later round (the dry run itself still runs the train function and
    fixes the loss and optimizer every round)."""
    def hooks(m: nn.Module) -> tuple:
        return tuple(getattr(h, "__code__", type(h)) for d in (m._forward_pre_hooks, m._forward_hooks,  # noqa: SLF001
                                                                   m._backward_hooks, m._backward_pre_hooks)  # noqa: SLF001
                     for h in d.values())

    def tensor(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.dtype, t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()

    try:
        key = (
            per_sample.BACKEND, per_sample.model_kind(model) in per_sample.FUNC_FAILED,
            tuple((type(m), getattr(m.forward, "__func__", m.forward), hooks(m)) for m in model.modules()),
            tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in model.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()),
            tuple(sorted(modes.items())),
            tuple(tensor(t) for t in _tensors_of(batch)),
            call.func, call.reduction, call.inputs, call.target, call.rest, call.k,
            tuple((k, tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in sorted(call.params.items())),
        )
        hash(key)
    except TypeError:  # an argument that cannot be a key: checked every round
        return None
    return key



def _check_state_constant(model: nn.Module, dataset: _SyntheticSet, loader: DataLoader, call: _LossCall | None,
                          loss_fn: LossFn | None, modes: dict[str, bool]) -> None:
    """One forward pass on the synthetic records, in the plan's modes, on a fresh copy of
    the model: a buffer it changes (running statistics), or an attribute of a module that
    holds state (:class:`~flwr_jdp.training.model_state.ModelState`: a tensor, a NumPy
    array, a number, or a list, tuple or dict of them, such as a running sum of the
    inputs), would carry one record into the others' gradients and the release without
    noise, and is refused; constant buffers and attributes (position ids, sizes) are fine.
    (The release pass also puts them back after each record's or batch's computation.)"""
    import copy

    check = copy.deepcopy(model)
    for name, m in check.named_modules():
        m.training = modes.get(name, m.training)
    state = ModelState(check)
    batch = dataset.batch(loader.collate_fn)
    try:
        with torch.enable_grad():
            if loss_fn is not None:
                loss_fn(check, batch)
            elif call is not None:
                tensors = _tensors_of(batch)
                check(*(s.of(tensors, dataset.count) for s in call.inputs))
    except Exception as err:  # noqa: BLE001 - the user's model; its message stays in the node's log
        log(WARNING, "The model raised on synthetic records: %s: %s", type(err).__name__, err)
        raise UserLoopError(f"the model raised {type(err).__name__} on synthetic records shaped as yours (its "
                            "message is in the node's log)", structural=True) from None
    buffers, attributes = state.changed()
    if buffers:
        raise UserLoopError(f"the model's forward pass changes its buffers {buffers[:3]} (running statistics?), "
                            "which would carry the data into the release without noise: keep buffers constant "
                            "(statistics per record, e.g. GroupNorm or LayerNorm)", structural=True)
    if attributes:
        raise UserLoopError(f"the model's forward pass changes its attribute(s) {attributes[:3]} (state kept on the "
                            "model from one forward pass to the next, e.g. a running sum or count of the inputs), "
                            "which would carry one record into the others' gradients without noise: keep the "
                            "forward pass free of state (set such values before training, from public values, "
                            "and do not assign them in forward)", structural=True)
