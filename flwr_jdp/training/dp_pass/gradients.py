"""Per-record gradients, each computed on its record alone: one vectorised pass
(``vmap(grad(...))`` over ``functional_call``, :class:`~flwr_jdp.training.per_sample.FuncPerSample`)
where ``vmap`` can trace the model and keep its records apart, else micro-batches of one
record (:func:`~flwr_jdp.training.per_sample.record_by_record`): per record by
construction on every path, nothing sampled or checked."""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

import torch
from flwr.common import log
from torch import nn

from .. import per_sample
from .batches import _map_tensors, _tensors_of, _with_tensors
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
        of the collated batch (its tensors with ``n`` rows are split by record, the others
        and every non-tensor leaf kept as they are)."""
        self.restore("before a loss")
        for p in self.params:
            p.grad_sample = None
        device = next(iter(self.params)).device
        batch = _map_tensors(batch, lambda t: t.to(device))
        leaves = _tensors_of(batch)
        rows = [i for i, t in enumerate(leaves) if t.dim() > 0 and t.shape[0] == n]

        def one(values: tuple[torch.Tensor, ...]) -> object:
            parts = list(leaves)
            for i, v in zip(rows, values, strict=True):
                parts[i] = v
            return _with_tensors(batch, parts)

        if n == 0:
            for p in self.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            return
        kind = (per_sample.model_kind(self.model), "loss_fn", getattr(loss_fn, "__code__", type(loss_fn)))
        per_record = tuple(leaves[i] for i in rows)

        def vectorised() -> None:
            if self.loss_engine is None:
                self.loss_engine = per_sample.FuncPerSample(_LossOf(self.model, loss_fn), set_train=False)
            self.loss_engine.model.one = one
            self.loss_engine._per_record(per_record, torch.zeros(n), lambda out, _: out.sum(), n,  # noqa: SLF001
                                         randomness="different", trainable={f"model.{k}" for k in self.trainable})

        if self._vectorised(kind, vectorised):
            return

        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            loss = _scalar(loss_fn(self.model, one(tuple(t[i:i + 1] for t in per_record))))
            return loss, loss.detach()

        self._record_by_record(n, term, "loss_fn(model, batch)")

    def _per_record(self, fwd: _Forward, targets: torch.Tensor, loss_one) -> torch.Tensor:  # noqa: ANN001
        """Each record's gradient of its own term, on the record alone: one vectorised
        pass where ``vmap`` can trace the model and keep its records apart, else
        micro-batches of one record (its forward, loss term and backward alone)."""
        key = (self.kind, *(a.shape[1:] for a in fwd.inputs))

        def vectorised() -> None:
            if self.engine is None:
                self.engine = per_sample.FuncPerSample(self.model, set_train=False)
                self.engine.single_row_linear = _LINEAR.get(key)
            self.engine._per_record(fwd.inputs, targets, loss_one, len(targets),  # noqa: SLF001
                                    randomness="different", trainable=self.trainable)
            _LINEAR[key] = self.engine.single_row_linear

        if self._vectorised(per_sample.model_kind(self.model), vectorised):
            return self.engine.outputs
        return self._micro(fwd.inputs, targets, loss_one)

    def _vectorised(self, kind: tuple, run: Callable[[], None]) -> bool:
        """``run()``, the vectorised pass, unless ``BACKEND`` or an earlier failure on this
        kind says otherwise; where it fails, False (the kind remembered, one log line) and
        the caller computes the records one by one (``BACKEND = "func"``: refused)."""
        if per_sample.BACKEND not in ("auto", "func") or kind in per_sample.FUNC_FAILED:
            return False
        try:
            run()
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
            return False
        self.path = "torch.func"
        return True

    def _micro(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_one) -> torch.Tensor:  # noqa: ANN001
        """Micro-batches of one: record ``i``'s output and loss term from its own rows only."""
        def term(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.model(*(a[i:i + 1] for a in inputs))
            return loss_one(out, targets[i]), out.detach()[0]

        return self._record_by_record(len(targets), term, "the model")

    def _record_by_record(self, n: int, term, what: str) -> torch.Tensor:  # noqa: ANN001
        self.path = "micro-batch"
        try:
            return per_sample.record_by_record(self.model, {k: self.named[k] for k in self.trainable}, n, term)
        except (MemoryError, torch.OutOfMemoryError):
            raise
        except _NotScalar as err:
            self.refuse(str(err))
            raise
        except Exception as err:  # noqa: BLE001 - the user's model (and loss) on one record; its message may hold data
            self.refuse(f"{what} cannot compute a record's gradient on that record alone (a batch of one "
                        f"raised {type(err).__name__}): each record's gradient must come from its own forward pass")
            raise


#: Each model kind's factored linear layers (:class:`~flwr_jdp.training.per_sample.FuncPerSample`).
_LINEAR: dict[tuple, set[str] | None] = {}
