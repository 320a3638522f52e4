"""Per-record gradients, each computed on its record alone: one vectorised pass
(``vmap(grad(...))`` over ``functional_call``, :class:`~flwr_jdp.training.per_sample.FuncPerSample`)
where ``vmap`` can trace the model and keep its records apart, else micro-batches of one
record (:func:`~flwr_jdp.training.per_sample.record_by_record`): per record by
construction on every path, nothing sampled or checked."""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.common import log

from .. import per_sample
from .capture_types import _Forward, _LossCall


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


#: Each model kind's factored linear layers (:class:`~flwr_jdp.training.per_sample.FuncPerSample`).
_LINEAR: dict[tuple, set[str] | None] = {}
