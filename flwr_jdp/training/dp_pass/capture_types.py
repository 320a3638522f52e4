"""The lazy output the private model returns, and the loss call the pass records:
what the capture of the user's loop (:mod:`.capture`) hands between its parts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .batches import _Source
from .common import _same_setting

if TYPE_CHECKING:
    from .capture import _DPPass


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
