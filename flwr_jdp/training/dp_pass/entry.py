"""The public entry, shaped as Opacus's ``make_private``: the user's objects in (the
model, its data loader, its train function; the owners' schedule), private objects
out (the private model and Poisson loader the train function runs on, and the record
of what the pass released)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import ERROR, WARNING

import torch
from flwr.common import log
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from ...privacy.mechanisms import GaussianSumMechanism
from .batches import PoissonBatches, PoissonLoader
from .capture import PrivateModule, _DPPass
from .common import _WARNED, UserLoopError
from .gradients import LossFn
from .plan import Plan, dry_run
from .release import _ReleasePass


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
    loss_fn: LossFn | None = None,
    plan: Plan | None = None,
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

    With ``loss_fn`` (``(model, batch) -> scalar tensor``: the loss of a batch, exactly as
    the loader yields it, as the user's loop computes it; with ``train_fn`` only) the
    block's train function gets ``model`` itself, not a wrapper, and the DP steps use
    each record's gradient of ``loss_fn`` on that record alone: any outputs, keyword
    inputs and loss. ``plan``: the dry run's (:func:`~.plan.dry_run`), when the caller
    ran it already (before charging the owner); it must be for this ``train_fn`` and
    ``loss_fn``.

    ``unit_encoder`` (distributed noise, with ``capture``): the captured sum is the
    encoder's integer sum of each batch's clipped per-unit rows instead."""
    if unit_encoder is not None and not capture:
        raise ValueError("unit_encoder needs capture=True")
    if (loss_fn is not None or plan is not None) and train_fn is None:
        raise ValueError("loss_fn and plan need train_fn (the dry run fixes the optimizer)")
    if plan is not None:
        loss_fn = plan.loss_fn
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

        if plan is None:
            plan = dry_run(model, loader, train_fn, capture=capture, loss_fn=loss_fn)
        release = release_model if release_model is not None else copy.deepcopy(model)
        dp_pass: _DPPass = _ReleasePass(model, release, private_loader, clipping_norm, mech, noise, capture, plan)
    else:
        dp_pass = _DPPass(model, private_loader, clipping_norm, mech, noise, capture)
    dp_pass.encoder = unit_encoder
    record = PrivateRound(steps_planned=int(steps))
    private = model if loss_fn is not None else PrivateModule(model, dp_pass)
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
