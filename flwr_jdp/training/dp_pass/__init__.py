"""DP-SGD inside the user's own training loop: the drop-in client's DP pass.

The user's ``train(model, loader)`` keeps its loss function, optimizer and loop.
For the duration of :func:`private_training` it is handed

- a :class:`PoissonLoader` over the user's data set (its ``collate_fn`` kept) that
  yields exactly the ``steps`` Poisson batches of rate ``q`` the owners agreed to,
  an ``epochs``-th of them per pass, and
- the user's model wrapped in a :class:`PrivateModule`, whose forward pass is lazy:
  it returns the output as a placeholder, and when that output goes into a torch
  loss function (``nn.CrossEntropyLoss()(out, y)``, ``F.mse_loss``, ...) the DP pass
  sees the call and computes, in one vectorised pass (``vmap(grad(...))`` over
  ``functional_call``), each record's own term of that loss, its gradient and its
  output, computed on the record alone. The user gets the real output and the real
  loss value; ``loss.backward()`` then has nothing left to do. Where that pass cannot
  trace the model (or could not keep its records apart: an ``autograd.Function`` with
  its own ``vmap`` rule), each record's gradient comes from a micro-batch of that one
  record (its forward, loss term and backward with nothing else in the batch): per
  record by construction on every path, nothing sampled or checked.

With ``loss_fn(model, batch) -> scalar`` (any loss built from the model's outputs and
the batch: tuple or dict outputs, keyword inputs, a model's own ``.loss``, several
terms) the train function gets the user's model itself instead, and the DP steps use
each record's gradient of ``loss_fn`` on a batch of that record alone (the same two
paths); each ``optimizer.step()`` takes one DP step, ``step(closure)`` included (the
closure runs, its gradients are discarded).

Unit, sensitivity and noise (one place): every ``optimizer.step()`` on the model's
trainable parameters is preceded by the DP step (an optimizer pre-step hook): the
per-unit gradients of the current batch (records clipped to ``C`` jointly over the
trainable parameters, averaged within a user under the user unit) are summed, so
one unit moves the sum by at most ``C``; the mechanism
(:class:`~flwr_jdp.privacy.mechanisms.GaussianSumMechanism`) adds ``N(0, (z C)^2)``
and divides by the expected batch ``q N``; the optimizer then applies that gradient
(post-processing). Each step is ``PoissonSampled(q, Gaussian(z))``, ``steps`` of
them per round: what the ledgers record (:func:`flwr_jdp.privacy.events.dp_sgd`).
Under central noise (``capture``) the clipped sum is kept instead and nothing moves.

The DP pass owns the release. With the train function given (the drop-in client),
:func:`private_training` first runs it on a few synthetic records shaped as the owner's
(:func:`_dry_run`, on a copy of the model): that reads none of the owner's data, fixes
the loss and its arguments, the optimizer (a ``torch.optim`` class and its settings), the
model's modes and device (:class:`_Plan`), and checks every rule below, so a refusal
(:class:`UserLoopError`, nothing sent) cannot depend on the data. On the owner's data
(:class:`_ReleasePass`) the DP steps run on the pass's own model and its own copy of each
batch with the plan's loss and optimizer; step k uses Poisson draw k, at most ``steps``
draws exist, and the steps the train function leaves out are taken at the end. The train
function only paces the steps (each ``optimizer.step()`` takes the ones due) and sees
their trajectory in its model; whatever else it does (edits of the model or the batch,
hooks, modes, a scheduler, loss arguments chosen from a batch, an early stop, an
exception) is set aside with one line on the node. The release is the DP steps'
trajectory.

Refused on the dry run, whatever the data:

- the model's inputs or the loss's target are not tensors of the current batch
  (moved to a device, cast or reshaped is fine; records transformed or mixed inside
  the loop, such as mixup, are not);
- the loss is not a torch loss function on the model's output (a hand-written loss,
  the output transformed first), or a second loss on one batch's output;
- per-record weights in the loss, ``step(closure)``, an optimizer from outside
  ``torch.optim``, keyword arguments to the model, no loss or no optimizer step at all;
- a batch without the records along dim 0 (time first, or, with ``loss_fn``, a constant
  or a string in it): the dry run collates its synthetic records at two batch sizes that
  no dimension of a record equals (:func:`.plan._counts`), so such a layout shows
  whatever the data.

On the owner's data nothing is refused: a batch is split by rows only where each record's
rows are exactly its batch of one (else each record is collated alone), and a record
whose loss or gradient raises or is not finite gets a zero gradient (:mod:`.gradients`).

Without the train function given, the same rules are checked as the block's train
function runs (what the dry run does).

Modules, one duty each: :mod:`.batches` (the Poisson loader and batches),
:mod:`.capture_types` and :mod:`.capture` (the lazy output, the loss interception, the
optimizer hooks: the user's loop as the pass sees it), :mod:`.gradients` (per-record
gradients: ``vmap`` or micro-batches of one), :mod:`.step` (the DP step: clip, sum,
noise), :mod:`.plan` (the dry run and its plan), :mod:`.release` (the release pass) and
:mod:`.entry` (:func:`private_training`, the public entry).
"""

from .batches import PoissonBatches, PoissonLoader
from .capture import PrivateModule
from .capture_types import LOSSES, PendingOutput
from .common import UserLoopError
from .entry import PrivateRound, private_training
from .gradients import LossFn
from .plan import Plan, dry_run

__all__ = ["LOSSES", "LossFn", "PendingOutput", "Plan", "PoissonBatches", "PoissonLoader", "PrivateModule",
           "PrivateRound", "UserLoopError", "dry_run", "private_training"]
