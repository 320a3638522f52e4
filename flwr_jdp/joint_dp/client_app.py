"""The joint-DP ClientApp: one SuperNode hosts one or more owners.

For every owner it is asked to train, the node restores the owner's personal
parameters from ``context.state``, loads the global shared parameters, trains
(shared parameters with the configured DP mechanism, personal ones without noise),
stores the personal parameters back in ``context.state`` and replies with the
owner's release of shared parameters only.

Under the decoupled coupling (joint-DP, record or user unit; the default) the
release is computed with the personal parameters at their public initial values,
and the owner's personal parameters are fitted on the broadcast shared parameters
once per broadcast (at evaluation or at the next round, whichever comes first); see
:mod:`flwr_jdp.joint_dp.owner_round`.
"""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.owner_guard import InstructionRefused
from flwr_jdp.joint_dp.owner_round import OwnerPlan, adapted_model, fit_personal, train_owner_round
from flwr_jdp.joint_dp.owner_state import (
    load_owner_model,
    my_owners,
    node_job_config,
    num_classes,
    owner_data,
    owner_generator,
    personal_fit_on,
    public_personal,
    save_personal,
    shared_arrays,
    shared_digest,
    trained_rounds,
)
from flwr_jdp.joint_dp.owner_store import charge_owners, read_instructions
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.privacy.units import PrivacyUnit
from flwr_jdp.training import evaluate
from flwr_jdp.training.dp_sgd import preload_opacus

#: Offset of the adaptation's randomness stream from the rounds' streams (training uses
#: round r, fitting personal layers at evaluation -r), so no stream is reused.
_ADAPTATION_STREAM = 10**6

app = ClientApp()


def _requested(msg: Message, hosted: list[int]) -> list[int]:
    cfg_rec = msg.content[protocol.CONFIG]
    wanted = [int(o) for o in cfg_rec.get(protocol.OWNERS, [])]
    return [o for o in wanted if o in set(hosted)]


@app.query()
def setup(msg: Message, context: Context) -> Message:
    """Report the owners this node hosts and their data sizes (public metadata)."""
    cfg = node_job_config(context)
    owners = my_owners(cfg, context)
    data = owner_data(cfg)
    first = data[owners[0]] if owners else data[0]
    rec = ConfigRecord(
        {
            protocol.OWNER_IDS: owners,
            protocol.NUM_RECORDS: [len(data[o].y_train) for o in owners],
            protocol.NUM_USERS: [data[o].num_users for o in owners],
            protocol.IMAGE_SHAPE: [int(v) for v in first.x_train.shape[1:]],
            protocol.NUM_CLASSES: num_classes(cfg),
        }
    )
    if cfg.dp and cfg.unit is not PrivacyUnit.OWNER:  # its releases need per-sample gradients
        preload_opacus()  # after the data are loaded: the two would compete for the CPU
    return Message(RecordDict({protocol.SETUP: rec}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train every requested owner hosted here; reply with shared releases only.

    Under local noise each owner first checks the instruction and charges its own
    ledger (:mod:`flwr_jdp.joint_dp.owner_guard`); a refused instruction gets an
    error reply that names the reason, and nothing is trained or released."""
    torch.set_num_threads(1)
    cfg = node_job_config(context)
    cfg_rec = msg.content[protocol.CONFIG]
    session = str(cfg_rec.get(protocol.SESSION, ""))
    data = owner_data(cfg)
    owners = _requested(msg, my_owners(cfg, context))
    try:
        instructions = read_instructions(cfg, cfg_rec, owners)
        charge_owners(cfg, context, {o: OwnerSize(len(data[o].y_train), data[o].num_users) for o in owners},
                      instructions, session)
    except InstructionRefused as err:
        log(WARNING, "Refused the train instruction (nothing trained or sent): %s", err)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             reason=f"refused: {err}"), reply_to=msg)
    shared = shared_arrays(msg.content[protocol.SHARED])  # deserialised once per message
    reply = RecordDict()
    digest = shared_digest(shared) if cfg.decoupled else ""
    for o in owners:
        instruction = instructions[o]
        model, split = load_owner_model(cfg, context, data[o], shared, session)
        plan = OwnerPlan(instruction.sample_rate, instruction.steps, instruction.noise_multiplier)
        generator = owner_generator(cfg, instruction.server_round, o)
        public = None
        if cfg.decoupled:
            if personal_fit_on(context, o, session) != digest:
                fit_personal(model, split, data[o], cfg, generator)
            public = public_personal(cfg, data[o])
        release, _ = train_owner_round(model, split, data[o], cfg, plan, generator, public)  # loss: not sent
        save_personal(context, o, model, split, session, fit_on=digest)
        reply[protocol.owner_key(o)] = protocol.to_record(
            {name: release[name] for name in split.shared}  # shared names only
        )
        reply[protocol.metrics_key(o)] = MetricRecord({protocol.NUM_EXAMPLES: len(data[o].y_train)})
    return Message(reply, reply_to=msg)


@app.evaluate()
def evaluate_owners(msg: Message, context: Context) -> Message:
    """Each requested owner evaluates its own model (shared + personal) on its own
    test split. Evaluation metrics are not covered by the DP guarantee.

    With ``finetune-epochs`` > 0 (joint DP) the model evaluated after the last round
    (``num-rounds``) is a copy adapted to the owner's own training records
    (:func:`adapted_model`); it is discarded after evaluation, so nothing the owner
    stores or sends depends on it. Earlier rounds evaluate the unadapted model
    (adapting every owner every round would multiply the cost of a run)."""
    torch.set_num_threads(1)
    cfg = node_job_config(context)
    shared = shared_arrays(msg.content[protocol.SHARED])  # deserialised once per message
    session = str(msg.content[protocol.CONFIG].get(protocol.SESSION, ""))
    data = owner_data(cfg)
    reply = RecordDict()
    digest = shared_digest(shared) if cfg.decoupled else ""
    server_round = int(msg.content[protocol.CONFIG].get(protocol.ROUND, 0))
    for o in _requested(msg, my_owners(cfg, context)):
        model, split = load_owner_model(cfg, context, data[o], shared, session)
        if cfg.decoupled and personal_fit_on(context, o, session) != digest:
            # The owner's model is the broadcast plus personal parameters fitted on it.
            fit_personal(model, split, data[o], cfg, owner_generator(cfg, -server_round, o))
            save_personal(context, o, model, split, session, fit_on=digest, count_round=False)
        if cfg.finetune_epochs > 0 and server_round >= cfg.num_rounds:
            model = adapted_model(model, data[o], cfg, owner_generator(cfg, -server_round - _ADAPTATION_STREAM, o))
        loss, acc = evaluate(model, data[o].x_test, data[o].y_test)
        reply[protocol.metrics_key(o)] = MetricRecord(
            {protocol.NUM_EXAMPLES: len(data[o].y_test), protocol.ACCURACY: acc, protocol.LOSS: loss,
             protocol.PERSONAL_ROUNDS: trained_rounds(context, o, session)}
        )
    return Message(reply, reply_to=msg)
