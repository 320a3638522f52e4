"""The Poisson batches: the owners' sampling rate and step count over the user's data
set (its ``collate_fn`` kept), and where a tensor the model or the loss got comes from
in the current batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ..dp_sgd import UnitBatch, _draw_batch
from .common import UserLoopError, _equal


class PoissonBatches:
    """Batch sampler: ``steps`` Poisson samples of units at ``rate`` in total, an
    ``epochs``-th of them (rounded up) per pass over the loader, so a train function
    that loops ``epochs`` epochs takes them all; a pass after the last step yields
    nothing (counted in ``empty_passes``)."""

    def __init__(self, unit_of_record: torch.Tensor, num_units: int, rate: float, steps: int,
                 generator: torch.Generator, secure: bool, epochs: int = 1) -> None:
        self.unit_of_record = unit_of_record
        self.num_units = num_units
        self.rate = float(rate)
        self.steps = int(steps)
        self.per_pass = max(1, math.ceil(self.steps / max(1, int(epochs))))
        self.generator = generator
        self.secure = secure
        self.drawn = 0
        self.passes = 0
        self.empty_passes = 0
        self.current: UnitBatch | None = None
        self.tensors: list[torch.Tensor] = []  # the tensors of the current collated batch
        #: called with (draw number, sample, tensors, the batch's structure holding them, the
        #: records' items as the data set gave them) once each drawn batch is collated
        self.on_batch: Callable | None = None

    def __len__(self) -> int:
        # The batches the next pass yields; once all are taken, a full pass's count
        # (a train loop that divides by len(loader) must not divide by zero).
        return min(self.per_pass, max(self.steps - self.drawn, 0)) or self.per_pass

    def __iter__(self) -> Iterator[list[int]]:
        self.passes += 1
        if self.drawn >= self.steps:
            self.empty_passes += 1
        quota = self.per_pass
        while self.drawn < self.steps and quota > 0:
            quota -= 1
            yield self.draw()

    def draw(self) -> list[int]:
        """The next Poisson sample (the records' indices); never more than ``steps``."""
        if self.drawn >= self.steps:
            raise UserLoopError("the private loader has yielded every batch of this round")
        self.current = _draw_batch(self.unit_of_record, self.num_units, self.rate, self.generator, self.secure)
        self.drawn += 1
        return self.current.records.tolist()


def _map_tensors(batch, fn: Callable[[torch.Tensor], torch.Tensor]):  # noqa: ANN001, ANN202
    """``batch`` (a collated structure: tensors in dicts or other mappings, such as Hugging
    Face's ``BatchEncoding``, lists, tuples and named tuples) rebuilt with ``fn`` of each
    tensor, in the order of :func:`_tensors_of`; other leaves are kept as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, list | tuple):
        items = [_map_tensors(v, fn) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _empty_like(batch):  # noqa: ANN001, ANN201
    """``batch`` (a collated structure) with every tensor cut to zero rows."""
    return _map_tensors(batch, lambda t: t[:0])


def _with_tensors(batch, tensors: list[torch.Tensor]):  # noqa: ANN001, ANN201
    """``batch`` with its tensors (in the order of :func:`_tensors_of`) replaced by ``tensors``."""
    it = iter(tensors)
    return _map_tensors(batch, lambda _: next(it))


def _not_by_rows(batch, n: int) -> list[str]:  # noqa: ANN001
    """What in ``batch`` (a collated batch of ``n`` records) does not hold them along dim 0,
    each as its type and shape (a time-first tensor, a constant, a string): empty if every
    leaf is a tensor with ``n`` rows (None leaves aside), so that each record's part of the
    batch is its row block and nothing else."""
    if isinstance(batch, torch.Tensor):
        return [] if batch.dim() and batch.shape[0] == n else [f"a tensor of shape {tuple(batch.shape)}"]
    if isinstance(batch, Mapping):
        return [d for v in batch.values() for d in _not_by_rows(v, n)]
    if isinstance(batch, list | tuple):
        return [d for v in batch for d in _not_by_rows(v, n)]
    return [] if batch is None else [f"a {type(batch).__name__}"]


def _rows_are_records(batch, items: list, collate: Callable, leaves: list[int] | None = None) -> bool:  # noqa: ANN001
    """Whether the rows of ``batch`` (``collate(items)``) are, record by record, that
    record's batch of one (``collate([item])``), exactly: its tensors numbered ``leaves``
    (default: every leaf, which must all be tensors), each with the records along dim 0.
    So a split by rows gives each record its own values only, whatever the layout
    (a time-first batch whose length equals the number of records, padding to the
    batch's longest record). ``batch`` must be ``collate(items)``: for torch's
    ``default_collate`` over records of one layout that holds by construction
    (:func:`_stacked_by_default_collate`) and no record is collated again."""
    n = len(items)
    tensors = _tensors_of(batch)
    if leaves is None:
        if _not_by_rows(batch, n):
            return False
        leaves = list(range(len(tensors)))
    if any(i >= len(tensors) or tensors[i].dim() == 0 or tensors[i].shape[0] != n for i in leaves):
        return False
    if _stacked_by_default_collate(items, collate):
        return True
    for j, item in enumerate(items):
        try:
            one = _tensors_of(collate([item]))
        except Exception:  # noqa: BLE001 - the user's collate_fn on one record: not split by rows
            return False
        if len(one) != len(tensors) or not all(_equal(one[i], tensors[i][j:j + 1]) for i in leaves):
            return False
    return True


def _layout_of(item) -> tuple | None:  # noqa: ANN001
    """The structure of one record as the data set gives it: containers (dicts, lists,
    tuples) down to plain strided tensors, each as its shape, dtype and device; None if
    anything else is in it."""
    if type(item) is torch.Tensor:
        return (torch.Tensor, tuple(item.shape), item.dtype, item.device) if item.layout == torch.strided else None
    if type(item) is dict:
        parts = tuple(_layout_of(v) for v in item.values())
        return None if None in parts else (dict, tuple(item), parts)
    if type(item) in (list, tuple):
        parts = tuple(_layout_of(v) for v in item)
        return None if None in parts else (type(item), parts)
    return None


def _stacked_by_default_collate(items: list, collate: Callable) -> bool:
    """Whether ``collate`` is torch's ``default_collate`` and every record has the same
    layout (:func:`_layout_of`: the same keys in the same order, tensors of the same shape,
    dtype and device, nothing else): ``default_collate`` then stacks each tensor along a
    new dim 0, so row ``j`` of the batch is record ``j``'s tensor, exactly as in the batch
    of that record alone, without collating each record again."""
    from torch.utils.data import default_collate

    if collate is not default_collate or not items:
        return False
    first = _layout_of(items[0])
    return first is not None and all(_layout_of(item) == first for item in items[1:])


#: How a batch that does not hold its records along dim 0 is written so that it does.
BY_ROWS_HINT = ("every tensor of a batch must hold the records along dim 0 (pad_sequence(..., batch_first=True); "
                "nn.LSTM, nn.GRU and nn.Transformer with batch_first=True, or transpose inside the model, not in "
                "collate_fn), and a batch must hold nothing else: move constants (masks, settings, strings) out of "
                "the batch into the model or loss_fn")


def _tensors_of(batch) -> list[torch.Tensor]:  # noqa: ANN001
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors_of(v)]
    if isinstance(batch, list | tuple):
        return [t for v in batch for t in _tensors_of(v)]
    return []


class PoissonLoader(DataLoader):
    """The user's data set in the server's Poisson batches (the user's
    ``collate_fn``). An empty sample is yielded as a batch of zero rows (its step is
    pure noise, as the accounting assumes)."""

    def __init__(self, dataset, sampler: PoissonBatches, collate_fn=None) -> None:
        from torch.utils.data import default_collate

        collate = collate_fn or default_collate

        def collate_or_empty(items):
            batch = collate(items) if items else _empty_like(collate([dataset[0]]))
            sampler.tensors = [t.detach().clone() for t in _tensors_of(batch)]  # the pass's own copy
            if sampler.on_batch is not None:
                sampler.on_batch(sampler.drawn, sampler.current, sampler.tensors, _with_tensors(batch, sampler.tensors),
                                 list(items))
            return batch

        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_or_empty, num_workers=0)
        self.poisson = sampler
        self.user_collate = collate
        self.collate_or_empty = collate_or_empty

    def _next_batch(self):  # noqa: ANN201 - the user's collated structure
        """Draw the next Poisson sample and collate it, outside the user's loop."""
        return self.collate_or_empty([self.dataset[i] for i in self.poisson.draw()])


@dataclass(frozen=True)
class _Source:
    """Where a tensor the model or the loss got comes from: the batch's tensor number
    ``index``, moved to ``device``, cast to ``dtype`` and reshaped to ``shape`` with
    its first dimension ``rows_per_record`` times the batch size."""

    index: int
    dtype: torch.dtype
    device: torch.device
    tail: tuple[int, ...]
    rows_per_record: int

    def of(self, batch: list[torch.Tensor], n: int) -> torch.Tensor:
        t = batch[self.index].to(self.device, self.dtype)
        return t.reshape(n * self.rows_per_record, *self.tail)

    def fits(self, batch: list[torch.Tensor], n: int) -> bool:
        """Whether ``batch`` (a batch of ``n`` records) has this tensor with the records
        along dim 0 and the plan's shape (so that :meth:`of` splits it by record)."""
        if self.index >= len(batch):
            return False
        t = batch[self.index]
        return t.dim() > 0 and t.shape[0] == n and t.numel() == n * self.rows_per_record * math.prod(self.tail)


def _source(t: torch.Tensor, batch: list[torch.Tensor], n: int, rows_exact: bool) -> _Source | None:
    """Which of the batch's tensors ``t`` is, moved, cast or reshaped (so that its
    rows, in blocks of ``t.shape[0] / n``, are the records' own values); None if none."""
    if t.dim() == 0 or t.shape[0] % max(n, 1) or (rows_exact and t.shape[0] != n):
        return None
    for i, b in enumerate(batch):
        if b.dim() == 0 or b.shape[0] != n or b.numel() != t.numel() or (n == 0 and b.shape[1:] != t.shape[1:]):
            continue
        if b is t or _equal(t.detach(), b.detach().to(t.device, t.dtype).reshape(t.shape)):
            return _Source(i, t.dtype, t.device, tuple(t.shape[1:]), t.shape[0] // n if n else 1)
    return None
