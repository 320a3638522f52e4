"""DP-SGD inside the user's own training loop (the drop-in client half).

The user's ``train(model, loader)`` function keeps its loss, optimizer and loop.
For the duration of :func:`private_training` it is handed

- the user's model wrapped in a :class:`PrivateModule` (per-sample gradients of
  every trainable parameter, by whole-model ``torch.func`` from the loss's gradient
  in the model's output, or by Opacus's ``GradSampleModule`` for a model that path
  cannot handle; the caller freezes what must not be trained), and
- a :class:`PoissonLoader` over the user's data set (its ``collate_fn`` kept) that
  yields exactly the ``steps`` Poisson batches of rate ``q`` the server accounts
  for, in total over however many passes the loop makes;

and every ``optimizer.step()`` of any optimizer holding the model's parameters is
preceded by the DP step (a global optimizer pre-step hook, removed on exit): the
per-unit gradients of the current batch are clipped to ``C`` jointly over the
trainable parameters, summed, noised by the mechanism module
(:class:`~flwr_jdp.privacy.mechanisms.GaussianSumMechanism`, std ``z C``) and
divided by the expected batch size ``q N``, as Opacus's ``DPOptimizer`` does; the
optimizer then applies that gradient (SGD, Adam, momentum: post-processing).

Unit, sensitivity and noise: one unit (record, or all records of one user) moves
the summed clipped gradient by at most ``C``; the noise is ``N(0, (z C)^2)``; each
step is ``PoissonSampled(q, Gaussian(z))``, ``steps`` of them per round, which is
what the ledgers record (:func:`flwr_jdp.privacy.events.dp_sgd`).

Checks (each a :class:`UserLoopError` naming the cause): a step without a new
batch (two steps per batch, or a step before the first batch), per-sample
gradients missing or of the wrong batch size (a loss that is not averaged or
summed over the batch, two backward passes per step). Fewer steps than planned is allowed (the ledger has charged the planned ones: the
accounting is then conservative) and logged once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import WARNING

import torch
from flwr.common import log
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from .. import import_opacus_quietly
from ..privacy.mechanisms import GaussianSumMechanism
from . import per_sample
from .dp_sgd import UnitBatch, _draw_batch, batch_sums


class UserLoopError(RuntimeError):
    """The user's training loop does something DP-SGD cannot account for."""


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
            self.current = _draw_batch(self.unit_of_record, self.num_units, self.rate,
                                       self.generator, self.secure)
            self.drawn += 1
            quota -= 1
            yield self.current.records.tolist()


def _empty_like(batch):
    """``batch`` (a collated structure) with every tensor cut to zero rows."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)({k: _empty_like(v) for k, v in batch.items()})
    if isinstance(batch, list | tuple):
        return type(batch)(_empty_like(v) for v in batch)
    return batch


class PoissonLoader(DataLoader):
    """The user's data set in the server's Poisson batches (the user's
    ``collate_fn``). An empty sample is yielded as a batch of zero rows (its step is
    pure noise, as the accounting assumes)."""

    def __init__(self, dataset, sampler: PoissonBatches, collate_fn=None) -> None:
        from torch.utils.data import default_collate

        collate = collate_fn or default_collate

        def collate_or_empty(items):
            if items:
                return collate(items)
            return _empty_like(collate([dataset[0]]))

        super().__init__(dataset, batch_sampler=sampler, collate_fn=collate_or_empty, num_workers=0)
        self.poisson = sampler


@dataclass
class _DPStep:
    """The optimizer pre-step hook: replaces the gradients of ``params`` by the
    noised, normalised sum of clipped per-unit gradients of the current batch
    (``capture``: keeps the un-noised clipped sum instead and zeroes the gradients;
    the central-noise release)."""

    params: list[nn.Parameter]
    sampler: PoissonBatches
    clipping_norm: float
    mechanism: GaussianSumMechanism | None
    generator: torch.Generator
    capture: bool = False
    steps_taken: int = 0
    captured: list[torch.Tensor] | None = None
    _ids: set[int] = field(default_factory=set)
    _last_draw: int = 0  # the sampler's draw the last step used

    def __post_init__(self) -> None:
        self._ids = {id(p) for p in self.params}

    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"]):
            return  # another optimizer (not this model's)
        batch = self.sampler.current
        if batch is None or self.steps_taken >= self.sampler.drawn or self._last_draw == self.sampler.drawn:
            raise UserLoopError("optimizer.step() was called without a new batch from the private "
                                "loader: take exactly one step per batch")
        others = [p for g in optimizer.param_groups for p in g["params"]
                  if id(p) not in self._ids and p.grad is not None]
        if others:  # e.g. personal parameters the train function unfroze: not in the release
            raise UserLoopError(f"the train function gave gradients to {len(others)} parameters outside "
                                "the private release (personal parameters unfrozen?): leave requires_grad "
                                "as the model is handed over")
        self._last_draw = self.sampler.drawn
        n = len(batch.records)
        for p in self.params:
            gs = getattr(p, "grad_sample", None)
            if n and (gs is None or not isinstance(gs, torch.Tensor | per_sample.OuterProducts) or len(gs) != n):
                got = ("none" if gs is None else tuple(gs.shape) if isinstance(gs, torch.Tensor)
                       else f"{len(gs)} rows" if isinstance(gs, per_sample.OuterProducts)
                       else f"{len(gs)} backward passes" if isinstance(gs, list) else type(gs).__name__)
                raise UserLoopError(
                    f"per-sample gradients of a batch of {n} records expected, got {got}: call "
                    "loss.backward() exactly once per batch, on the model passed to your train "
                    "function, with a loss averaged over the batch")
        sums = batch_sums(self.params, batch, self.clipping_norm)
        if self.capture:
            self.captured = sums if self.captured is None else [a + b for a, b in zip(self.captured, sums, strict=True)]
            grads = [torch.zeros_like(p) for p in self.params]
        else:
            assert self.mechanism is not None
            grads = self.mechanism.release_torch(sums, self.generator)
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g.to(p.dtype)
            p.grad_sample = None
        self.steps_taken += 1


#: Warnings given once per process.
_WARNED = {"epochs": False}


class PrivateModule(nn.Module):
    """The user's model as their train function sees it inside :func:`private_training`:
    per-sample gradients of its trainable parameters by whole-model ``torch.func``
    (:class:`~flwr_jdp.training.per_sample.FuncGradSampleModule`), or by Opacus's
    hooks (``GradSampleModule``) for a model class that path cannot handle, found on
    the first batch (one log line per class) or named by ``FLWR_JDP_PER_SAMPLE``
    (``opacus``; ``func``: no fallback). Its parameters are the model's, named
    ``_module.<name>`` as Opacus names them; any other attribute (``net.fc3``,
    a method of the model) is the model's own."""

    def __init__(self, model: nn.Module, loss_reduction: str) -> None:
        super().__init__()
        self._module = model
        self.loss_reduction = loss_reduction
        self._func: per_sample.FuncGradSampleModule | None = None
        self._gsm = None
        backend = per_sample.BACKEND
        if backend == "opacus" or (backend == "auto" and per_sample.model_kind(model) in per_sample.LINEARIZED_FAILED):
            self._use_opacus()
        else:
            try:
                self._func = per_sample.FuncGradSampleModule(model, loss_reduction)
            except per_sample.FuncUnsupported as err:
                if backend == "func":
                    raise UserLoopError(f"per-sample gradients by torch.func: {err}") from err
                self._fall_back(err)

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever the model's attribute is
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_module":
                raise
            return getattr(self._module, name)

    @property
    def path(self) -> str:
        """``torch.func`` or ``opacus``: how the per-sample gradients are computed."""
        return "opacus" if self._gsm is not None else "torch.func"

    def _use_opacus(self) -> None:
        import_opacus_quietly()
        from opacus import GradSampleModule

        try:  # not a registered submodule: the parameters stay named _module.<name>
            object.__setattr__(self, "_gsm", GradSampleModule(self._module, loss_reduction=self.loss_reduction))
        except Exception as err:  # noqa: BLE001 - Opacus names the unsupported layer
            raise UserLoopError(f"the model cannot be trained with per-sample gradients: {err}") from err

    def _fall_back(self, err: Exception) -> None:
        kind = per_sample.model_kind(self._module)
        if kind not in per_sample.LINEARIZED_FAILED:
            reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
            per_sample.LINEARIZED_FAILED[kind] = reason
            log(WARNING, "per-sample gradients of %s: torch.func cannot handle the model (%s); "
                "using Opacus's hooks", type(self._module).__qualname__, reason)
        if self._func is not None:
            self._func.close()
            self._func = None
        self._use_opacus()

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if self._gsm is not None:
            return self._gsm(*args, **kwargs)
        assert self._func is not None
        if per_sample.BACKEND == "func" or per_sample.known_to_work(self._module):
            return self._func(*args, **kwargs)
        devices = sorted({p.device.index for p in self._module.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):
            try:  # on failure the fallback redraws a random layer's draws from the same state
                return self._func(*args, **kwargs)
            except per_sample.FuncUnsupported as err:  # before the output was used
                failed = err
            except per_sample.BatchMixing as err:
                raise UserLoopError(str(err)) from err
        self._fall_back(failed)
        return self._gsm(*args, **kwargs)

    def close(self) -> None:
        """Remove hooks and per-sample gradients; the model is left as it came."""
        for p in self._module.parameters():
            p.grad_sample = None
        if self._func is not None:
            self._func.close()
        if self._gsm is not None:
            self._gsm._close()  # noqa: SLF001 - removes Opacus hooks, leaves the plain model


@dataclass
class PrivateRound:
    """What :func:`private_training` did: steps taken and (``capture``) the clipped sum."""

    steps_planned: int
    steps_taken: int = 0
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
    loss_reduction: str = "mean",
    epochs: int = 1,
) -> Iterator[tuple[nn.Module, PoissonLoader, PrivateRound]]:
    """Yield ``(private model, private loader, record)`` for the user's train function.

    The trainable parameters of ``model`` (``requires_grad``) are the ones made
    private; freeze the others before. Each pass over the private loader yields an
    ``epochs``-th of the ``steps`` (the run's ``local-epochs``). With ``capture``
    (central noise) no noise is added and no parameter moves: the clipped sum of the
    batches is kept in the record (use ``steps=1``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UserLoopError("no trainable parameter to train privately")
    sampler = PoissonBatches(unit_of_record, num_units, sample_rate, steps, generator, secure, epochs)
    private_loader = PoissonLoader(loader.dataset, sampler, loader.collate_fn)
    expected = max(sample_rate * num_units, 1e-12)
    mech = None if capture else GaussianSumMechanism(noise_multiplier, clipping_norm, expected,
                                                     secure=secure)
    hook = _DPStep(params, sampler, clipping_norm, mech, generator, capture=capture)
    record = PrivateRound(steps_planned=int(steps))
    private = PrivateModule(model, loss_reduction)
    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield private, private_loader, record
    finally:
        handle.remove()
        private.close()
    record.steps_taken = hook.steps_taken
    record.clipped_sum = hook.captured
    if hook.steps_taken < steps:
        log(WARNING, "the train function took %d of the %d DP-SGD steps charged for this round "
            "(charged in full: the accounting is conservative); it made %d pass(es) over the private "
            "loader, which spreads the steps over local-epochs = %d passes", hook.steps_taken, steps,
            sampler.passes, epochs)
    elif sampler.empty_passes and not capture and not _WARNED["epochs"]:
        _WARNED["epochs"] = True
        log(WARNING, "the train function made %d passes over the private loader, but the owners' "
            "schedule has the DP steps of local-epochs = %d epoch(s), all taken by then: the later "
            "passes got no batch; set flwr-jdp's local-epochs = %d to train the shared layers as many "
            "epochs as your loop (it is charged accordingly)", sampler.passes, epochs, sampler.passes)
