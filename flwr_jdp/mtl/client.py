"""The client half of DP mean-regularized MTL for a user's own Flower ClientApp.

The user keeps their ClientApp, torch model class, data loaders and ``train`` /
``test`` functions. One line registers the set-up exchange; the train handler hands
its model, loader and train function to :meth:`MTLClient.train`; the evaluate
handler loads the task's personalized model with :meth:`MTLClient.load`::

    app = ClientApp()
    mtl = MTLClient(app, model_fn=Net, train_data=lambda ctx: load_data(ctx)[0])

    @app.train()
    def train(msg, context):
        trainloader, _ = load_data(context)
        return mtl.train(msg, context, Net(), trainloader,
                         lambda net, loader: train_fn(net, loader, epochs, lr))

    @app.evaluate()
    def evaluate(msg, context):
        model = mtl.load(Net(), msg, context)
        ...  # the app's own test; reply MetricRecord({..., "num-examples": n})

Each node hosts one task, ``k`` = its node-config ``partition-id``. Its model
``w_k`` is the user's *whole* model: every parameter, flattened in
``named_parameters`` order (buffers, e.g. BatchNorm statistics, stay on the node
and are not part of ``w_k``). One round of :meth:`MTLClient.train` (Algorithm 1 of
Hu, Wu and Smith, with the user's loop as the local solver):

1. ``w_k`` comes from ``context.state`` (the first time: the broadcast mean
   ``w~``, public and data-free) and is loaded into the user's model;
2. the user's ``train_fn(model, loader)`` trains it on the user's loader with the
   user's loss and optimizer, while a global optimizer pre-step hook
   (:func:`mean_regularized`) adds ``lambda (w - w~)``, the gradient of the
   regularizer ``lambda/2 ||w - w~||^2``, to every parameter's gradient before each
   step: the optimizer minimises ``f_k(w) + lambda/2 ||w - w~||^2``;
3. the trained model, flattened, is projected onto the ball ``||w|| <= B`` (the
   whole vector; ``B`` = ``jdp.radius``), stored as the new ``w_k`` and sent to the
   trusted aggregator under ``models`` / ``task.<k>``. The ball bounds what one
   task can move the sum by, hence the noisy mean's sensitivity.

Only the aggregator sees ``w_k``; other tasks only ever receive the noisy means.
Nothing else leaves the task: not its data size, not its training loss. The
personalized model (``w_k``, or a copy fine-tuned against ``w~`` with
:meth:`MTLClient.load`'s ``fit``) never leaves the node; the evaluate reply carries
only what the user's ``test`` reports (not covered by the guarantee: a benchmark
metric, as in every Flower app).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from logging import WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from flwr_jdp.config_check import ConfigError
from flwr_jdp.mtl.reply_rules import mtl_guard
from flwr_jdp.reply_guard import install

from .algorithm import MTLConfig
from .config import namespaced_mtl_config
from .health import divergence_hint
from .local import project_ball
from .protocol import (
    CONFIG,
    MEAN,
    METRICS,
    MODELS,
    NUM_PARAMS,
    NUM_PARTITIONS,
    PARAM_NAMES,
    PARAM_SHAPES,
    SETUP,
    TASKS,
    task_key,
)

TrainFn = Callable[[nn.Module, DataLoader], object]

#: ``context.state`` key prefix of a task's ``w_k`` (as in the DP-MTL app, ``apps/dp_mtl``).
STATE_PREFIX = "dp-mtl.task."


class MTLClientError(RuntimeError):
    """Something in the user's app that the DP-MTL client half cannot work with."""


def task_id(context: Context) -> int:
    """The task a node hosts: its node-config ``partition-id``."""
    pid = context.node_config.get("partition-id")
    if pid is None:
        raise ConfigError("the node config has no 'partition-id' (the task this node hosts): start the "
                          "SuperNode with --node-config \"partition-id=<k> num-partitions=<m>\"")
    return int(pid)


# ------------------------------------------------------------- flat models
def num_parameters(model: nn.Module) -> int:
    """Length of ``w_k``: every parameter of ``model``, flattened."""
    return int(sum(p.numel() for p in model.parameters()))


def flatten(model: nn.Module) -> np.ndarray:
    """``w``: every parameter, flattened in ``named_parameters`` order (float64)."""
    return torch.cat([p.detach().reshape(-1).cpu().double() for _, p in model.named_parameters()]).numpy()


def load_flat(model: nn.Module, w: np.ndarray) -> nn.Module:
    """Write ``w`` (as flattened by :func:`flatten`) into ``model``'s parameters."""
    w = np.asarray(w)
    if w.shape != (num_parameters(model),):
        raise MTLClientError(f"a model of {w.size} values does not fit this model's "
                             f"{num_parameters(model)} parameters")
    offset = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            n = p.numel()
            p.copy_(torch.from_numpy(np.ascontiguousarray(w[offset: offset + n])).view_as(p))
            offset += n
    return model


@dataclass
class RegularizerRecord:
    """What :func:`mean_regularized` did: optimizer steps it added the regularizer to."""

    steps: int = 0


@contextmanager
def mean_regularized(model: nn.Module, mean: np.ndarray, lam: float) -> Iterator[RegularizerRecord]:
    """While open, every ``optimizer.step()`` of any optimizer holding parameters of
    ``model`` is preceded by ``p.grad += lam * (p - w~_p)`` for each such parameter
    that requires a gradient (``p.grad`` set when the loss left it ``None``): the
    gradient of ``lam/2 ||w - w~||^2`` added to the user's loss. ``mean`` is ``w~``,
    flattened as :func:`flatten`. The hook is global (torch's
    ``register_optimizer_step_pre_hook``) and removed on exit; optimizers of other
    models are left alone."""
    mean = np.asarray(mean, dtype=np.float64)
    targets: dict[int, tuple[nn.Parameter, np.ndarray]] = {}
    offset = 0
    for _, p in model.named_parameters():
        n = p.numel()
        targets[id(p)] = (p, mean[offset: offset + n].reshape(p.shape))
        offset += n
    if offset != mean.size:
        raise MTLClientError(f"the broadcast mean has {mean.size} values; the model has {offset} parameters")
    cache: dict[int, torch.Tensor] = {}
    record = RegularizerRecord()

    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        touched = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    entry = targets.get(id(p))
                    if entry is None or entry[0] is not p or not p.requires_grad:
                        continue
                    touched = True
                    target = cache.get(id(p))
                    if target is None or target.device != p.device or target.dtype != p.dtype:
                        target = cache[id(p)] = torch.from_numpy(np.ascontiguousarray(entry[1])).to(
                            device=p.device, dtype=p.dtype)
                    reg = lam * (p.detach() - target)
                    if p.grad is None:
                        p.grad = reg
                    else:
                        p.grad.add_(reg)
        record.steps += int(touched)

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield record
    finally:
        handle.remove()


def _spec_of(model: nn.Module) -> tuple[list[str], list[str]]:
    names, shapes = [], []
    for n, p in model.named_parameters():
        names.append(n)
        shapes.append("x".join(str(d) for d in p.shape) or "scalar")
    return names, shapes


def _call(what: str, fn: Callable, *args: object):  # noqa: ANN202 - the user's callable's result
    """``fn(*args)``; an exception in the user's code becomes an error naming ``what``."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported to the server, which fails the run
        raise MTLClientError(f"{what} raised {type(err).__name__}: {err}") from err


def _error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


class MTLClient:
    """Registers the DP-MTL set-up exchange on ``app`` and runs the task's rounds
    with the user's model, loader and train function.

    Parameters
    ----------
    app : ClientApp
        The user's ClientApp; a ``query`` handler for the set-up is added to it.
    model_fn : callable
        ``() -> nn.Module``, the user's model class. Its flattened parameter count
        (with names and shapes) is reported at set-up, so the server checks its
        ``initial_arrays`` against it before any privacy is spent.
    train_data : callable, optional
        ``(context) -> DataLoader``, the task's training loader: checked non-empty
        at set-up (its size is not sent).
    """

    def __init__(self, app: ClientApp, *, model_fn: Callable[[], nn.Module],
                 train_data: Callable[[Context], DataLoader] | None = None) -> None:
        self.model_fn = model_fn
        self.train_data = train_data
        install(app, mtl_guard(task_id))  # nothing but w_k and its count leaves the node
        app.query()(self._setup)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def config(context: Context) -> MTLConfig:
        """Algorithm 1's settings from the run config's ``jdp.*`` keys (validated)."""
        return namespaced_mtl_config(context.run_config)[1]

    def _setup(self, msg: Message, context: Context) -> Message:
        """Report the task this node hosts, the federation's number of partitions
        and the model's flattened parameter count, names and shapes (public)."""
        try:
            self.config(context)
            k = task_id(context)
            model = _call(f"task {k}: model_fn()", self.model_fn)
            names, shapes = _spec_of(model)
            if self.train_data is not None:
                loader = _call(f"task {k}: train_data(context)", self.train_data, context)
                if len(loader.dataset) == 0:  # type: ignore[arg-type]
                    raise MTLClientError(f"task {k}: the training data set is empty")
        except (ConfigError, MTLClientError) as err:
            return _error(msg, str(err))
        rec = ConfigRecord({TASKS: [k], NUM_PARAMS: num_parameters(model), PARAM_NAMES: names,
                            PARAM_SHAPES: shapes})
        parts = context.node_config.get("num-partitions")
        if parts is not None:
            rec[NUM_PARTITIONS] = int(parts)
        return Message(RecordDict({SETUP: rec}), reply_to=msg)

    # ------------------------------------------------------------------- model
    @staticmethod
    def _mean(msg: Message, model: nn.Module) -> np.ndarray:
        rec = msg.content.get(MEAN)
        if not isinstance(rec, ArrayRecord) or MEAN not in rec:
            raise MTLClientError("the instruction carries no broadcast mean ('mean' record)")
        mean = rec[MEAN].numpy().astype(np.float64).ravel()
        if mean.size != num_parameters(model):
            raise MTLClientError(f"the broadcast mean has {mean.size} values; the model has "
                                 f"{num_parameters(model)} parameters")
        return mean

    @staticmethod
    def stored(context: Context, k: int) -> np.ndarray | None:
        """Task ``k``'s ``w_k`` in ``context.state`` (``None`` before its first round)."""
        rec = context.state.get(STATE_PREFIX + str(k))
        return rec["w"].numpy() if isinstance(rec, ArrayRecord) else None

    def load(self, model: nn.Module, msg: Message, context: Context,
             fit: Callable[[nn.Module], object] | None = None) -> nn.Module:
        """``model`` holding this task's personalized model, for the user's ``test``
        (replaces ``load_state_dict``): ``w_k`` (the broadcast mean ``w~`` of ``msg``
        before the task's first round). With ``fit`` (``model -> anything``, e.g.
        ``lambda m: train_fn(m, trainloader, ...)``) a copy of ``w_k`` is first
        fine-tuned against ``w~`` by ``fit`` under the regularizer (Algorithm 1's
        evaluation; not projected, not stored, never sent: no privacy cost)."""
        cfg = self.config(context)
        k = task_id(context)
        mean = self._mean(msg, model)
        w = self.stored(context, k)
        load_flat(model, mean if w is None else w)
        if fit is not None:
            with mean_regularized(model, mean, cfg.lam):
                fit(model)
            if not np.all(np.isfinite(flatten(model))):
                raise MTLClientError(f"fine-tuning made the model non-finite: {divergence_hint(mean, cfg)}")
        return model

    # ------------------------------------------------------------------- train
    def train(self, msg: Message, context: Context, model: nn.Module, train_loader: DataLoader,
              train_fn: TrainFn) -> Message:
        """One round of this node's task with the user's ``train_fn(model, loader)``;
        returns the reply (the projected ``w_k`` only). An error the user can act on
        becomes an error reply naming the cause; nothing is then stored or sent."""
        try:
            return self._train(msg, context, model, train_loader, train_fn)
        except (ConfigError, MTLClientError) as err:
            log(WARNING, "DP-MTL train round failed (nothing sent): %s", err)
            return _error(msg, str(err))

    def _train(self, msg: Message, context: Context, model: nn.Module, loader: DataLoader,
               train_fn: TrainFn) -> Message:
        cfg = self.config(context)
        k = task_id(context)
        asked = [int(t) for t in msg.content[CONFIG].get(TASKS, [])]
        if k not in asked:
            raise MTLClientError(f"the instruction asks for tasks {asked[:5]}, not this node's task {k}")
        mean = self._mean(msg, model)
        w = self.stored(context, k)
        load_flat(model, mean if w is None else w)
        with mean_regularized(model, mean, cfg.lam) as record:
            train_fn(model, loader)
        if record.steps == 0:
            log(WARNING, "task %d: the train function took no optimizer step on the model it was given "
                "(w_k is only projected)", k)
        w = flatten(model)
        if not np.all(np.isfinite(w)):
            raise MTLClientError(f"task {k}: training made the model non-finite: {divergence_hint(mean, cfg)}")
        w = np.ascontiguousarray(project_ball(w, cfg.radius), dtype=np.float64)
        context.state[STATE_PREFIX + str(k)] = ArrayRecord({"w": Array(w)})
        reply = RecordDict({MODELS: ArrayRecord({task_key(k): Array(w)}),
                            METRICS: MetricRecord({"tasks": 1})})
        return Message(reply, reply_to=msg)


__all__ = ["MTLClient", "MTLClientError", "flatten", "load_flat", "mean_regularized", "num_parameters",
           "task_id"]
