"""The dry run and its plan: the train function on two synthetic records shaped as the
owner's (none of the owner's data), which checks every rule of the DP pass (so a refusal
cannot depend on the data) and fixes the loss, the optimizer, the model's modes and
device (:class:`_Plan`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING

import torch
from flwr.common import log
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from ..dp_sgd import UnitBatch
from .batches import PoissonBatches, PoissonLoader
from .capture import LOSS_FN_HINT, PrivateModule, _discarding_closure, _DPPass
from .capture_types import _LossCall
from .common import UserLoopError, _equal, _settings
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


def _synthetic(item, generator: torch.Generator):  # noqa: ANN001, ANN202
    """``item`` (one record, as the data set gives it) with its values replaced: floats
    drawn from U(0, 1), integers and booleans zero, values every torch loss accepts as a
    target (a probability for ``BCELoss``, class 0 for ``CrossEntropyLoss`` and
    ``NLLLoss``) and that tell the float tensors apart. Only the structure, shapes and
    dtypes of the owner's data are kept."""
    if isinstance(item, torch.Tensor):
        if item.is_floating_point():
            return torch.rand(item.shape, generator=generator, dtype=item.dtype)
        return torch.zeros_like(item)
    if isinstance(item, dict):
        return type(item)({k: _synthetic(v, generator) for k, v in item.items()})
    if isinstance(item, list | tuple):
        return type(item)(_synthetic(v, generator) for v in item)
    if isinstance(item, bool | int):
        return type(item)(0)
    if isinstance(item, float):
        return 0.0
    return item


class _BothRecords(PoissonBatches):
    """The dry run's batches: both synthetic records, every time (no sampling)."""

    def draw(self) -> list[int]:
        if self.drawn >= self.steps:
            raise UserLoopError("the private loader has yielded every batch of this round")
        self.current = UnitBatch(torch.tensor([0, 1]), torch.tensor([0, 1]), 2)
        self.drawn += 1
        return [0, 1]


class _SyntheticSet(torch.utils.data.Dataset):
    """Two synthetic records shaped as the owner's (the dry run's data); its length is the
    owner's (public) data size, as a train function may read it."""

    def __init__(self, dataset, size: int) -> None:  # noqa: ANN001
        g = torch.Generator().manual_seed(0)
        self.items = [_synthetic(dataset[0], g) for _ in range(2)]
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):  # noqa: ANN204
        return self.items[i % 2]


def dry_run(model: nn.Module, loader: DataLoader, train_fn: Callable, *, capture: bool,
            loss_fn: LossFn | None = None) -> Plan:
    """The train function on a copy of the model and two synthetic records: every rule of
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
    sampler = _BothRecords(torch.tensor([0, 1]), 2, 1.0, 1, torch.Generator().manual_seed(0), False, 1)
    dry_loader = PoissonLoader(dataset, sampler, loader.collate_fn)
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
        if loss_fn is not None:
            _check_loss_fn(model, dataset, loader, loss_fn, dry.modes)
        _check_buffers_constant(model, dataset, loader, dry.last_loss, loss_fn, dry.modes)
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


def _check_loss_fn(model: nn.Module, dataset: _SyntheticSet, loader: DataLoader, loss_fn: LossFn,
                   modes: dict[str, bool]) -> None:
    """Each synthetic record's gradient of ``loss_fn`` on that record alone, on a fresh copy
    of the model in the plan's modes, as the release pass computes it (``vmap`` or
    micro-batches): a ``loss_fn`` that fails, or returns no scalar, is refused here."""
    import copy

    from torch.utils.data import default_collate

    check = copy.deepcopy(model)
    for name, m in check.named_modules():
        m.training = modes.get(name, m.training)
    batch = (loader.collate_fn or default_collate)([dataset[0], dataset[1]])
    sampler = _BothRecords(torch.tensor([0, 1]), 2, 1.0, 1, torch.Generator().manual_seed(0), False, 1)
    probe = _DPPass(check, PoissonLoader(dataset, sampler, loader.collate_fn), 1.0, None,
                    torch.Generator().manual_seed(0), capture=True)
    try:
        probe._loss_fn_gradients(batch, 2, loss_fn)  # noqa: SLF001
    finally:
        probe.close()


def _check_buffers_constant(model: nn.Module, dataset: _SyntheticSet, loader: DataLoader, call: _LossCall | None,
                            loss_fn: LossFn | None, modes: dict[str, bool]) -> None:
    """One forward pass on the synthetic records, in the plan's modes, on a fresh copy of
    the model: a buffer it changes (running statistics) would carry the data into the
    release without noise, and is refused; constant buffers (position ids) are fine."""
    import copy

    from torch.utils.data import default_collate

    from .batches import _tensors_of

    check = copy.deepcopy(model)
    if not any(True for _ in check.buffers()):
        return
    for name, m in check.named_modules():
        m.training = modes.get(name, m.training)
    before = {n: b.detach().clone() for n, b in check.named_buffers()}
    batch = (loader.collate_fn or default_collate)([dataset[0], dataset[1]])
    try:
        with torch.no_grad():
            if loss_fn is not None:
                loss_fn(check, batch)
            elif call is not None:
                tensors = _tensors_of(batch)
                check(*(s.of(tensors, 2) for s in call.inputs))
    except Exception as err:  # noqa: BLE001 - the user's model; its message stays in the node's log
        log(WARNING, "The model raised on synthetic records: %s: %s", type(err).__name__, err)
        raise UserLoopError(f"the model raised {type(err).__name__} on synthetic records shaped as yours (its "
                            "message is in the node's log)", structural=True) from None
    changed = [n for n, b in check.named_buffers() if n not in before or not _equal(b.detach(), before[n])]
    if changed:
        raise UserLoopError(f"the model's forward pass changes its buffers {changed[:3]} (running statistics?), "
                            "which would carry the data into the release without noise: keep buffers constant "
                            "(statistics per record, e.g. GroupNorm or LayerNorm)", structural=True)
