"""Per-record gradients, each computed on its record alone: one vectorised pass
(``vmap(grad(...))`` over ``functional_call``, :class:`~flwr_jdp.training.per_sample.FuncPerSample`)
where ``vmap`` can trace the model and keep its records apart, else micro-batches of one
record (:func:`~flwr_jdp.training.per_sample.record_by_record`): per record by
construction on every path, nothing sampled or checked.

On the owner's data (after the dry run checked the code on synthetic records) nothing a
record does is refused: a record whose loss or gradient raises (a label outside the
model's classes, a corrupt value), or whose loss or gradient is not finite, gets a zero
gradient (its contribution, zero, is within the clipping bound: the sensitivity is
unchanged), noted once in the node's log and never in the reply; a vectorised pass that
raises on a batch falls back to micro-batches of one for that batch. Only the dry run's
own checks, and a pass without a dry run (``strict``), refuse."""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

import torch
from flwr.common import log
from torch import nn

from .. import per_sample
from ..dp_sgd import _keep_rows
from .batches import _map_tensors, _not_by_rows, _tensors_of, _with_tensors
from .capture_types import _Forward, _LossCall

#: ``loss_fn(model, batch) -> scalar tensor``: the loss of ``batch`` (as the user's loader
#: yields it) under ``model``, as the user's loop computes it.
LossFn = Callable[[nn.Module, object], torch.Tensor]


class _LossOf(nn.Module):
    """``loss_fn(model, batch)`` as a module of a batch's per-record tensors (what
    ``functional_call`` and ``vmap`` take): ``one(rows)`` builds the batch of one record
    from its rows; the output is the record's loss (one row)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.one: Callable[[tuple[torch.Tensor, ...]], object] = lambda rows: rows

    def forward(self, *rows: torch.Tensor) -> torch.Tensor:
        return _scalar(self.loss_fn(self.model, self.one(rows))).reshape(1)


class _NotScalar(TypeError):
    """``loss_fn`` returned something other than a scalar tensor (the message names its type and shape only)."""


def _scalar(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise _NotScalar(f"loss_fn(model, batch) must return the batch's loss as a scalar tensor (it returned a "
                         f"{type(loss).__name__}{shape}): reduce it with .mean() or .sum()")
    return loss.reshape(())


class _PerRecord:
    """The per-record gradients of a batch (``grad_sample`` of each trainable parameter);
    a mixin of :class:`~flwr_jdp.training.dp_pass.capture._DPPass`."""

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

    def _loss_fn_gradients(self, batch: object, n: int, loss_fn: LossFn) -> None:
        """Each record's gradient of ``loss_fn(model, the batch of that record alone)``
        (``grad_sample``), at the trajectory's parameters; ``batch``: the pass's own copy
        of the collated batch, every leaf a tensor with the ``n`` records along dim 0
        (:func:`~.batches._not_by_rows`: the dry run refuses a collate that makes anything
        else, the release pass computes such a batch with :meth:`_collated_alone`), split
        by record."""
        self.restore("before a loss")
        for p in self.params:
            p.grad_sample = None
        if _not_by_rows(batch, n):
            raise AssertionError("a batch whose records are not along dim 0 cannot be split by record")
        device = next(iter(self.params)).device
        batch = _map_tensors(batch, lambda t: t.to(device))
        per_record = tuple(_tensors_of(batch))

        def one(values: tuple[torch.Tensor, ...]) -> object:
            return _with_tensors(batch, list(values))

        if n == 0:
            for p in self.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            return
        kind = (per_sample.model_kind(self.model), "loss_fn", getattr(loss_fn, "__code__", type(loss_fn)))

        def vectorised() -> torch.Tensor:
            if self.loss_engine is None:
                self.loss_engine = per_sample.FuncPerSample(_LossOf(self.model, loss_fn), set_train=False)
            self.loss_engine.model.one = one
            return self.loss_engine._per_record(  # noqa: SLF001
                per_record, torch.zeros(n), lambda out, _: out.sum(), n, randomness="different",
                trainable={f"model.{k}" for k in self.trainable})

        if self._vectorised(kind, vectorised):
            return

        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            loss = _scalar(loss_fn(self.model, one(tuple(t[i:i + 1] for t in per_record))))
            return loss, loss.detach()

        self._record_by_record(n, term, "loss_fn(model, batch)", torch.tensor(float("nan")))

    def _collated_alone(self, items: list, loss_of: Callable[[object], torch.Tensor]) -> None:
        """Each record's gradient of ``loss_of(its batch)``, its batch collated from that
        record alone (its item, as the data set gave it for the batch, through the user's
        ``collate_fn``): for a batch of the owner's whose rows are not each record's own
        batch, which the release pass cannot split by rows. Nothing in a record's batch
        comes from another record, whatever ``collate_fn`` does with the layout; a record
        whose batch or loss fails gets a zero gradient."""
        self.restore("before a loss")
        for p in self.params:
            p.grad_sample = None
        device = next(iter(self.params)).device
        collate = self.loader.user_collate

        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            batch = _map_tensors(collate([items[i]]), lambda t: t.to(device))
            loss = _scalar(loss_of(batch))
            return loss, loss.detach()

        self._record_by_record(len(items), term, "a record's batch", torch.tensor(float("nan")))

    def _per_record(self, fwd: _Forward, targets: torch.Tensor, loss_one) -> torch.Tensor:  # noqa: ANN001
        """Each record's gradient of its own term, on the record alone: one vectorised
        pass where ``vmap`` can trace the model and keep its records apart, else
        micro-batches of one record (its forward, loss term and backward alone)."""
        key = (self.kind, *(a.shape[1:] for a in fwd.inputs))

        def vectorised() -> torch.Tensor:
            if self.engine is None:
                self.engine = per_sample.FuncPerSample(self.model, set_train=False)
                self.engine.single_row_linear = _LINEAR.get(key)
            losses = self.engine._per_record(fwd.inputs, targets, loss_one, len(targets),  # noqa: SLF001
                                             randomness="different", trainable=self.trainable)
            _LINEAR[key] = self.engine.single_row_linear
            return losses

        if self._vectorised(per_sample.model_kind(self.model), vectorised):
            return self.engine.outputs
        return self._micro(fwd.inputs, targets, loss_one, fwd.values.shape[1:])

    def _vectorised(self, kind: tuple, run: Callable[[], torch.Tensor]) -> bool:
        """``run()``, the vectorised pass (it returns each record's loss: a record whose loss
        is not finite gets a zero gradient), unless ``BACKEND`` or an earlier failure on this
        kind says otherwise; where it fails, False and the caller computes the records one by
        one. A kind that never worked is remembered (one log line: the model is one ``vmap``
        cannot trace); on a kind that worked before, the failure comes from the batch and
        only that batch is computed one by one. ``BACKEND = "func"``: refused on the dry
        run's checks (``strict``), never on the owner's data."""
        if per_sample.BACKEND not in ("auto", "func") or kind in per_sample.FUNC_FAILED:
            return False
        try:
            losses = run()
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # noqa: BLE001 - vmap's errors have no common type
            if per_sample.BACKEND == "func" and self.strict:
                self.refuse(f"per-sample gradients by torch.func failed: {type(err).__name__}")
            reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            if kind in _FUNC_WORKED:
                self.note("batch-micro", f"the vectorised per-record gradients raised on a batch ({reason}); that "
                                         "batch's records were computed one by one")
            else:
                per_sample.FUNC_FAILED[kind] = reason
                log(WARNING, "per-sample gradients of %s: torch.func cannot handle the model (%s); computing "
                    "each record's gradient on its own (micro-batches of one record: as private, 2-5x slower; nothing "
                    "to change in your code, see docs/dropin.md)", type(self.model).__qualname__, reason)
            for p in self.params:
                p.grad_sample = None
            return False
        _FUNC_WORKED.add(kind)
        self.path = "torch.func"
        finite = torch.isfinite(losses.detach().reshape(len(losses), -1)).all(1)
        if not bool(finite.all()):
            self._zeroed("its loss is not finite")
            for p in self.params:
                p.grad_sample = _keep_rows(p.grad_sample, finite.to(p.device))
        return True

    def _micro(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_one,  # noqa: ANN001
               row: tuple[int, ...]) -> torch.Tensor:
        """Micro-batches of one: record ``i``'s output and loss term from its own rows only
        (``row``: the shape of one record's output)."""
        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(*(a[i:i + 1] for a in inputs))
            return loss_one(out, targets[i]), out.detach()[0]

        return self._record_by_record(len(targets), term, "the model", torch.full(tuple(row), float("nan")))

    def _record_by_record(self, n: int, term, what: str, blank: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """:func:`~flwr_jdp.training.per_sample.record_by_record`; after the dry run (not
        ``strict``) a record whose ``term`` raises (``blank``: its output) or whose loss is
        not finite gets a zero gradient; the dry run's checks refuse."""
        self.path = "micro-batch"

        def finite_term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            loss, out = term(i)
            if not bool(torch.isfinite(loss.detach()).all()):
                self._zeroed("its loss is not finite")
                return loss.detach(), out  # no gradient: a zero row
            return loss, out

        def failed(i: int, err: Exception) -> torch.Tensor:
            self._zeroed(f"{what} raised {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}")
            return blank

        params = {k: self.named[k] for k in self.trainable}
        if not self.strict:
            return per_sample.record_by_record(self.model, params, n, finite_term, failed)
        try:
            return per_sample.record_by_record(self.model, params, n, term)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except _NotScalar as err:
            self.refuse(str(err))
            raise
        except Exception as err:  # noqa: BLE001 - the user's model (and loss) on one record; its message may hold data
            self.refuse(f"{what} cannot compute a record's gradient on that record alone (a batch of one "
                        f"raised {type(err).__name__}): each record's gradient must come from its own forward pass")
            raise

    def _zeroed(self, why: str) -> None:
        self.note("record-zeroed", f"a record's gradient was set to zero ({why}; its message stays on this "
                                   "node): a zero contribution is within the clipping bound, so the sensitivity "
                                   "is unchanged and the round goes on")


#: Each model kind's factored linear layers (:class:`~flwr_jdp.training.per_sample.FuncPerSample`).
_LINEAR: dict[tuple, set[str] | None] = {}
#: Model kinds the vectorised pass has worked on (a later failure comes from a batch).
_FUNC_WORKED: set[tuple] = set()
