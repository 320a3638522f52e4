"""The subject-level DP ClientApp (its ServerApp: :mod:`subject_dp.server_app`).

A SuperNode with ``partition-id = p`` of ``num-partitions = P`` hosts silos
``p, p + P, ...`` (FEMNIST writers or Shakespeare characters as subjects, by the
``dataset`` key, spread over ``num-silos`` silos by ``alpha``; data built once per
process; in the default public-cap mode each silo keeps at most
``max-records-per-subject`` records of each subject). Each silo checks the train
instruction against the plan it derives from its run config and charges its own
ledger (:mod:`flwr_jdp.subject.silo_guard`; a refusal is an error reply naming the
reason), then trains the received model with the configured mechanism
(:mod:`flwr_jdp.training.subject_level`) and replies with its noised model. Run with
``flwr run apps/subject_dp`` or ``examples/subject_dp/femnist.py`` (the same apps on an
in-process grid).
"""

from __future__ import annotations

from logging import WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from flwr_jdp.privacy.guard import InstructionRefused
from flwr_jdp.privacy.mechanisms import torch_generator
from flwr_jdp.records import hosted_owners
from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.group_privacy import group_noise_multiplier
from flwr_jdp.subject.protocol import CONFIG, MODEL, SETUP, SILOS, STATS, load_arrays, model_arrays, silo_key
from flwr_jdp.subject.silo_guard import charge_silos, silo_policy
from flwr_jdp.subject.task import build_subject_model
from flwr_jdp.training.subject_level import BatchStats, SiloPlan, train_silo_round

client = ClientApp()


def _hosted(context: Context, num_silos: int) -> list[int]:
    pid = int(context.node_config.get("partition-id", 0))
    parts = int(context.node_config.get("num-partitions", 1))
    return hosted_owners(num_silos, pid, parts)


@client.query()
def setup(msg: Message, context: Context) -> Message:
    """List this node's silos (node configuration, not data). Only in the
    reported-counts mode (``max-records-per-subject = 0``, not DP) also each silo's
    subject ids and per-subject record counts; the public-cap mode sends nothing else.
    A run the node's policy refuses (:func:`~flwr_jdp.subject.silo_guard.silo_policy`)
    gets an error reply naming the run-config key, before any count is read."""
    cfg = parse_subject_config(context.run_config)
    try:
        silo_policy(context, cfg)
    except InstructionRefused as err:
        log(WARNING, "Refused the run at set-up: %s", err)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused: {err}"), reply_to=msg)
    silos = _hosted(context, cfg.num_silos)
    content = RecordDict({SETUP: ConfigRecord({SILOS: silos})})
    for i in silos if not cfg.public_cap else ():
        subjects, counts = sd.local_counts(cfg, i)
        content[silo_key(i)] = ArrayRecord({"subjects": Array(subjects), "counts": Array(counts)})
    return Message(content, reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    """Train each requested silo from the global model with its mechanism, after every
    silo has checked the instruction against the plan it derives itself and charged
    its own ledger (:mod:`flwr_jdp.subject.silo_guard`). A refused instruction gets an
    error reply naming the reason: nothing is trained, charged or sent."""
    torch.set_num_threads(1)
    cfg = parse_subject_config(context.run_config)
    try:
        if MODEL not in msg.content.array_records:
            raise InstructionRefused(f"the train instruction lacks the '{MODEL}' record")
        instructions, calibration_steps = charge_silos(cfg, context, msg.content.get(CONFIG),
                                                       set(_hosted(context, cfg.num_silos)))
    except InstructionRefused as err:
        log(WARNING, "Refused the train instruction (nothing trained or sent): %s", err)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused: {err}"), reply_to=msg)
    arrays = {k: v.numpy() for k, v in msg.content[MODEL].items()}
    content = RecordDict()
    stats = BatchStats()
    for i, instruction in instructions.items():
        q, z, rnd = instruction.sample_rate, instruction.noise_multiplier, instruction.server_round

        def group_noise(size: int, q: float = q) -> float:
            return group_noise_multiplier(size, cfg.target_epsilon, cfg.delta, q, calibration_steps)
        plan = SiloPlan(cfg.method, q, cfg.local_steps, cfg.learning_rate, cfg.clipping_norm, z,
                        group_noise if cfg.method == "local-group-dp" and not cfg.group_size else None,
                        sampling=cfg.sampling, records_per_subject=cfg.records_per_subject,
                        group_size=cfg.group_size,
                        normaliser=float(cfg.batch_size) if cfg.public_cap else 0.0)  # public divisor
        model = build_subject_model(cfg)
        load_arrays(model, arrays)
        seed = None if cfg.noise_seed < 0 else cfg.noise_seed * 1_000_003 + rnd * 1009 + i
        train_silo_round(model, sd.silo_data(cfg, i), plan, torch_generator(seed), stats)
        content[silo_key(i)] = ArrayRecord({k: Array(v) for k, v in model_arrays(model).items()})
    if cfg.report_batch_stats:  # reported counts only (refused under the public cap): not DP
        content[STATS] = ArrayRecord({
            "group_sizes": Array(np.asarray(stats.group_sizes, dtype=np.int64)),
            "distinct_subjects": Array(np.asarray(stats.distinct_subjects, dtype=np.int64))})
    return Message(content, reply_to=msg)
