"""The release pass: the DP steps on the owner's data, on the pass's own model and
batch copies with the dry run's plan, paced by the user's train function."""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.common import log
from torch import nn

from ...privacy.mechanisms import GaussianSumMechanism
from .batches import PoissonLoader, _rows_are_records, _tensors_of
from .capture import _discarding_closure, _DPPass
from .capture_types import PendingOutput, _Forward, _pending
from .common import _equal, _same_setting, _settings, new_optimizer
from .plan import Plan


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
                 plan: Plan) -> None:
        private.to(plan.device)
        for name, m in private.named_modules():
            m.training = plan.modes.get(name, m.training)
        super().__init__(private, loader, clipping_norm, mechanism, generator, capture)
        self.strict = False  # after the dry run nothing a record does is refused (its gradient is zero)
        self.user_model = self.shown_model = user_model
        self.user_params = {n: p for n, p in user_model.named_parameters()}
        self.shown = {n: p.detach().clone() for n, p in self.user_params.items()}  # what the user's model showed
        self.plan = plan
        self.last_loss = plan.call
        self.last_outputs: torch.Tensor | None = None
        if plan.optimizer is not None and not capture:
            cls, defaults, groups = plan.optimizer
            params = dict(private.named_parameters())
            self.optimizer = new_optimizer(
                cls, [{**settings, "params": [params[n] for n in names]} for settings, names in groups], defaults)

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
        """Each record's gradient on batch ``draw``, with the plan's loss, on the pass's model.

        The batch is split by rows only where each record's rows are exactly its batch of
        one (:func:`~.batches._rows_are_records`: the tensors ``loss_fn`` gets, else the
        model's input and the loss's target). Elsewhere each record's gradient comes from
        a batch collated from that record alone (:meth:`_collated_alone`): never refused,
        never mixed. That happens for a layout the dry run could not see: it collated
        synthetic records at two batch sizes that no dimension of a record equals and
        refused a batch without the records along dim 0 (time first, a constant in the
        batch), whatever the data, so only a ``collate_fn`` whose layout depends on the
        data, or one whose rows depend on the other records (padding to the batch's
        longest record), reaches this fallback. Zeroing such a batch instead would not do:
        whether a batch is zeroed could then depend on one record, and its whole sum with it."""
        call = self.plan.call
        sample, tensors, batch, items = self.unstepped[draw]
        n = len(sample.records)
        loss_fn = self.plan.loss_fn
        leaves = None if loss_fn is not None else sorted({s.index for s in (*call.inputs, call.target)})
        if not _rows_are_records(batch, items, self.loader.user_collate, leaves) or \
                (loss_fn is None and not all(s.fits(tensors, n) for s in (*call.inputs, call.target))):
            self.note("layout", "a batch's rows were not each record's own batch (a collate_fn whose layout "
                                "depends on the data, or padding to the batch's longest record?); its records' "
                                "gradients were computed each on a batch of that record alone")
            self._collated_alone(items, lambda b: loss_fn(self.model, b) if loss_fn is not None
                                 else self._planned_loss(b))
            self.last_outputs = None
            self.ready_draw = draw
            return
        if loss_fn is not None:
            self._loss_fn_gradients(batch, n, loss_fn)
            self.ready_draw = draw
            return
        inputs = tuple(s.of(tensors, n) for s in call.inputs)
        with torch.no_grad():
            fwd = self._pending(self.model, inputs, call.inputs, n, draw)._fwd
        self._gradients(fwd, call.target.of(tensors, n), call)
        self.last_outputs = fwd.values

    def _planned_loss(self, batch: object) -> torch.Tensor:
        """The plan's torch loss on a batch of one record (its model input and target)."""
        call = self.plan.call
        tensors = _tensors_of(batch)
        if not all(s.fits(tensors, 1) for s in (*call.inputs, call.target)):
            raise ValueError("a record's batch does not have the plan's layout")
        out = self.model(*(s.of(tensors, 1) for s in call.inputs))
        return call.one()(out, call.target.of(tensors, 1))

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

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
        """The DP steps due (with ``loss_fn``: one step, on the oldest batch not yet stepped
        on: a loop that fetches a batch ahead, as PyTorch Lightning does, still takes draw k
        at its step k); the user's optimizer moves nothing (its gradients, and those of a
        closure it runs, are discarded)."""
        if self.inside or not self.owns(optimizer):
            return None
        if self.user_optimizer is None:
            self.user_optimizer, self.first_settings = optimizer, _settings(optimizer)
        if self.steps_taken >= self.sampler.drawn and self.sampler.drawn:
            self.note("step", "optimizer.step() was called without a new batch (a second step per batch?); "
                              "the DP pass did not step there")
        if self.plan.loss_fn is None:
            self._advance(self.sampler.drawn)
        elif self.unstepped:
            self._advance(min(self.unstepped))
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None  # the user's optimizer moves nothing
        return _discarding_closure(optimizer, args, kwargs)

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
