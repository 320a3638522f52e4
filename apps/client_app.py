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
:mod:`flwr_jdp.training.owner_round`.
"""

from __future__ import annotations

from logging import DEBUG, WARNING

import torch
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from flwr_jdp import protocol
from flwr_jdp.config import JobConfig
from flwr_jdp.privacy.owner_guard import Instruction, InstructionRefused, agreed_release
from flwr_jdp.privacy.schedule import OwnerSize
from flwr_jdp.privacy.units import NoisePlacement, PrivacyUnit
from flwr_jdp.training import OwnerPlan, adapted_model, evaluate, fit_personal, train_owner_round
from flwr_jdp.training.dp_sgd import preload_opacus

from .owner_state import (
    load_owner_ledger,
    load_owner_model,
    my_owners,
    node_job_config,
    num_classes,
    owner_data,
    owner_generator,
    personal_fit_on,
    public_personal,
    save_owner_ledger,
    save_personal,
    shared_arrays,
    shared_digest,
    trained_rounds,
)

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


def _instructions(cfg: JobConfig, cfg_rec: ConfigRecord, owners: list[int]) -> dict[int, Instruction]:
    """Each requested owner's instruction, read strictly: under DP every key must be
    there, one value per owner (a missing key is refused, never defaulted)."""
    if not cfg.dp:
        return {o: Instruction(int(cfg_rec.get(protocol.ROUND, 0)), 1.0, 1, 0.0) for o in owners}
    missing = [k for k in (protocol.ROUND, protocol.OWNERS, protocol.SAMPLE_RATES, protocol.STEPS,
                           protocol.NOISE_MULTIPLIER, protocol.SESSION) if k not in cfg_rec]
    if missing:
        raise InstructionRefused(f"the train instruction lacks {missing}")
    wanted = [int(o) for o in cfg_rec[protocol.OWNERS]]
    rates, steps = list(cfg_rec[protocol.SAMPLE_RATES]), list(cfg_rec[protocol.STEPS])
    if not len(rates) == len(steps) == len(wanted):
        raise InstructionRefused(f"{len(wanted)} owners but {len(rates)} sampling rates and "
                                 f"{len(steps)} step counts")
    z = float(cfg_rec[protocol.NOISE_MULTIPLIER])
    rnd = int(cfg_rec[protocol.ROUND])
    by_owner = {o: Instruction(rnd, float(q), int(n), z) for o, q, n in zip(wanted, rates, steps)}
    return {o: by_owner[o] for o in owners}


def _charge_owners(cfg: JobConfig, context: Context, data, instructions: dict[int, Instruction],
                   session: str) -> None:
    """Local noise: every owner checks its instruction against what it agreed to and
    against its own ledger, then records the release in its ledger and saves it,
    before anything is trained. Any refusal refuses the whole message (nothing is
    recorded, trained or sent)."""
    if not (cfg.dp and cfg.placement is NoisePlacement.LOCAL):
        return
    cap = context.node_config.get("max-epsilon")
    reasons, ledgers = [], {}
    for o, instruction in instructions.items():
        size = OwnerSize(len(data[o].y_train), data[o].num_users)
        agreed = agreed_release(cfg, size, None if cap is None else float(cap))
        reason = agreed.check(instruction)
        ledger = load_owner_ledger(context, o, session, agreed, cfg.privacy_unit)
        event = agreed.event(instruction)
        reason = reason or ledger.check(event)
        if reason:
            reasons.append(f"owner {o}: {reason}")
        ledgers[o] = (ledger, event)
    if reasons:
        raise InstructionRefused("; ".join(reasons))
    for o, (ledger, event) in ledgers.items():
        ledger.record(instructions[o].server_round, event, note=f"session {session}")
        save_owner_ledger(context, o, session, ledger)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train every requested owner hosted here; reply with shared releases only.

    Under local noise each owner first checks the instruction and charges its own
    ledger (:mod:`flwr_jdp.privacy.owner_guard`); a refused instruction gets an
    error reply that names the reason, and nothing is trained or released."""
    torch.set_num_threads(1)
    cfg = node_job_config(context)
    cfg_rec = msg.content[protocol.CONFIG]
    session = str(cfg_rec.get(protocol.SESSION, ""))
    data = owner_data(cfg)
    owners = _requested(msg, my_owners(cfg, context))
    try:
        instructions = _instructions(cfg, cfg_rec, owners)
        _charge_owners(cfg, context, data, instructions, session)
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
        release, loss = train_owner_round(model, split, data[o], cfg, plan, generator, public)
        save_personal(context, o, model, split, session, fit_on=digest)
        log(DEBUG, "owner %d round %d: local train loss %.4f (not sent)", o, instruction.server_round, loss)
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
