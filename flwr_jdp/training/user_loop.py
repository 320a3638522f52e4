"""DP-SGD inside the user's own training loop: the drop-in client's DP pass.

The user's ``train(model, loader)`` keeps its loss function, optimizer and loop.
For the duration of :func:`private_training` it is handed

- a :class:`PoissonLoader` over the user's data set (its ``collate_fn`` kept) that
  yields exactly the ``steps`` Poisson batches of rate ``q`` the owners agreed to,
  an ``epochs``-th of them per pass, and
- the user's model wrapped in a :class:`PrivateModule`, whose forward pass is lazy:
  it returns the output as a placeholder, and when that output goes into a torch
  loss function (``nn.CrossEntropyLoss()(out, y)``, ``F.mse_loss``, ...) the DP pass
  sees the call and computes, in one vectorised pass (``vmap(grad(...))`` over
  ``functional_call``), each record's own term of that loss, its gradient and its
  output, computed on the record alone. The user gets the real output and the real
  loss value; ``loss.backward()`` then has nothing left to do. Where that pass cannot
  trace the model (or could not keep its records apart: an ``autograd.Function`` with
  its own ``vmap`` rule), each record's gradient comes from a micro-batch of that one
  record (its forward, loss term and backward with nothing else in the batch): per
  record by construction on every path, nothing sampled or checked.

Unit, sensitivity and noise (one place): every ``optimizer.step()`` on the model's
trainable parameters is preceded by the DP step (an optimizer pre-step hook): the
per-unit gradients of the current batch (records clipped to ``C`` jointly over the
trainable parameters, averaged within a user under the user unit) are summed, so
one unit moves the sum by at most ``C``; the mechanism
(:class:`~flwr_jdp.privacy.mechanisms.GaussianSumMechanism`) adds ``N(0, (z C)^2)``
and divides by the expected batch ``q N``; the optimizer then applies that gradient
(post-processing). Each step is ``PoissonSampled(q, Gaussian(z))``, ``steps`` of
them per round: what the ledgers record (:func:`flwr_jdp.privacy.events.dp_sgd`).
Under central noise (``capture``) the clipped sum is kept instead and nothing moves.

The DP pass owns the release. With the train function given (the drop-in client),
:func:`private_training` first runs it on two synthetic records shaped as the owner's
(:func:`_dry_run`, on a copy of the model): that reads none of the owner's data, fixes
the loss and its arguments, the optimizer (a ``torch.optim`` class and its settings), the
model's modes and device (:class:`_Plan`), and checks every rule below, so a refusal
(:class:`UserLoopError`, nothing sent) cannot depend on the data. On the owner's data
(:class:`_ReleasePass`) the DP steps run on the pass's own model and its own copy of each
batch with the plan's loss and optimizer; step k uses Poisson draw k, at most ``steps``
draws exist, and the steps the train function leaves out are taken at the end. The train
function only paces the steps (each ``optimizer.step()`` takes the ones due) and sees
their trajectory in its model; whatever else it does (edits of the model or the batch,
hooks, modes, a scheduler, loss arguments chosen from a batch, an early stop, an
exception) is set aside with one line on the node. The release is the DP steps'
trajectory.

Refused on the dry run, whatever the data:

- the model's inputs or the loss's target are not tensors of the current batch
  (moved to a device, cast or reshaped is fine; records transformed or mixed inside
  the loop, such as mixup, are not);
- the loss is not a torch loss function on the model's output (a hand-written loss,
  the output transformed first), or a second loss on one batch's output;
- per-record weights in the loss, ``step(closure)``, an optimizer from outside
  ``torch.optim``, keyword arguments to the model, no loss or no optimizer step at all.

Without the train function given, the same rules are checked as the block's train
function runs (what the dry run does).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import ERROR, WARNING

import torch
import torch.nn.functional as F
from flwr.common import log
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from ..privacy.mechanisms import GaussianSumMechanism
from . import per_sample
from .dp_sgd import UnitBatch, _draw_batch, batch_sums, clipped_unit_rows


class UserLoopError(RuntimeError):
    """The user's training loop does something DP-SGD cannot account for.
    ``structural``: a rule of the DP pass the train function's code breaks (it will
    break it again next round)."""

    def __init__(self, message: str, *, structural: bool = False) -> None:
        super().__init__(message)
        self.structural = structural


# ------------------------------------------------------------------ the batches
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
        #: called with (draw number, sample, tensors) once each drawn batch is collated
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


def _empty_like(batch):
    """``batch`` (a collated structure) with every tensor cut to zero rows."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)({k: _empty_like(v) for k, v in batch.items()})
    if isinstance(batch, list | tuple):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


def _tensors_of(batch) -> list[torch.Tensor]:  # noqa: ANN001
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
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
                sampler.on_batch(sampler.drawn, sampler.current, sampler.tensors)
            return batch

        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_or_empty, num_workers=0)
        self.poisson = sampler
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


# ------------------------------------------------------------ the lazy output
#: Loss functions whose call on the model's output the DP pass computes record by
#: record. A record's term is the function on its own rows, its elements summed
#: (``reduction="sum"``) or averaged over the record's elements (``"mean"`` and
#: ``"none"``; as Opacus's ``loss_reduction="mean"``, but class weights and ignored
#: positions never rescale one record by the others).
LOSSES = (F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
          F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.soft_margin_loss,
          F.multilabel_soft_margin_loss, F.poisson_nll_loss)
#: Reshapes (and no-op casts) that keep each record's values in one block of rows
#: (checked: the result shares the output's memory and has a multiple of its rows).
_RESHAPES = (torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.flatten, torch.reshape, torch.flatten,
             torch.Tensor.contiguous, torch.Tensor.squeeze, torch.squeeze, torch.Tensor.unsqueeze,
             torch.unsqueeze, torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.float, torch.Tensor.to)
#: Reads of a tensor's metadata (no value read).
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.register_hook, torch.Tensor.__hash__}
_METADATA_NAMES = {"shape", "ndim", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad",
                   "layout", "is_cuda", "names", "_version", "data_ptr", "_backward_hooks"}


@dataclass(eq=False)
class _Forward:
    """One grad-enabled call of the private model: its inputs and the placeholder
    of its output, filled once the values are known."""

    inputs: tuple[torch.Tensor, ...]
    sources: tuple
    draw: int
    values: torch.Tensor
    filled: bool = False
    consumed: bool = False


class PendingOutput(torch.Tensor):
    """The private model's output until a loss function is applied to it: any other
    use first fills in its values (a plain forward pass); a loss function is computed
    by the DP pass record by record (:meth:`_DPPass.loss`)."""

    _fwd: _Forward
    _pass: _DPPass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__" and \
                getattr(getattr(func, "__self__", None), "__name__", "") in _METADATA_NAMES:
            with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001
                return func(*args, **kwargs)
        first = args[0] if args else kwargs.get("input")
        if isinstance(first, PendingOutput):
            if func in LOSSES:
                return first._pass.loss(func, args, kwargs)
            if func in _RESHAPES and not first._fwd.filled:
                view = first._pass.reshaped(first, func, args, kwargs)
                if view is not None:
                    return view
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, list | tuple) else (a,):
                if isinstance(t, PendingOutput):
                    t._pass.fill(t._fwd)
        with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001
            return func(*args, **kwargs)


def _pending(values: torch.Tensor, fwd: _Forward, dp_pass: _DPPass) -> PendingOutput:
    out = torch.Tensor._make_subclass(PendingOutput, values, True)  # noqa: SLF001
    out._fwd, out._pass = fwd, dp_pass
    out.register_hook(dp_pass.foreign_gradient)
    return out


# ------------------------------------------------------------------ the DP pass
def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if b.device != a.device:
        b = b.to(a.device)
    if torch.equal(a, b):
        return True
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _same_setting(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@dataclass(frozen=True)
class _LossCall:
    """The user's loss as the DP pass computes it record by record (kept to take the
    steps the train function left out)."""

    func: Callable
    params: dict
    reduction: str
    inputs: tuple[_Source, ...]
    target: _Source
    rest: tuple[int, ...]  # the shape of one row of the loss's input
    k: int  # rows per record (0: seen on an empty batch only)

    def same(self, other: _LossCall) -> bool:
        return (self.func is other.func and self.reduction == other.reduction and self.inputs == other.inputs
                and self.target == other.target and self.rest == other.rest and self.k == other.k
                and self.params.keys() == other.params.keys()
                and all(_same_setting(self.params[key], other.params[key]) for key in self.params))

    def one(self) -> Callable:
        """A record's term: the loss on its own rows, summed or averaged over them."""
        k, rest, trest = self.k or 1, self.rest, self.target.tail

        def loss_one(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            terms = self.func(o.reshape(k, *rest), t.reshape(k, *trest), reduction="none", **self.params)
            return terms.sum() if self.reduction == "sum" else terms.sum() / terms.numel()
        return loss_one


class _DPPass:
    """One DP pass: the trajectory the DP steps make (``expected``: every parameter and
    buffer of the model), the current batch's per-record gradients, the optimizer the
    DP steps use, and what the train function did that the pass set aside."""

    def __init__(self, model: nn.Module, loader: PoissonLoader, clipping_norm: float,
                 mechanism: GaussianSumMechanism | None, generator: torch.Generator, capture: bool) -> None:
        self.model = model
        self.loader = loader
        self.sampler = loader.poisson
        self.clipping_norm = clipping_norm
        self.mechanism = mechanism
        self.generator = generator
        self.capture = capture
        self.named = dict(model.named_parameters())
        self.trainable = {n for n, p in self.named.items() if p.requires_grad}
        self.params = [p for n, p in self.named.items() if n in self.trainable]
        self.tracked = {f"p:{n}": p for n, p in self.named.items()}
        self.tracked.update((f"b:{n}", b) for n, b in model.named_buffers())
        self.expected = self._values()
        self.engine: per_sample.FuncPerSample | None = None
        self.path = "torch.func"  # how the last per-record gradients were computed ("micro-batch")
        #: Distributed noise: turns a batch's clipped per-unit rows into the integer sum
        #: that is captured instead of the clipped sum (:class:`~flwr_jdp.joint_dp.distributed.UnitEncoder`).
        self.encoder: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.user_optimizer: torch.optim.Optimizer | None = None
        self.first_settings: list[dict] = []
        self.optimizer: torch.optim.Optimizer | None = None  # the DP steps' own copy of it
        self.last_loss: _LossCall | None = None
        self.ready_draw = 0  # the draw whose per-record gradients are in grad_sample
        #: drawn batches not yet stepped on, by draw number: DP step k uses draw k, always
        self.unstepped: dict[int, tuple[UnitBatch, list[torch.Tensor]]] = {}
        self.sampler.on_batch = lambda d, sample, tensors: self.unstepped.__setitem__(d, (sample, tensors))
        self.steps_taken = 0
        self.steps_completed = 0  # taken by the pass after the train function returned
        self.captured: list[torch.Tensor] | None = None
        self.refusal: str | None = None
        self.foreign = False
        self.inside = False
        self.set_aside: dict[str, str] = {}
        self.shapes = _SHAPES
        #: the model's kind and parameter shapes (what the cached shapes and layer roles hold for)
        self.kind = (per_sample.model_kind(model), tuple((n, tuple(p.shape)) for n, p in self.named.items()))
        self.dry = False  # the dry run: rules checked, no gradient computed
        self.shown_model = model  # the model whose output the user's code reads
        self.modes: dict[str, bool] | None = None
        self.device = torch.device("cpu")

    # ------------------------------------------------------- refusals and notes
    def refuse(self, reason: str) -> None:
        """Record the first violation (a train function that catches the error still
        has its round refused) and raise it."""
        if self.refusal is None:
            self.refusal = reason
        raise UserLoopError(self.refusal, structural=True)

    def note(self, key: str, text: str) -> None:
        """Something the train function did that the DP pass set aside (logged once, at the end)."""
        self.set_aside.setdefault(key, text)

    # ------------------------------------------------------------ the trajectory
    def _values(self) -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in self.tracked.items()}

    def restore(self, when: str) -> None:
        """Put back what the last DP step left wherever the train function changed it
        (a no_grad edit, a hand-written update, a restored iterate): the DP steps run
        on, and release, their own trajectory only."""
        changed = []
        with torch.no_grad():
            for key, t in self.tracked.items():
                want = self.expected[key]
                if want.device != t.device:  # a moved model: follow it
                    want = self.expected[key] = want.to(t.device)
                if not _equal(t.detach(), want):
                    t.copy_(want)
                    changed.append(key[2:])
        if changed:
            self.note("changed", f"the train function changed {changed[:3]} outside the DP steps ({when}); the "
                                 "DP pass put back the values its steps had made (no_grad edits, hand-written "
                                 "updates and restored iterates do not reach the release)")

    def foreign_gradient(self, grad: torch.Tensor) -> None:
        """Hook on the private output: a gradient reaching it did not come through a
        loss function the DP pass computed record by record."""
        self.foreign = True

    # ------------------------------------------------------------- forward
    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self.trainable:
            return module(*args, **kwargs)
        if kwargs:
            self.refuse(f"keyword arguments to the model's forward ({sorted(kwargs)}) are not supported "
                        "in the DP pass")
        batch = self.sampler.tensors
        n = len(self.sampler.current.records) if self.sampler.current is not None else -1
        sources = tuple(_source(a, batch, n, rows_exact=True) if isinstance(a, torch.Tensor) else None
                        for a in args)
        if n < 0 or not args or any(s is None for s in sources):
            self.refuse("the model's input is not a tensor of the private loader's current batch (moving it to "
                        "a device, casting or reshaping it is fine): transform records in the data set (its "
                        "transform or collate_fn), not in the train function; mixing the records of a batch "
                        "(mixup) breaks per-record clipping")
        return self._pending(module, tuple(a.detach() for a in args), sources, n)

    def _pending(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], sources: tuple, n: int,
                 draw: int | None = None) -> PendingOutput:
        draw = self.sampler.drawn if draw is None else draw
        if n == 0:
            with torch.no_grad():
                values = module(*inputs)
            fwd = _Forward(inputs, sources, draw, values, filled=True)
        else:
            shape, dtype, device = self._record_shape(module, inputs)
            fwd = _Forward(inputs, sources, draw, torch.full((n, *shape), float("nan"), dtype=dtype, device=device))
        return _pending(fwd.values, fwd, self)

    def _record_shape(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple:
        key = (self.kind, *((tuple(a.shape[1:]), a.dtype, a.device) for a in inputs))
        if key not in self.shapes:
            with torch.no_grad():
                one = module(*(a[:1] for a in inputs))
            if not isinstance(one, torch.Tensor) or one.dim() == 0 or one.shape[0] != 1:
                self.refuse("the model's output must be one tensor with a row per record")
            self.shapes[key] = (tuple(one.shape[1:]), one.dtype, one.device)
        return self.shapes[key]

    def fill(self, fwd: _Forward) -> None:
        """The output's values, for a use other than a loss function (one plain forward)."""
        if fwd.filled:
            return
        with torch.no_grad():
            fwd.values.copy_(self.shown_model(*fwd.inputs))
        fwd.filled = True

    def reshaped(self, out: PendingOutput, func, args, kwargs) -> PendingOutput | None:  # noqa: ANN001
        with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001
            view = func(*(a.as_subclass(torch.Tensor) if isinstance(a, PendingOutput) else a for a in args),
                        **kwargs)
        n = out._fwd.values.shape[0]
        if not isinstance(view, torch.Tensor) or view.dim() == 0 or view.shape[0] % n or \
                view.data_ptr() != out._fwd.values.data_ptr() or view.dtype != out.dtype:
            return None
        return _pending(view, out._fwd, self)

    # ---------------------------------------------------------------- loss
    def loss(self, func, args: tuple, kwargs: dict) -> torch.Tensor:  # noqa: ANN001
        bound = inspect.signature(func).bind(*args, **kwargs)
        params = dict(bound.arguments)
        out, target = params.pop("input"), params.pop("target", None)
        for legacy in ("size_average", "reduce"):
            if params.get(legacy) is not None:
                self.refuse(f"the loss's deprecated argument '{legacy}' is not supported: use reduction")
            params.pop(legacy, None)
        reduction = params.pop("reduction", "mean")
        fwd = out._fwd
        n = fwd.values.shape[0]
        if fwd.draw != self.sampler.drawn or fwd.consumed:
            self.refuse("one loss per batch, on the model's output for the current batch of the private loader")
        target_source = _source(target, self.sampler.tensors, n, rows_exact=False) \
            if isinstance(target, torch.Tensor) else None
        if target_source is None:
            self.refuse("the loss's target is not a tensor of the private loader's current batch (moving it to "
                        "a device, casting or reshaping it is fine): transform records in the data set, not "
                        "in the train function")
        if out.shape[0] != target.shape[0]:
            self.refuse("the loss's input and target have different numbers of rows")
        for name, value in params.items():
            if isinstance(value, torch.Tensor) and value.dim() >= out.dim():
                self.refuse(f"the loss's '{name}' has a value per record: weights must be per class")
        if self.modes is None:  # what the release pass runs the model in (the dry run's first loss)
            self.modes = {name: m.training for name, m in self.model.named_modules()}
            self.device = next(iter(self.params)).device
        k = out.shape[0] // n if n else 0
        call = _LossCall(func, params, reduction, fwd.sources, target_source, tuple(out.shape[1:]), k)
        if n and self.last_loss is not None and self.last_loss.k and not self.last_loss.same(call):
            self.refuse("the loss function or its arguments (class weights, ...) changed between batches: one "
                        "loss, with constant arguments, for the whole DP pass")
        if n or self.last_loss is None:  # an empty batch's call says less (its rows per record)
            self.last_loss = call
        fwd.consumed = True
        self._catch_up(fwd.draw)
        self._gradients(fwd, target.detach(), call)
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001
            value = func(out.as_subclass(torch.Tensor), target, reduction=reduction, **params)
        return value.detach().requires_grad_(True)

    def _catch_up(self, draw: int) -> None:
        """DP steps on the drawn batches before ``draw`` that the train function did not
        step on, in draw order, with its loss (so that step k always uses draw k). Until
        the train function's first step the pass has no optimizer: they wait (the end of
        the pass takes them, or refuses)."""
        if self.optimizer is None and not self.capture:
            return
        for d in sorted(x for x in self.unstepped if x < draw):
            self.note("steps", "the train function left DP steps untaken (a skipped batch, an early stop, or "
                               "fewer passes over the loader than local-epochs); the DP pass took them, on their "
                               "own batches in order, with the train function's loss and optimizer")
            self._step_on(d)

    def _step_on(self, draw: int) -> None:
        """One DP step on drawn batch ``draw``, taken by the pass with the last loss."""
        call = self.last_loss
        assert call is not None
        sample, tensors = self.unstepped[draw]
        n = len(sample.records)
        inputs = tuple(s.of(tensors, n) for s in call.inputs)
        with torch.no_grad():
            fwd = self._pending(self.model, inputs, call.inputs, n, draw)._fwd
        self._gradients(fwd, call.target.of(tensors, n), call)
        self._dp_step(draw)

    def _gradients(self, fwd: _Forward, target: torch.Tensor, call: _LossCall) -> None:
        """Each record's gradient of its own term (``grad_sample``), at the trajectory's
        parameters; fills the output with each record's output."""
        self.restore("before a loss")
        for p in self.params:
            p.grad_sample = None
        n = fwd.values.shape[0]
        if self.dry:  # the dry run checks the code, it computes no gradient
            self.fill(fwd)
            for p in self.params:
                p.grad_sample = torch.zeros((n, *p.shape), dtype=p.dtype, device=p.device)
        elif n:
            values = self._per_record(fwd, target.reshape(n, call.k or 1, *call.target.tail), call.one())
            if not fwd.filled:
                with torch.no_grad():
                    fwd.values.copy_(values.reshape(fwd.values.shape))
                fwd.filled = True
        else:
            for p in self.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.ready_draw = fwd.draw

    def _per_record(self, fwd: _Forward, targets: torch.Tensor, loss_one) -> torch.Tensor:  # noqa: ANN001
        """Each record's gradient of its own term, on the record alone: one vectorised
        pass where ``vmap`` can trace the model and keep its records apart, else
        micro-batches of one record (its forward, loss term and backward alone)."""
        kind = per_sample.model_kind(self.model)
        if per_sample.BACKEND in ("auto", "func") and kind not in per_sample.FUNC_FAILED:
            try:
                if self.engine is None:
                    self.engine = per_sample.FuncPerSample(self.model, set_train=False)
                    self.engine.single_row_linear = _LINEAR.get((self.kind, *(a.shape[1:] for a in fwd.inputs)))
                self.engine._per_record(fwd.inputs, targets, loss_one, len(targets),  # noqa: SLF001
                                        randomness="different", trainable=self.trainable)
                _LINEAR[(self.kind, *(a.shape[1:] for a in fwd.inputs))] = self.engine.single_row_linear
                self.path = "torch.func"
                return self.engine.outputs
            except (MemoryError, torch.OutOfMemoryError):
                raise
            except Exception as err:  # noqa: BLE001 - vmap's errors have no common type
                if per_sample.BACKEND == "func":
                    self.refuse(f"per-sample gradients by torch.func failed: {type(err).__name__}")
                reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
                per_sample.FUNC_FAILED[kind] = reason
                log(WARNING, "per-sample gradients of %s: torch.func cannot handle the model (%s); computing "
                    "each record's gradient on its own (micro-batches of one record)", type(self.model).__qualname__,
                    reason)
                for p in self.params:
                    p.grad_sample = None
        return self._micro(fwd.inputs, targets, loss_one)

    def _micro(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_one) -> torch.Tensor:  # noqa: ANN001
        """Micro-batches of one: record ``i``'s output and loss term from its own rows only."""
        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(*(a[i:i + 1] for a in inputs))
            return loss_one(out, targets[i]), out.detach()[0]

        self.path = "micro-batch"
        try:
            return per_sample.record_by_record(self.model, {n: self.named[n] for n in self.trainable},
                                               len(targets), term)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # noqa: BLE001 - the user's model on one record
            self.refuse(f"the model cannot compute a record's gradient on that record alone (a batch of one "
                        f"raised {type(err).__name__}): each record's gradient must come from its own forward pass")
            raise

    # ---------------------------------------------------------------- steps
    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        ids = {id(p) for p in self.params}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The user's ``optimizer.step()``: the DP step, if this batch has per-record
        gradients and no step yet; either way the user's optimizer itself moves none of
        the model's trainable parameters (their gradients are cleared before it runs)."""
        if self.inside or not self.owns(optimizer):
            return  # the DP step's own optimizer, or another model's
        if self.refusal is not None:
            raise UserLoopError(self.refusal, structural=True)
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:  # args[0]: the optimizer
            self.refuse("optimizer.step(closure) re-evaluates the loss inside the step: call step() without a "
                        "closure")
        if self.user_optimizer is None:
            self.user_optimizer, self.first_settings = optimizer, _settings(optimizer)
            self.optimizer = self._copy(optimizer)
        elif optimizer is not self.user_optimizer:
            self.note("optimizer", "a second optimizer stepped the model; the DP steps kept using a copy of the "
                                   "first one")
        if any(p.grad is not None for p in self.params):
            self.note("grads", "gradients reached the trainable parameters other than through the loss "
                               "function on the model's output (a weight penalty?); the DP steps ignored them "
                               "(use the optimizer's weight_decay)")
        if self.foreign:
            self.refuse("a gradient reached the model's output outside a torch loss function (a hand-written "
                        "loss, or the output transformed before the loss): pass the output straight to a torch "
                        "loss function (reshaping it is fine)")
        draw = self.sampler.drawn
        if draw in self.unstepped and self.ready_draw == draw and min(self.unstepped) == draw:
            self._dp_step(draw)
        else:
            self.note("step", "optimizer.step() was called without a new batch and a loss on it (a second "
                              "step per batch?); the DP pass did not step there")
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None  # the user's optimizer moves nothing of the model's

    def _copy(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """A fresh optimizer of the user's class and settings (as the first step found
        them) over the trainable parameters: what the DP steps apply the noised
        gradients with; settings or state changed later on the user's optimizer do
        not reach it."""
        ours = {id(p) for p in self.params}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [p for p in g["params"] if id(p) in ours]} for g in optimizer.param_groups]
        groups = [g for g in groups if g["params"]]
        held = {id(p) for g in groups for p in g["params"]}
        if held != ours:
            self.refuse("one optimizer must hold every trainable parameter of the model")
        if not type(optimizer).__module__.startswith("torch.optim"):
            self.refuse(f"the DP steps use torch.optim's optimizers only (got {type(optimizer).__qualname__})")
        try:
            return type(optimizer)(groups, **optimizer.defaults)
        except Exception as err:  # noqa: BLE001 - a custom optimizer's constructor
            self.refuse(f"the DP pass could not make its copy of the optimizer ({type(optimizer).__name__}: "
                        f"{type(err).__name__}): use a torch.optim optimizer")
            raise

    def _dp_step(self, draw: int) -> None:
        """Clip, sum, noise; apply with the DP pass's optimizer on the trajectory."""
        sample, _ = self.unstepped.pop(draw)
        n = len(sample.records)
        if any(not isinstance(getattr(p, "grad_sample", None), torch.Tensor | per_sample.OuterProducts)
               or len(p.grad_sample) != n for p in self.params):
            self.refuse("the per-record gradients of this batch are missing")
        self.restore("before a step")
        if self.dry:
            for p in self.params:
                p.grad_sample = None
            self.steps_taken += 1
            return
        if self.encoder is not None:
            flat = self.encoder(clipped_unit_rows(self.params, sample, self.clipping_norm))
            sums = [part.reshape(p.shape) for part, p in zip(torch.split(flat, [p.numel() for p in self.params]),
                                                               self.params, strict=True)]
        else:
            sums = batch_sums(self.params, sample, self.clipping_norm)
        for p in self.params:
            p.grad_sample = None
        if self.capture:
            self.captured = sums if self.captured is None else [a + b for a, b in zip(self.captured, sums, strict=True)]
        else:
            assert self.mechanism is not None and self.optimizer is not None
            grads = self.mechanism.release_torch(sums, self.generator)
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g.to(p.dtype)
            self.inside = True
            try:
                self.optimizer.step()
            finally:
                self.inside = False
                for p in self.params:
                    p.grad = None
        self.expected = self._values()
        self.steps_taken += 1

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.inside and self.owns(optimizer):
            self.restore("in the user's optimizer step")

    # -------------------------------------------------------------- the end
    def finish(self, steps: int, epochs: int) -> None:
        """After the train function: the trajectory put back, the steps it left out
        taken with its own loss function and optimizer, and what was set aside logged."""
        if self.refusal is not None:
            raise UserLoopError(self.refusal, structural=True)
        now = {f"p:{n}": p for n, p in self.model.named_parameters()}
        now.update((f"b:{n}", b) for n, b in self.model.named_buffers())
        if now.keys() != self.tracked.keys() or any(now[k] is not t for k, t in self.tracked.items()):
            self.refuse("the train function replaced the model's parameters or buffers (assign new values with "
                        "the optimizer, not new Parameter objects)")
        self.restore("after the last DP step")
        if self.steps_taken < steps:
            if self.last_loss is None or (self.optimizer is None and not self.capture):
                self.refuse("the train function took no DP step (no torch loss on the model's output followed by "
                            "optimizer.step()): take one step per batch of the private loader")
            before = self.steps_taken
            self.note("steps", f"the train function left DP steps untaken (a skipped batch, an early stop, or "
                               f"fewer passes over the loader than local-epochs = {epochs}); the DP pass took "
                               "them, on their own batches in order, with the train function's loss and optimizer")
            self._catch_up(self.sampler.drawn + 1)
            while self.steps_taken < steps:
                self.loader._next_batch()  # noqa: SLF001
                self._step_on(self.sampler.drawn)
            self.steps_completed = self.steps_taken - before
        if self.user_optimizer is not None:
            now_settings = _settings(self.user_optimizer)
            changed = sorted({k for a, b in zip(now_settings, self.first_settings, strict=False)
                              for k in a.keys() | b.keys() if not _same_setting(a.get(k), b.get(k))})
            if changed:
                self.note("settings", f"the optimizer's {changed[:3]} changed during the DP pass (a scheduler?); "
                                      "the DP steps kept the first step's settings")
        for text in self.set_aside.values():
            log(WARNING, "DP pass: %s", text)

    def close(self) -> None:
        self.sampler.on_batch = None
        for p in self.model.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        if self.engine is not None:
            self.engine.close()


# ------------------------------------------------------- the dry run and the release
@dataclass(frozen=True)
class _Plan:
    """What the DP pass takes from the dry run (the train function on synthetic records):
    the loss, the optimizer, the model's modes and device. Nothing in it depends on the
    owner's data, so neither does anything decided from it."""

    call: _LossCall
    optimizer: tuple[type, dict, list[tuple[dict, list[str]]]] | None  # class, defaults, groups
    modes: dict[str, bool]
    device: torch.device


def _synthetic(item, generator: torch.Generator):  # noqa: ANN001, ANN202
    """``item`` (one record, as the data set gives it) with its values replaced: floats
    drawn from N(0, 1), integers and booleans zero. Only the structure, shapes and
    dtypes of the owner's data are kept."""
    if isinstance(item, torch.Tensor):
        if item.is_floating_point():
            return torch.randn(item.shape, generator=generator, dtype=item.dtype)
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


def _dry_run(model: nn.Module, loader: DataLoader, train_fn: Callable, steps: int, epochs: int,
             capture: bool) -> _Plan:
    """The train function on a copy of the model and two synthetic records: every rule of
    the DP pass is checked here (a refusal is structural: it cannot depend on the owner's
    data), and the loss, optimizer, modes and device it used become the plan."""
    import copy

    dry_model = copy.deepcopy(model)
    dataset = _SyntheticSet(loader.dataset, len(loader.dataset))  # type: ignore[arg-type]
    sampler = _BothRecords(torch.tensor([0, 1]), 2, 1.0, 1, torch.Generator().manual_seed(0), False, 1)
    dry_loader = PoissonLoader(dataset, sampler, loader.collate_fn)
    dry = _DPPass(dry_model, dry_loader, 1.0, None, torch.Generator().manual_seed(0), capture=True)
    dry.dry = True
    private = PrivateModule(dry_model, dry)
    handles = [register_optimizer_step_pre_hook(dry.before_step), register_optimizer_step_post_hook(dry.after_step)]
    try:
        try:
            train_fn(private, dry_loader)
        except UserLoopError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's code
            log(WARNING, "The train function raised on synthetic records: %s: %s", type(err).__name__, err)
            dry.refuse(f"the train function raised {type(err).__name__} on synthetic records shaped as yours "
                       "(its message is in the node's log)")
        if dry.refusal is not None:
            raise UserLoopError(dry.refusal, structural=True)
        if dry.last_loss is None or dry.modes is None:
            dry.refuse("the train function computed no torch loss on the model's output")
        if dry.user_optimizer is None and not capture:
            dry.refuse("the train function took no optimizer.step(): take one step per batch of the loader")
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
    return _Plan(dry.last_loss, optimizer, dict(dry.modes), dry.device)


class _ReleasePass(_DPPass):
    """The DP pass on the owner's data, after the dry run. The DP steps run on the pass's
    own model (``private``: the release's parameters, never handed to user code) and its
    own copy of each batch, with the plan's loss and optimizer: the user's train function
    only paces them (each ``optimizer.step()`` takes the steps due, in draw order) and
    sees the trajectory in its model. Nothing it does is refused: whatever differs from
    the plan, or an exception, is set aside with a note, and the steps it leaves are
    taken at the end."""

    def __init__(self, user_model: nn.Module, private: nn.Module, loader: PoissonLoader, clipping_norm: float,
                 mechanism: GaussianSumMechanism | None, generator: torch.Generator, capture: bool,
                 plan: _Plan) -> None:
        private.to(plan.device)
        for name, m in private.named_modules():
            m.training = plan.modes.get(name, m.training)
        super().__init__(private, loader, clipping_norm, mechanism, generator, capture)
        self.user_model = self.shown_model = user_model
        self.user_params = {n: p for n, p in user_model.named_parameters()}
        self.shown = {n: p.detach().clone() for n, p in self.user_params.items()}  # what the user's model showed
        self.plan = plan
        self.last_loss = plan.call
        self.last_outputs: torch.Tensor | None = None
        if plan.optimizer is not None and not capture:
            cls, defaults, groups = plan.optimizer
            params = dict(private.named_parameters())
            self.optimizer = cls([{**settings, "params": [params[n] for n in names]} for settings, names in groups],
                                 **defaults)

    # ------------------------------------------------------- what the user sees
    def sync_user(self) -> None:
        """The user's model shows the trajectory (its own edits are overwritten)."""
        changed = []
        with torch.no_grad():
            for n, p in self.user_params.items():
                if not _equal(p.detach(), self.shown[n].to(p.device, p.dtype)):
                    changed.append(n)  # not what the pass last showed: the user's code wrote it
                want = self.named[n].detach()
                if not _equal(p.detach(), want.to(p.device, p.dtype)):
                    p.copy_(want.to(p.device, p.dtype))
                self.shown[n] = want.clone()
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            self.note("changed", f"the train function changed {shown} outside the DP steps; the release "
                                 "is the DP steps' own trajectory (no_grad edits, hand-written updates and "
                                 "restored iterates do not reach it)")

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        if not torch.is_grad_enabled() or kwargs or not args or \
                not all(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
            return module(*args, **kwargs)
        inputs = tuple(a.detach() for a in args)
        shape, dtype, device = self._record_shape(module, inputs)
        fwd = _Forward(inputs, (), self.sampler.drawn,
                       torch.full((inputs[0].shape[0], *shape), float("nan"), dtype=dtype, device=device))
        return _pending(fwd.values, fwd, self)

    def loss(self, func, args: tuple, kwargs: dict) -> torch.Tensor:  # noqa: ANN001
        out = args[0] if args else kwargs["input"]
        draw = self.sampler.drawn
        if func is not self.plan.call.func:
            self.note("loss", "the train function's loss differs from the one it used on synthetic records; "
                              "the DP steps used that one")
        if draw in self.unstepped and self.ready_draw != draw:
            self._grads(draw)
        fwd = out._fwd
        if not fwd.filled:
            if self.ready_draw == draw and self.last_outputs is not None \
                    and tuple(self.last_outputs.shape) == tuple(fwd.values.shape):
                with torch.no_grad():
                    fwd.values.copy_(self.last_outputs.to(fwd.values.device))
                fwd.filled = True
            else:
                self.fill(fwd)
        try:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001
                value = func(*(a.as_subclass(torch.Tensor) if isinstance(a, PendingOutput) else a for a in args),
                             **kwargs)
        except Exception:  # noqa: BLE001 - the value is for the user's eyes only
            value = torch.tensor(float("nan"))
        return value.detach().requires_grad_(True)

    # ---------------------------------------------------------------- steps
    def _grads(self, draw: int) -> None:
        """Each record's gradient on batch ``draw``, with the plan's loss, on the pass's model."""
        call = self.plan.call
        sample, tensors = self.unstepped[draw]
        n = len(sample.records)
        inputs = tuple(s.of(tensors, n) for s in call.inputs)
        with torch.no_grad():
            fwd = self._pending(self.model, inputs, call.inputs, n, draw)._fwd
        self._gradients(fwd, call.target.of(tensors, n), call)
        self.last_outputs = fwd.values

    def _advance(self, upto: int) -> None:
        """The DP steps due: every drawn batch up to ``upto`` not yet stepped on, in order."""
        for d in sorted(x for x in self.unstepped if x <= upto):
            if self.ready_draw != d:
                self._grads(d)
            self._dp_step(d)
        self.sync_user()

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        ids = {id(p) for p in self.user_params.values() if p.requires_grad}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.inside or not self.owns(optimizer):
            return
        if self.user_optimizer is None:
            self.user_optimizer, self.first_settings = optimizer, _settings(optimizer)
        if self.steps_taken >= self.sampler.drawn and self.sampler.drawn:
            self.note("step", "optimizer.step() was called without a new batch (a second step per batch?); "
                              "the DP pass did not step there")
        self._advance(self.sampler.drawn)
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None  # the user's optimizer moves nothing

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.inside and self.owns(optimizer):
            self.sync_user()

    def finish(self, steps: int, epochs: int) -> None:
        before = self.steps_taken
        self._advance(self.sampler.drawn)
        while self.steps_taken < steps:
            self.loader._next_batch()  # noqa: SLF001
            self._advance(self.sampler.drawn)
        if self.user_optimizer is not None and any(
                not all(_same_setting(a.get(k), b.get(k)) for k in a.keys() | b.keys())
                for a, b in zip(_settings(self.user_optimizer), self.first_settings, strict=False)):
            self.note("settings", "the optimizer's settings changed during the DP pass (a scheduler?); the DP "
                                  "steps kept the ones the dry run found")
        if self.steps_taken > before:
            self.note("steps", f"the train function left DP steps untaken (a skipped batch, an early stop, or "
                               f"fewer passes over the loader than local-epochs = {epochs}); the DP pass took them, "
                               "on their own batches in order, with its loss and optimizer")
        self.sync_user()
        for text in self.set_aside.values():
            log(WARNING, "DP pass: %s", text)


class PrivateModule(nn.Module):
    """The user's model as their train function sees it inside :func:`private_training`.

    Its forward pass returns a lazy output (:class:`PendingOutput`); a torch loss
    function on it is computed record by record. Its parameters are the model's,
    named ``_module.<name>`` as Opacus names them; any other attribute (``net.fc3``,
    a method of the model) is the model's own."""

    def __init__(self, model: nn.Module, dp_pass: _DPPass) -> None:
        super().__init__()
        self._module = model
        object.__setattr__(self, "_dp_pass", dp_pass)

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever the model's attribute is
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":
                raise
            return getattr(self._module, name)

    @property
    def path(self) -> str:
        """``torch.func`` or ``micro-batch``: how the per-record gradients were computed."""
        return self._dp_pass.path

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self._dp_pass.forward(self._module, args, kwargs)


@dataclass
class PrivateRound:
    """What :func:`private_training` did: the steps taken, the release (the trainable
    parameters the last DP step left) and, with ``capture``, the clipped sum."""

    steps_planned: int
    steps_taken: int = 0
    steps_completed: int = 0  # of those, taken by the DP pass after the train function returned
    release: dict[str, torch.Tensor] = field(default_factory=dict)
    clipped_sum: list[torch.Tensor] | None = None


@contextmanager
def private_training(
    model: nn.Module,
    loader: DataLoader,
    *,
    unit_of_record: torch.Tensor,
    num_units: int,
    sample_rate: float,
    steps: int,
    noise_multiplier: float,
    clipping_norm: float,
    generator: torch.Generator,
    secure: bool = False,
    capture: bool = False,
    epochs: int = 1,
    train_fn: Callable[[nn.Module, DataLoader], object] | None = None,
    release_model: nn.Module | None = None,
    unit_encoder: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[nn.Module, PoissonLoader, PrivateRound]]:
    """Yield ``(private model, private loader, record)`` for the user's train function.

    The trainable parameters of ``model`` (``requires_grad``) are the ones made
    private; freeze the others before. Each pass over the private loader yields an
    ``epochs``-th of the ``steps`` (the run's ``local-epochs``). With ``capture``
    (central noise) no noise is added and no parameter moves: the clipped sum of the
    batches is kept in the record (use ``steps=1``).

    With ``train_fn`` (the drop-in client), the function the caller then runs in the
    block, the pass first runs it on synthetic records (:func:`_dry_run`; a rule it
    breaks raises :class:`UserLoopError` here, before any of the owner's data is
    read), then runs the DP steps on ``release_model`` (default: a copy of
    ``model``) with the dry run's loss and optimizer, paced by the train function
    in the block; its exceptions are set aside and the record always holds the
    release. Without it the block's train function is checked as it runs (a rule it
    breaks raises :class:`UserLoopError`, here or at its step).

    ``unit_encoder`` (distributed noise, with ``capture``): the captured sum is the
    encoder's integer sum of each batch's clipped per-unit rows instead."""
    if unit_encoder is not None and not capture:
        raise ValueError("unit_encoder needs capture=True")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserLoopError("no trainable parameter to train privately")
    # the noise has its own stream, seeded from the round's generator: the k-th step's noise
    # is the same whenever the train function draws the batches
    noise = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    sampler = PoissonBatches(unit_of_record, num_units, sample_rate, steps, generator, secure, epochs)
    private_loader = PoissonLoader(loader.dataset, sampler, loader.collate_fn)
    expected = max(sample_rate * num_units, 1e-12)
    mech = None if capture else GaussianSumMechanism(noise_multiplier, clipping_norm, expected, secure=secure)
    for p in model.parameters():
        p.grad = None
    if train_fn is not None:
        import copy

        plan = _dry_run(model, loader, train_fn, steps, epochs, capture)
        release = release_model if release_model is not None else copy.deepcopy(model)
        dp_pass: _DPPass = _ReleasePass(model, release, private_loader, clipping_norm, mech, noise, capture, plan)
    else:
        dp_pass = _DPPass(model, private_loader, clipping_norm, mech, noise, capture)
    dp_pass.encoder = unit_encoder
    record = PrivateRound(steps_planned=int(steps))
    private = PrivateModule(model, dp_pass)
    handles = [register_optimizer_step_pre_hook(dp_pass.before_step),
               register_optimizer_step_post_hook(dp_pass.after_step)]
    try:
        try:
            yield private, private_loader, record
        except Exception as err:  # noqa: BLE001 - after the dry run, nothing the user's code does is refused
            if train_fn is None:
                raise
            log(ERROR, "The train function raised in the DP pass: %s: %s", type(err).__name__, err)
            dp_pass.note("raised", f"the train function raised {type(err).__name__} in the DP pass (its message "
                                   "is above); the DP pass took the remaining steps")
        before = dp_pass.steps_taken
        dp_pass.finish(steps, epochs)
        if train_fn is not None:
            dp_pass.steps_completed = dp_pass.steps_taken - before
    finally:
        for h in handles:
            h.remove()
        dp_pass.close()
    record.steps_taken = dp_pass.steps_taken
    record.steps_completed = dp_pass.steps_completed
    record.release = {n: dp_pass.expected[f"p:{n}"] for n in dp_pass.trainable}
    record.clipped_sum = dp_pass.captured
    if sampler.empty_passes and not capture and not _WARNED["epochs"]:
        _WARNED["epochs"] = True
        log(WARNING, "the train function made %d passes over the private loader, but the owners' "
            "schedule has the DP steps of local-epochs = %d epoch(s), all taken by then: the later "
            "passes got no batch; set flwr-jdp's local-epochs = %d to train the shared layers as many "
            "epochs as your loop (it is charged accordingly)", sampler.passes, epochs, sampler.passes)


#: Each model kind's factored linear layers (:class:`~flwr_jdp.training.per_sample.FuncPerSample`).
_LINEAR: dict[tuple, set[str] | None] = {}
#: Each model kind's output shape per record, by its inputs' per-record shapes.
_SHAPES: dict[tuple, tuple] = {}
#: Warnings given once per process.
_WARNED = {"epochs": False}


__all__ = ["LOSSES", "PendingOutput", "PoissonBatches", "PoissonLoader", "PrivateModule", "PrivateRound",
           "UserLoopError", "private_training"]
