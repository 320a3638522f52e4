"""Per-sample gradients from whole-model ``torch.func``, at nearly a plain step's cost.

``vmap(grad(loss of one record))`` over :func:`torch.func.functional_call`: one
vectorised pass computes every record's gradient of the parameters that require
one (the shared parameters; the personal ones too where the interleaved coupling
trains them on the same batch), with the frozen parameters and the buffers passed
as constants. The result is stored where Opacus's hooks store theirs
(``p.grad_sample``; ``p.grad``, the batch sum, for the parameters named
``summed``), so :func:`~flwr_jdp.training.dp_sgd.clipped_unit_sum` clips, weights
and sums them exactly as it does Opacus's: the two paths differ only in how the
per-sample gradients are computed, never in what is released or recorded. The
batch is vectorised in chunks of at most :data:`CHUNK` records, which bounds the
transform's working memory (activations, backward buffers, per-sample gradients).

Two rules make the pass cost about what a plain forward and backward cost, inside
the transform only (a thread-local :class:`~torch.overrides.TorchFunctionMode`):

- Linear layers applied once to one row per record (a classifier's dense layers)
  keep their weight's per-sample gradients factored (:class:`OuterProducts`:
  output gradient and input, ``n x (out + in)`` numbers instead of
  ``n x out x in``). Their norms and clipped sums are exact and cost one matrix
  product; materialising them cost more than the plain step on the quickstart CNN.
- GroupNorm (the models' ``norm="group"``) normalises each record on its own, so
  it is per-sample; but vmap's rule for its backward decomposes the fused kernel
  into about ten element-wise passes (the seed CNN's step took ~1.5x a plain
  step). :class:`_GroupNorm` calls the fused kernels once per chunk instead and
  reads the per-record weight and bias gradients off the same kernel (from batch
  size :data:`GROUP_NORM_RULE_FROM`; below it vmap's rule is cheaper).

Models the transform cannot handle (BatchNorm, which mixes the records of a batch;
data-dependent control flow; in-place updates of buffers; ``.item()`` in
``forward``) make the pass raise, and so does a model whose records the transform
could not keep apart: an ``autograd.Function`` with its own ``vmap`` rule, or an
operator from outside ``aten``/``prims`` (its batching rule may mix the records);
:mod:`~flwr_jdp.training.dp_sgd` then falls back to Opacus's hooks for that model
class (one log line).

The drop-in client's DP pass (:mod:`~flwr_jdp.training.dp_pass`, the user's own
loop) uses the same pass with the user's loss applied to each record alone, and
keeps each record's output (:attr:`FuncPerSample.outputs`) for the user's code;
where the transform raises, it computes each record's gradient on the record alone
(:func:`record_by_record`: micro-batches of one), never from a batch's hooks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._functorch.autograd_function import custom_function_call
from torch.func import functional_call, grad, vmap
from torch.overrides import TorchFunctionMode

from .model_state import ModelState

#: ``auto``: torch.func, with a fallback for the model classes it fails on (flwr-jdp's
#: own trainer: Opacus's hooks; the drop-in DP pass: micro-batches of one record);
#: ``func``: torch.func only (a failure raises); ``opacus``: Opacus's hooks only in
#: flwr-jdp's own trainer, micro-batches of one in the drop-in DP pass (it has no
#: Opacus path); ``micro``: micro-batches of one in the drop-in DP pass.
BACKEND = os.environ.get("FLWR_JDP_PER_SAMPLE", "auto")
#: Records per vectorised call (bounds the transform's working memory).
CHUNK = 256
#: Batch size from which GroupNorm uses :class:`_GroupNorm` (its vmap rules cost a
#: fixed ~1 ms per layer and step; below this size vmap's own rule is faster).
GROUP_NORM_RULE_FROM = 32


class FuncUnsupported(RuntimeError):
    """The model has a layer whose per-sample gradient ``vmap`` would get wrong."""


class FuncPerSample:
    """Per-sample gradients of ``model``'s trainable parameters by ``torch.func``.

    The parameters differentiated are those with ``requires_grad`` at each call
    (as for Opacus's hooks: :func:`~flwr_jdp.training.dp_sgd._frozen` takes the
    personal ones out); the others and the buffers are constants. ``summed``:
    names of the parameters whose batch-summed gradient is also wanted in ``.grad``.
    """

    name = "torch.func"

    def __init__(self, model: nn.Module, summed: tuple[str, ...] = (), *, set_train: bool = True) -> None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):  # noqa: SLF001
                raise FuncUnsupported(f"{type(module).__name__} mixes the records of a batch")
        self.model = model
        self.group_norm = any(isinstance(m, nn.GroupNorm) for m in model.modules())
        self.summed = set(summed)
        self.params = dict(model.named_parameters())
        self.single_row_linear: set[str] | None = None  # found on the first batch
        self.outputs: torch.Tensor | None = None  # each record's output of the last pass
        if set_train:
            model.train()

    def backward(self, xb: torch.Tensor, yb: torch.Tensor) -> float:
        """Per-sample gradients of the summed loss over the batch ``(xb, yb)`` into
        ``p.grad_sample``; returns the mean loss (nan for an empty batch)."""
        self.clear()
        n = len(yb)
        if n == 0:
            return float("nan")

        def cross_entropy(out: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, yi.unsqueeze(0), reduction="sum")

        losses = self._per_record((xb,), yb, cross_entropy, n, randomness="different")
        return float(losses.sum()) / n

    def _per_record(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_one,  # noqa: ANN001
                    n: int, randomness: str, trainable: set[str] | None = None) -> torch.Tensor:
        """``vmap`` over the records of ``grad(loss_one(f(x_i), targets[i]))``: sets
        ``grad_sample`` of every trainable parameter (``trainable``: these names;
        default: those with ``requires_grad``); returns the per-record losses and
        keeps each record's output, computed alone, in :attr:`outputs`. The model's
        buffers and state attributes (:class:`~flwr_jdp.training.model_state.ModelState`)
        are put back before each chunk and after the pass: a forward that updates them
        carries no record into another chunk or a later batch."""
        state = ModelState(self.model)  # put back for each chunk and after the pass
        try:
            return self._vectorised(inputs, targets, loss_one, n, randomness, trainable, state)
        finally:
            state.restore()

    def _vectorised(self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_one,  # noqa: ANN001
                    n: int, randomness: str, trainable: set[str] | None, state: ModelState) -> torch.Tensor:
        if self.single_row_linear is None:
            self.single_row_linear = _single_row_linear_weights(self.model, self.params,
                                                                tuple(x[:1] for x in inputs))
            state.restore()
        if trainable is None:
            trainable = {k for k, p in self.params.items() if p.requires_grad}
        factored = {k for k in self.single_row_linear if k in trainable and k not in self.summed}
        wrt = {k: p.detach() for k, p in self.params.items() if k in trainable and k not in factored}
        const = {k: p.detach() for k, p in self.params.items() if k not in wrt}
        const.update((k, b.detach()) for k, b in self.model.named_buffers())
        probes = {k: torch.zeros(1, self.params[k].shape[0], dtype=self.params[k].dtype,
                                 device=self.params[k].device) for k in factored}
        mode = _Transform(self.group_norm and n >= GROUP_NORM_RULE_FROM, {id(const[k]): k for k in factored})
        model = self.model

        def loss_of_one(w: dict[str, torch.Tensor], zero: dict[str, torch.Tensor], target: torch.Tensor,
                        *xs: torch.Tensor):
            state.restore(compare=False)  # each chunk from the state the batch began with
            mode.zero, mode.inputs = zero, {}
            out = functional_call(model, {**const, **w}, tuple(x.unsqueeze(0) for x in xs))
            loss = loss_one(out, target)
            return loss, (loss.detach(), mode.inputs, out.detach()[0])

        in_dims = (None, None, 0, *(0,) * len(inputs))
        per_record = vmap(grad(loss_of_one, argnums=(0, 1), has_aux=True), in_dims=in_dims,
                          randomness=randomness, chunk_size=CHUNK if n > CHUNK else None)
        with mode:
            (grads, out_grads), (losses, used, outputs) = per_record(wrt, probes, targets, *inputs)
        self.outputs = outputs
        for k, g in grads.items():
            p = self.params[k]
            p.grad_sample = g
            if k in self.summed:
                p.grad = g.sum(0)
        for k in factored:
            self.params[k].grad_sample = OuterProducts(out_grads[k].reshape(n, -1), used[k].reshape(n, -1))
        return losses

    def clear(self) -> None:
        for p in self.params.values():
            p.grad_sample = None
            p.grad = None

    def close(self) -> None:
        """Remove the per-sample gradients (the model is left as it came)."""
        for p in self.params.values():
            if hasattr(p, "grad_sample"):
                del p.grad_sample
            p.grad = None


# ------------------------------------------------ linear layers: factored gradients
@dataclass(frozen=True)
class OuterProducts:
    """Per-sample gradients ``out_grads[i] (x) inputs[i]`` of a linear layer's weight,
    kept factored: ``(n, out)`` and ``(n, in)`` instead of ``(n, out, in)``.

    A linear layer applied once to one row per record has the per-record weight
    gradient ``g_i a_i^T`` (``g_i``: gradient of the loss in the layer's output,
    ``a_i``: its input), whose norm is ``|g_i| |a_i|`` and whose weighted sum over
    records is one matrix product ``(w * G)^T A``: what the clipped sum needs,
    without writing (or reading back) ``n x out x in`` numbers.
    """

    out_grads: torch.Tensor
    inputs: torch.Tensor

    def __len__(self) -> int:
        return self.out_grads.shape[0]

    def row_norms(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.out_grads, dim=1) * torch.linalg.vector_norm(self.inputs, dim=1)

    def finite_rows(self) -> torch.Tensor:
        return torch.isfinite(self.out_grads).all(1) & torch.isfinite(self.inputs).all(1)

    def keep_rows(self, keep: torch.Tensor) -> OuterProducts:
        zero = torch.zeros((), dtype=self.out_grads.dtype)
        return OuterProducts(torch.where(keep[:, None], self.out_grads, zero),
                             torch.where(keep[:, None], self.inputs, zero))

    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        return (self.out_grads * weights[:, None].to(self.out_grads.dtype)).T @ self.inputs

    def materialize(self) -> torch.Tensor:
        return self.out_grads[:, :, None] * self.inputs[:, None, :]


class _Uses(TorchFunctionMode):
    """Counts every use of each parameter by a torch function (its argument), and
    notes the uses that are ``F.linear``'s weight applied to one input row."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names: dict[int, str] = names
        self.uses: dict[str, int] = {}
        self.single_row_linear: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, list | tuple) else (a,):
                name = self.names.get(id(t))
                if name is not None:
                    self.uses[name] = self.uses.get(name, 0) + 1
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            name = self.names.get(id(weight))
            if name is not None and x.dim() == 2 and x.shape[0] == 1:
                self.single_row_linear[name] = self.single_row_linear.get(name, 0) + 1
        return func(*args, **kwargs)


def _single_row_linear_weights(model: nn.Module, params: dict[str, nn.Parameter],
                               one: tuple[torch.Tensor, ...]) -> set[str]:
    """Weights used once per forward, as ``F.linear``'s weight on one row (a record's
    feature vector), and nowhere else: their per-record gradients can be factored.
    Found by one forward pass of one record, without gradients; checked again in
    every transformed pass (:class:`_Transform`)."""
    uses = _Uses({id(p): k for k, p in params.items()})
    with torch.no_grad(), uses:
        model(*one)
    return {k for k, c in uses.single_row_linear.items() if c == 1 and uses.uses.get(k) == 1 and params[k].dim() == 2}


class _Transform(TorchFunctionMode):
    """Within the transform (this thread only): ``F.group_norm`` is :class:`_GroupNorm`;
    ``F.linear`` with a factored weight (``factored``: ``id`` of the constant passed
    for it -> its name) adds the zero probe ``zero[name]`` to its output, so that the
    gradient in the probe is the layer's output gradient, and records its input."""

    def __init__(self, group_norm: bool, factored: dict[int, str]) -> None:
        super().__init__()
        self.group_norm, self.factored = group_norm, factored
        self.zero: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        _check_batching_rule(func, args)
        if func is F.group_norm and self.group_norm:
            return _group_norm(*args, **kwargs)
        if func is F.linear and self.factored:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            name = self.factored.get(id(weight))
            if name is not None:
                if name in self.inputs or x.dim() != 2 or x.shape[0] != 1:
                    raise FuncUnsupported(f"{name} is not applied once to one row per record")
                self.inputs[name] = x.detach()
                return func(*args, **kwargs) + self.zero[name]
        return func(*args, **kwargs)


def _check_batching_rule(func, args: tuple) -> None:  # noqa: ANN001
    """Raise :class:`FuncUnsupported` for a call whose batching rule is not torch's own
    elementwise-over-records one: an ``autograd.Function`` with a hand-written ``vmap``
    (it gets the whole chunk and may mix its records; ``generate_vmap_rule`` is safe),
    or an operator from outside ``aten``/``prims`` (its registered rule may mix them)."""
    if func is custom_function_call:
        cls = args[0]
        if getattr(cls, "vmap", None) is not torch.autograd.Function.vmap and \
                not getattr(cls, "generate_vmap_rule", False) and cls not in _OWN_RULES:
            raise FuncUnsupported(f"{cls.__qualname__} has its own vmap rule")
    elif isinstance(func, torch._ops.OpOverload | torch._ops.OpOverloadPacket):  # noqa: SLF001
        namespace = getattr(func, "namespace", None) or str(func).split(".")[0]
        if namespace not in ("aten", "prims"):
            raise FuncUnsupported(f"operator {func} is not torch's own")


# ------------------------------------------------------------ GroupNorm under vmap


def _group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    return _GroupNorm.apply(x, num_groups, weight, bias, eps)[0]


def _gn_forward(x, groups, weight, bias, eps):  # noqa: ANN001, ANN202
    n, c = x.shape[0], x.shape[1]
    return torch.ops.aten.native_group_norm(x, weight, bias, n, c, x[0, 0].numel(), groups, eps)


def _gn_backward_rows(gy, x, mean, rstd, weight, groups):  # noqa: ANN001, ANN202
    """Input gradient, and each row's (record's) weight and bias gradients ``(N, C)``.

    The N rows are seen as one row of N x C channels in N x G groups (a group's
    channels are contiguous, so its statistics are the same), with the weight
    repeated N times: the fused kernel's weight and bias gradients, summed over
    that single row, are then the per-row ones."""
    n, c = x.shape[0], x.shape[1]
    hxw = x[0, 0].numel()
    mask = [True, weight is not None, weight is not None]
    dx, dw, db = torch.ops.aten.native_group_norm_backward(
        gy.reshape(1, n * c, hxw), x.reshape(1, n * c, hxw), mean.reshape(1, n * groups),
        rstd.reshape(1, n * groups), None if weight is None else weight.repeat(n), 1, n * c, hxw, n * groups, mask)
    dx = dx.reshape(x.shape)
    if weight is None:
        return dx, None, None
    return dx, dw.reshape(n, c), db.reshape(n, c)


def _to_front(t: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


class _GroupNormBackward(torch.autograd.Function):
    """GroupNorm's backward; under vmap, one fused kernel call for the whole chunk."""

    @staticmethod
    def forward(gy, x, mean, rstd, weight, groups):  # noqa: ANN001, ANN205
        dx, dw, db = _gn_backward_rows(gy, x, mean, rstd, weight, groups)
        return (dx, None, None) if dw is None else (dx, dw.sum(0), db.sum(0))

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        pass

    @staticmethod
    def vmap(info, in_dims, gy, x, mean, rstd, weight, groups):  # noqa: ANN001, ANN205
        if in_dims[4] is not None:
            raise FuncUnsupported("per-record GroupNorm weights")
        size = info.batch_size
        gy, x, mean, rstd = (_to_front(t, d, size) for t, d in zip((gy, x, mean, rstd), in_dims[:4], strict=True))
        rows = x.shape[1]

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(size * rows, *t.shape[2:])

        dx, dw, db = _gn_backward_rows(flat(gy.contiguous()), flat(x), flat(mean), flat(rstd), weight, groups)
        dx = dx.reshape(x.shape)
        if dw is None:
            return (dx, None, None), (0, None, None)
        return (dx, dw.reshape(size, rows, -1).sum(1), db.reshape(size, rows, -1).sum(1)), (0, 0, 0)


class _GroupNorm(torch.autograd.Function):
    """``F.group_norm`` with vmap rules that call the fused kernels once per chunk."""

    @staticmethod
    def forward(x, groups, weight, bias, eps):  # noqa: ANN001, ANN205
        return _gn_forward(x, groups, weight, bias, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        x, groups, weight, _, _ = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, mean, rstd, weight)
        ctx.groups, ctx.has_bias = groups, inputs[3] is not None
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(ctx, gy, _gmean, _grstd):  # noqa: ANN001, ANN205
        x, mean, rstd, weight = ctx.saved_tensors
        dx, dw, db = _GroupNormBackward.apply(gy, x, mean, rstd, weight, ctx.groups)
        return dx, None, dw, db if ctx.has_bias else None, None

    @staticmethod
    def vmap(info, in_dims, x, groups, weight, bias, eps):  # noqa: ANN001, ANN205
        if in_dims[2] is not None or in_dims[3] is not None:
            raise FuncUnsupported("per-record GroupNorm weights")
        size = info.batch_size
        x = _to_front(x, in_dims[0], size)
        rows = x.shape[1]
        out, mean, rstd = _gn_forward(x.reshape(size * rows, *x.shape[2:]), groups, weight, bias, eps)
        return (out.reshape(x.shape), mean.reshape(size, rows, -1), rstd.reshape(size, rows, -1)), (0, 0, 0)


#: flwr-jdp's own vmap rules (one fused kernel call per chunk, record by record).
_OWN_RULES = (_GroupNorm, _GroupNormBackward)


# ------------------------------------------- the drop-in's DP pass: model kinds
#: Model kinds (:func:`model_kind`) on which the vectorised pass failed (the drop-in's
#: DP pass computes their records one by one, :func:`record_by_record`), with the reason.
FUNC_FAILED: dict[tuple, str] = {}


def model_kind(model: nn.Module) -> tuple:
    """What a verdict on a model holds for: the model's class, the classes of all its
    submodules and its training mode (a dropout layer added, or eval mode, is another kind)."""
    return type(model), tuple(type(m) for m in model.modules()), model.training


def record_by_record(model: nn.Module, params: dict[str, nn.Parameter], n: int,
                     term: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                     on_error: Callable[[int, Exception], torch.Tensor] | None = None) -> torch.Tensor:
    """Each record's gradient computed on the record alone (micro-batches of one):
    ``term(i)`` runs record ``i``'s forward pass and loss term with nothing else in the
    batch and returns ``(loss, output)``; the gradient of that loss in ``params`` is row
    ``i`` of their ``grad_sample``. The model's buffers and state attributes
    (:class:`~flwr_jdp.training.model_state.ModelState`) are put back after each record
    (a forward that updates them cannot carry a record into the next), ``.grad`` is never
    touched. Returns the records' outputs, stacked. With ``on_error``, a record whose
    forward or backward raises has a zero row and ``on_error(i, err)`` as its output
    (else the exception propagates)."""
    names = list(params)
    flags = {k: p.requires_grad for k, p in params.items()}
    state = ModelState(model)
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    outputs = []
    try:
        for p in params.values():
            p.requires_grad_(True)
        for i in range(n):
            try:
                with torch.enable_grad():
                    loss, out = term(i)
                    grads = (torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
                             if loss.requires_grad else [None] * len(names))
            except (MemoryError, torch.OutOfMemoryError):
                raise
            except Exception as err:
                if on_error is None:
                    raise
                grads, out = [None] * len(names), on_error(i, err)
            for k, g in zip(names, grads, strict=True):
                rows[k].append(torch.zeros_like(params[k]) if g is None else g.detach())
            outputs.append(out.detach())
            state.restore()
    finally:
        state.restore()
        for k, p in params.items():
            p.requires_grad_(flags[k])
    for k in names:
        p = params[k]
        p.grad_sample = torch.stack(rows[k]) if n else torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
    return torch.stack(outputs) if outputs else torch.zeros(0)
