"""flwr-jdp's own ClientApp (``flwr run apps/joint_dp``, ``flwr run .``), written as a user's Flower app.

It is an ordinary Flower app on the package's client half, the same one a user's app
uses (:class:`~flwr_jdp.client.JointDPClient`, hosted several owners to a
node by :func:`~flwr_jdp.joint_dp.client.hosting_mod`) around the app's own model,
data, ``train`` and ``test`` (:mod:`.task`). flwr-jdp's client half does the privacy: it checks and charges each
instruction, fits the personal layers, runs DP-SGD at the server's schedule inside
``train`` and sends only the shared release.

What this app adds as its own (no privacy cost; nothing it computes is sent):

- ``personal-learning-rate``: the rate ``train`` uses when it fits the personal
  layers (shared layers frozen); ``learning-rate`` everywhere else;
- ``augment-shift``: random translation of the owner's own training batches (never
  of the Poisson batches of a DP release);
- ``finetune-epochs``: after the last round each owner evaluates a copy of its model
  adapted to its own records (every parameter, ``finetune-learning-rate``).

The run config is the app's flat ``[tool.flwr.app.config]`` (every key is
flwr-jdp's); a node's ``data-dir`` (node config) overrides the run config's.
"""

from __future__ import annotations

import copy

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader

from flwr_jdp.client import JointDPClient
from flwr_jdp.data.partition import OwnerData
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import hosting_mod, owner_id
from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.owner_store import owner_generator, trained_rounds

from .task import initial_model, loader, node_job_config, owner_data, test, train

#: Offsets of the app's own randomness streams (batch order, augmentation) from the
#: client half's (sampling and noise of round r use stream r), so none is reused.
_TRAIN_STREAM = 10**6
_EVAL_STREAM = 2 * 10**6
_ADAPT_STREAM = 3 * 10**6


def _data(context: Context) -> tuple[JobConfig, OwnerData]:
    cfg = node_job_config(context)
    return cfg, owner_data(cfg)[owner_id(context)]


def _train_fn(cfg: JobConfig, own: DataLoader, generator: torch.Generator):
    """``train`` as the client half calls it: on the owner's own loader (fitting the
    personal layers, or training without a DP release) it may augment, and fits
    personal layers at ``personal-learning-rate``; on the Poisson loader of a DP
    release it runs unaugmented at ``learning-rate``."""
    def fn(model: nn.Module, loader: DataLoader) -> None:
        mine = loader is own
        lr = cfg.personal_learning_rate if mine and cfg.decoupled else cfg.learning_rate
        train(model, loader, epochs=cfg.local_epochs, lr=lr,
              augment_shift=cfg.augment_shift if mine else 0, generator=generator)
    return fn


app = ClientApp(mods=[hosting_mod("num-owners", standalone_hosts_all=True)])
jdp = JointDPClient(
    app,
    model_fn=lambda context: initial_model(node_job_config(context)),
    train_data=lambda context: loader(*_data(context), torch.Generator()),
    user_ids=lambda context: _data(context)[1].user_ids,
    config_fn=node_job_config,
)


@app.train()
def train_owner(msg: Message, context: Context) -> Message:
    """One owner's round: the client half around the app's ``train``."""
    torch.set_num_threads(1)
    cfg, data = _data(context)
    server_round = int(msg.content[protocol.CONFIG].get(protocol.ROUND, 0))
    generator = owner_generator(cfg, _TRAIN_STREAM + server_round, data.owner_id)
    own = loader(cfg, data, generator)
    return jdp.train(msg, context, initial_model(cfg), own, _train_fn(cfg, own, generator))


@app.evaluate()
def evaluate_owner(msg: Message, context: Context) -> Message:
    """The owner's own model (broadcast shared layers, its personal layers fitted on
    that broadcast) on its own test split. Evaluation metrics are not covered by the
    DP guarantee."""
    torch.set_num_threads(1)
    cfg, data = _data(context)
    config = msg.content[protocol.CONFIG]
    server_round = int(config.get(protocol.ROUND, 0))
    generator = owner_generator(cfg, _EVAL_STREAM + server_round, data.owner_id)
    own = loader(cfg, data, generator)
    model = jdp.load(initial_model(cfg), msg, context, fit=lambda m: _train_fn(cfg, own, generator)(m, own))
    if cfg.finetune_epochs > 0 and server_round >= cfg.num_rounds:
        model = copy.deepcopy(model)  # the owner's adapted copy: never stored, never sent
        adapt = owner_generator(cfg, _ADAPT_STREAM + server_round, data.owner_id)
        train(model, loader(cfg, data, adapt), epochs=cfg.finetune_epochs, lr=cfg.finetune_learning_rate,
              augment_shift=cfg.augment_shift, generator=adapt)
    loss, accuracy = test(model, data.x_test, data.y_test)
    session = str(config.get(protocol.SESSION, ""))
    metrics = MetricRecord({protocol.NUM_EXAMPLES: len(data.y_test), protocol.ACCURACY: accuracy,
                            protocol.LOSS: loss, protocol.PERSONAL_ROUNDS: trained_rounds(context, data.owner_id,
                                                                                          session)})
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)
