"""The DP step, in one place: unit, sensitivity and noise.

Each step clips the current batch's per-unit gradients to ``C`` jointly over the
trainable parameters (records averaged within a user under the user unit), sums them,
so one unit moves the sum by at most ``C``, and the mechanism
(:class:`~flwr_jdp.privacy.mechanisms.GaussianSumMechanism`) adds ``N(0, (z C)^2)`` and
divides by the expected batch ``q N``; the pass's optimizer applies that gradient
(post-processing). Under central noise (``capture``) the clipped sum (or, distributed,
the encoder's integer sum) is kept instead and nothing moves. :class:`_DPStep` also
holds the trajectory the steps make (every parameter and buffer), which the pass puts
back wherever the user's code changed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...privacy.mechanisms import GaussianSumMechanism
from .. import per_sample
from ..dp_sgd import UnitBatch, batch_sums, clipped_unit_rows
from .batches import PoissonLoader
from .common import UserLoopError, _equal

if TYPE_CHECKING:
    from .capture_types import _LossCall


class _DPStep:
    """The trajectory the DP steps make (``expected``: every parameter and buffer of the
    model), the DP step itself, and the refusals and notes of the pass."""

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
        self.loss_engine: per_sample.FuncPerSample | None = None  # over loss_fn (:class:`.gradients._LossOf`)
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
        #: (the sample, its tensors, the batch's structure holding them: the pass's own copy;
        #: the records' items as the data set gave them)
        self.unstepped: dict[int, tuple[UnitBatch, list[torch.Tensor], object, list]] = {}
        self.sampler.on_batch = lambda d, *drawn: self.unstepped.__setitem__(d, drawn)
        self.steps_taken = 0
        self.steps_completed = 0  # taken by the pass after the train function returned
        self.captured: list[torch.Tensor] | None = None
        self.refusal: str | None = None
        self.foreign = False
        self.inside = False
        self.set_aside: dict[str, str] = {}
        #: the model's kind and parameter shapes (what the cached shapes and layer roles hold for)
        self.kind = (per_sample.model_kind(model), tuple((n, tuple(p.shape)) for n, p in self.named.items()))
        self.dry = False  # the dry run: rules checked, no gradient computed
        #: a record whose gradient cannot be computed refuses the code: the dry run's checks and
        #: a pass without a dry run; the release pass after a dry run zeroes that record instead
        self.strict = True
        self.shown_model = model  # the model whose output the user's code reads
        self.modes: dict[str, bool] | None = None
        self.device = torch.device("cpu")

    def refuse(self, reason: str) -> None:
        """Record the first violation (a train function that catches the error still
        has its round refused) and raise it."""
        if self.refusal is None:
            self.refusal = reason
        raise UserLoopError(self.refusal, structural=True)

    def note(self, key: str, text: str) -> None:
        """Something the train function did that the DP pass set aside (logged once, at the end)."""
        self.set_aside.setdefault(key, text)

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

    def _dp_step(self, draw: int) -> None:
        """Clip, sum, noise; apply with the DP pass's optimizer on the trajectory."""
        sample = self.unstepped.pop(draw)[0]
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

    def close(self) -> None:
        self.sampler.on_batch = None
        for p in self.model.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        for engine in (self.engine, self.loss_engine):
            if engine is not None:
                engine.close()
