"""Capture of the user's loop: the private model's lazy forward pass, the interception
of the torch loss applied to its output, and the optimizer step hooks that pace the DP
steps (:class:`_DPPass`), with :class:`PrivateModule`, the model the train function sees."""

from __future__ import annotations

import inspect
from logging import WARNING

import torch
from flwr.common import log
from torch import nn

from ..model_state import state_kept
from .batches import BY_ROWS_HINT, _not_by_rows, _source
from .capture_types import PendingOutput, _Forward, _LossCall, _pending
from .common import UserLoopError, _same_setting, _settings, new_optimizer
from .gradients import _PerRecord
from .step import _DPStep

#: How a loop the interception cannot follow is written so that it is accepted.
LOSS_FN_HINT = ("; or pass loss_fn=... to JointDPClient.train (or private_training): your loss of a batch as "
                "the loader yields it, e.g. loss_fn=lambda net, batch: F.cross_entropy(net(batch[0]), batch[1]), "
                "lambda net, b: vae_loss(*net(b[0]), b[0]) or lambda net, b: net(**b).loss: any outputs, keyword "
                "inputs and hand-written or composite losses; it is evaluated on each record alone")


def _discarding_closure(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple | None:
    """``optimizer.step``'s arguments with its closure, if any, wrapped: the closure runs as
    the optimizer calls it (PyTorch Lightning's: its training step and backward), then its
    gradients are discarded, so the user's optimizer moves none of the parameters."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def discarded():  # noqa: ANN202 - whatever the closure returns (the loss)
        loss = closure()
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None
        return loss

    if "closure" in kwargs:
        return args, {**kwargs, "closure": discarded}
    return (args[0], discarded, *args[2:]), kwargs

#: Each model kind's output shape per record, by its inputs' per-record shapes.
_SHAPES: dict[tuple, tuple] = {}


class _DPPass(_PerRecord, _DPStep):
    """One DP pass: the trajectory the DP steps make (``expected``: every parameter and
    buffer of the model), the current batch's per-record gradients, the optimizer the
    DP steps use, and what the train function did that the pass set aside."""

    shapes = _SHAPES

    def foreign_gradient(self, grad: torch.Tensor) -> None:
        """Hook on the private output: a gradient reaching it did not come through a
        loss function the DP pass computed record by record."""
        self.foreign = True

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
        if not torch.is_grad_enabled() or not self.trainable:
            return module(*args, **kwargs)
        if kwargs:
            self.refuse(f"keyword arguments to the model's forward ({sorted(kwargs)}) are not supported "
                        "in the DP pass without loss_fn" + LOSS_FN_HINT)
        batch = self.sampler.tensors
        n = len(self.sampler.current.records) if self.sampler.current is not None else -1
        sources = tuple(_source(a, batch, n, rows_exact=True) if isinstance(a, torch.Tensor) else None
                        for a in args)
        if n < 0 or not args or any(s is None for s in sources):
            self.refuse("the model's input is not a tensor of the private loader's current batch (moving it to "
                        "a device, casting or reshaping it is fine): transform records in the data set (its "
                        "transform or collate_fn), or in loss_fn, not in the train function; mixing the records "
                        "of a batch (mixup) breaks per-record clipping" + self._layout(n) + LOSS_FN_HINT)
        return self._pending(module, tuple(a.detach() for a in args), sources, n)

    def _layout(self, n: int) -> str:
        """What to change where the current batch does not hold its ``n`` records along dim 0."""
        bad = _not_by_rows(self.sampler.tensors, n)
        return f"; the batch holds {bad[0]} for {n} records: {BY_ROWS_HINT}" if bad and n > 0 else ""

    def _pending(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], sources: tuple, n: int,
                 draw: int | None = None) -> PendingOutput:
        draw = self.sampler.drawn if draw is None else draw
        if n == 0:
            with torch.no_grad(), state_kept(module):
                values = module(*inputs)
            fwd = _Forward(inputs, sources, draw, values, filled=True)
        else:
            shape, dtype, device = self._record_shape(module, inputs)
            fwd = _Forward(inputs, sources, draw, torch.full((n, *shape), float("nan"), dtype=dtype, device=device))
        return _pending(fwd.values, fwd, self)

    def _record_shape(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple:
        key = (self.kind, *((tuple(a.shape[1:]), a.dtype, a.device) for a in inputs))
        if key not in self.shapes:
            with torch.no_grad(), state_kept(module):  # record 0's forward leaves nothing on the model
                one = module(*(a[:1] for a in inputs))
            if not isinstance(one, torch.Tensor) or one.dim() == 0 or one.shape[0] != 1:
                self.refuse("without loss_fn the model's output must be one tensor with a row per record (a tuple, "
                            "dict or ModelOutput is not)" + LOSS_FN_HINT)
            self.shapes[key] = (tuple(one.shape[1:]), one.dtype, one.device)
        return self.shapes[key]

    def fill(self, fwd: _Forward) -> None:
        """The output's values, for a use other than a loss function (one plain forward)."""
        if fwd.filled:
            return
        with torch.no_grad(), state_kept(self.shown_model):
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
            self.refuse("without loss_fn, one torch loss per batch, on the model's output for the current batch "
                        "of the private loader (a loss of several terms is not)" + LOSS_FN_HINT)
        target_source = _source(target, self.sampler.tensors, n, rows_exact=False) \
            if isinstance(target, torch.Tensor) else None
        if target_source is None:
            self.refuse("the loss's target is not a tensor of the private loader's current batch (moving it to "
                        "a device, casting or reshaping it is fine): transform records in the data set, not "
                        "in the train function" + self._layout(n) + LOSS_FN_HINT)
        if out.shape[0] != target.shape[0]:
            self.refuse("the loss's input and target have different numbers of rows")
        for name, value in params.items():
            if isinstance(value, torch.Tensor) and value.dim() >= out.dim():
                self.refuse(f"the loss's '{name}' has a value per record: weights must be per class" + LOSS_FN_HINT)
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
        sample, tensors, _, _ = self.unstepped[draw]
        n = len(sample.records)
        if not all(s.fits(tensors, n) for s in (*call.inputs, call.target)):
            self.refuse(f"a batch of the private loader does not hold its {n} records along dim 0 as the "
                        f"others do: {BY_ROWS_HINT}")
        inputs = tuple(s.of(tensors, n) for s in call.inputs)
        with torch.no_grad():
            fwd = self._pending(self.model, inputs, call.inputs, n, draw)._fwd
        self._gradients(fwd, call.target.of(tensors, n), call)
        self._dp_step(draw)

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
            self.refuse("without loss_fn, optimizer.step(closure) is not supported (it re-evaluates the loss "
                        "inside the step): call step() without a closure" + LOSS_FN_HINT)
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
                        "loss function (reshaping it is fine)" + LOSS_FN_HINT)
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
            return new_optimizer(type(optimizer), groups, optimizer.defaults)
        except Exception as err:  # noqa: BLE001 - a custom optimizer's constructor
            self.refuse(f"the DP pass could not make its copy of the optimizer ({type(optimizer).__name__}: "
                        f"{type(err).__name__}): use a torch.optim optimizer")
            raise

    def after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if not self.inside and self.owns(optimizer):
            self.restore("in the user's optimizer step")

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
