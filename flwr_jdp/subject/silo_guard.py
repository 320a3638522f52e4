"""A silo's side of subject-level DP: check every train instruction against the plan
the silo derives itself, keep its own ledger, refuse everything else.

The server is not trusted with the silos' data (:mod:`flwr_jdp.privacy.horizontal`),
yet it is the server that tells each silo, every round, its sampling rate, the noise
multiplier and the calibration steps. A silo therefore accepts only what it can
derive from its run config, with the shared guard of :mod:`flwr_jdp.privacy.guard`
(JointDP's owners use the same):

- **public cap** (``max-records-per-subject = K > 0``, the default): the plan uses no
  data, so every silo recomputes it (:func:`flwr_jdp.subject.plan.make_plan`, PLD, as
  the server's strategy by default) before touching any record. It refuses a noise
  multiplier below the plan's, a sampling rate above ``sample-rate``, other
  calibration steps than the plan's, a round outside the plan's rounds or one it
  already released, and every instruction when the plan itself spends more than
  ``target-epsilon``. Its ledger charges, per round, this silo's release about the
  worst-case subject (``K`` records here; a record for ``local-item-dp``), against
  its share of the plan: its own releases over the plan's rounds.
- **reported counts** (``max-records-per-subject = 0``, the paper's reproduction, not
  DP): the noise multiplier is calibrated on every silo's counts, which a silo does
  not have. It checks what it can derive: the rounds, the calibration steps, its own
  rate (``batch-size`` over its own size, read from its data), a fixed
  ``noise-multiplier``, a positive one otherwise; its ledger records its heaviest
  subject's releases, with no budget.

Every run is first held to the node's policy (:mod:`flwr_jdp.privacy.policy`,
:func:`silo_policy`: the run's ``delta``, its unit, ``subject`` or ``record`` for
``local-item-dp``, the add-remove relation; a policy's unit defaults to ``subject``
for silos), at set-up and at every train message. Under a node's policy the silo's
budget is ``min(max-epsilon, its share of the plan)``, its ledger is accounted at the
policy's delta, and what it cannot charge in the policy's terms is refused: the
reported-counts mode (its set-up sends subject counts) and ``local-group-dp``'s
data-dependent noise. Every release is charged to the silo's ledger, and the ledger
saved (``<state-dir>/silos/ledger-<silo>.json`` with node config ``state-dir``, else
``context.state``; under a node's policy every silo of the node charges the node's one
ledger, ``<state-dir>/silos/ledger-node.json``), before the silo trains. A refusal fails closed: no silo of the message
trains, nothing is charged or sent, and the node replies with an error naming the
reason. ``fedavg`` has no privacy to guard (its models are sent un-noised).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import dp_accounting as dpa
from flwr.app import ConfigRecord, Context

from ..privacy import events as ev
from ..privacy.accountants import epsilon
from ..privacy.guard import AgreedRelease, Instruction, InstructionRefused, LedgerStore, charge
from ..privacy.horizontal import SiloRelease
from ..privacy.policy import OwnerPolicy, RunTerms, run_policy
from . import silo_data as sd
from .config import SubjectDPConfig
from .plan import make_plan, over_target, sample_rates, schedule
from .protocol import CALIBRATION_STEPS, NOISE_MULTIPLIER, ROUND, SAMPLE_RATES, SILOS

#: Where silos keep their ledgers: ``<state-dir>/silos/ledger-<i>.json`` (``ledger-node.json``
#: under a node's policy), else ``context.state["silo-ledger.<i>"]``.
SILO_LEDGERS = LedgerStore(party="silo", state_key="silo-ledger")

#: The keys every train instruction must carry (a missing one is refused, never defaulted).
INSTRUCTION_KEYS = (ROUND, SILOS, SAMPLE_RATES, NOISE_MULTIPLIER, CALIBRATION_STEPS)


@dataclass(frozen=True)
class SiloAgreement(AgreedRelease):
    """What one silo accepts each round (:class:`~flwr_jdp.privacy.guard.AgreedRelease`
    with the silo's release event).

    ``records``: the subject's records at this silo the ledger charges for (``K`` under
    the public cap; the silo's heaviest subject with reported counts); ``sampling``:
    of records or of subjects; ``calibration_steps``: the plan's; ``noise_in_instruction``
    False for ``local-group-dp`` with ``group-size = 0`` (its noise comes from the
    batch's group size, not from the instruction); ``refusal``: why every instruction
    is refused (a plan over ``target-epsilon``), or ''."""

    records: int = 0
    sampling: str = "records"
    calibration_steps: int = 0
    noise_in_instruction: bool = True
    refusal: str = ""

    def event(self, instruction: Instruction) -> dpa.DpEvent:
        """This silo's release in one round: record-level DP-SGD (``local-item-dp``), or
        its events about a subject with ``records`` records here."""
        z, q, steps = instruction.noise_multiplier, instruction.sample_rate, instruction.steps
        if self.unit == "record":
            return ev.dp_sgd(z, q, steps)
        if not self.noise_in_instruction:
            return dpa.NoOpDpEvent()  # data-dependent noise: its epsilon is claimed, not accounted
        return SiloRelease(q, z, steps, sampling=self.sampling).subject_event(self.records, 1)

    def check(self, instruction: Instruction) -> str | None:
        if self.refusal:
            return self.refusal
        if not self.noise_in_instruction:
            return self.check_schedule(instruction)
        return super().check(instruction)


def _unit(cfg: SubjectDPConfig) -> str:
    return "record" if cfg.method == "local-item-dp" else "subject"


def _rounds_from(cfg: SubjectDPConfig) -> str:
    return "budget-rounds / sqrt(num-silos)" if cfg.accounting == "sqrt-rounds" else "budget-rounds"


@functools.lru_cache(maxsize=8)
def cap_agreement(cfg: SubjectDPConfig, accountant: str = "pld") -> SiloAgreement:
    """What every silo accepts under the public cap: the plan, recomputed from the run
    config alone (the same for every silo), and the silo's share of it as its budget."""
    plan = make_plan(cfg, None, accountant)
    agreed = SiloAgreement(
        unit=_unit(cfg), max_sample_rate=float(cfg.sample_rate), max_steps=cfg.local_steps,
        fixed_noise=float(plan.noise_multiplier), rounds=int(plan.rounds), budget=math.inf, delta=cfg.delta,
        accountant=accountant, party="silo", rate_from="sample-rate", steps_from="local-steps",
        rounds_from=_rounds_from(cfg),
        noise_from="noise-multiplier" if cfg.noise_multiplier > 0 else "noise multiplier calibrated to target-epsilon",
        once_per_round=True, records=cfg.max_records_per_subject, sampling=cfg.sampling,
        calibration_steps=int(plan.calibration_steps), refusal=over_target(cfg, plan) or "")
    if agreed.refusal:
        return agreed
    planned = agreed.event(Instruction(1, agreed.max_sample_rate, agreed.max_steps, agreed.fixed_noise))
    share = epsilon(dpa.SelfComposedDpEvent(planned, agreed.rounds), cfg.delta, accountant)
    return replace(agreed, budget=float(share))


def reported_agreement(cfg: SubjectDPConfig, silo: int, accountant: str = "pld") -> SiloAgreement:
    """What silo ``silo`` accepts with reported counts (not DP): the rounds and
    calibration steps of the plan, its own rate, a fixed ``noise-multiplier``; no budget."""
    subjects, counts = sd.local_counts(cfg, silo)
    size = len(subjects) if cfg.sampling == "subjects" else int(counts.sum())
    rounds, calibration_steps = schedule(cfg)
    return SiloAgreement(
        unit=_unit(cfg), max_sample_rate=float(sample_rates([size], cfg.batch_size)[0]),
        max_steps=cfg.local_steps, fixed_noise=float(cfg.noise_multiplier), rounds=rounds, budget=math.inf,
        delta=cfg.delta, accountant=accountant, party="silo", rate_from="batch-size and this silo's size",
        steps_from="local-steps", rounds_from=_rounds_from(cfg), once_per_round=True,
        records=int(counts.max()) if len(counts) else 0, sampling=cfg.sampling,
        calibration_steps=calibration_steps,
        noise_in_instruction=not (cfg.method == "local-group-dp" and not cfg.group_size))


def silo_agreement(cfg: SubjectDPConfig, silo: int, accountant: str = "pld") -> SiloAgreement:
    """What silo ``silo`` accepts under ``cfg`` (public cap: no data is read)."""
    return cap_agreement(cfg, accountant) if cfg.public_cap else reported_agreement(cfg, silo, accountant)


def read_instructions(cfg: SubjectDPConfig, conf: object, hosted: set[int]) -> tuple[dict[int, Instruction], int]:
    """Each hosted silo's instruction and the calibration steps, read strictly: every key
    of :data:`INSTRUCTION_KEYS` must be there, one sampling rate per silo, no silo twice."""
    if not isinstance(conf, ConfigRecord):
        raise InstructionRefused("the train instruction has no config record")
    missing = [k for k in INSTRUCTION_KEYS if k not in conf]
    if missing:
        raise InstructionRefused(f"the train instruction lacks {missing}")
    try:
        silos, rates = [int(i) for i in conf[SILOS]], [float(q) for q in conf[SAMPLE_RATES]]
        rnd, z, steps = int(conf[ROUND]), float(conf[NOISE_MULTIPLIER]), int(conf[CALIBRATION_STEPS])
    except (TypeError, ValueError) as err:
        raise InstructionRefused(f"the train instruction has a malformed value ({err})") from None
    if len(rates) != len(silos):
        raise InstructionRefused(f"{len(silos)} silos but {len(rates)} sampling rates")
    if len(set(silos)) != len(silos):
        raise InstructionRefused(f"the train instruction names a silo twice ({silos[:10]})")
    return {i: Instruction(rnd, q, cfg.local_steps, z) for i, q in zip(silos, rates) if i in hosted}, steps


def silo_policy(context: Context, cfg: SubjectDPConfig) -> OwnerPolicy:
    """The policy the run ``cfg`` is held to on this silo's node
    (:func:`flwr_jdp.privacy.policy.run_policy`); under a node's own policy the
    reported-counts mode is refused. Raises :class:`InstructionRefused`."""
    terms = RunTerms(target_epsilon=float(cfg.target_epsilon), delta=float(cfg.delta), unit=_unit(cfg),
                     neighbouring="add-remove", placement="local", private=cfg.private,
                     noise_seed=int(cfg.noise_seed),
                     keys={"unit": "method", "placement": "method", "private": "method", "noise_seed": "noise-seed"})
    policy = run_policy(context.node_config, terms, party="silo", default_unit="subject")
    if not policy.trusts_run and not cfg.public_cap:
        raise InstructionRefused(f"run-config key 'max-records-per-subject'={cfg.max_records_per_subject} (reported "
                                 f"counts: the set-up sends every silo's subject counts, not DP); this node's policy "
                                 f"({policy.source}) accepts DP runs only")
    return policy


def charge_silos(cfg: SubjectDPConfig, context: Context, conf: object, hosted: set[int],
                 accountant: str = "pld") -> tuple[dict[int, Instruction], int]:
    """Read the train instruction, check every hosted silo's part against its agreement
    and its own ledger, and charge and save each ledger, all before any silo trains.
    The run is first held to the node's policy (:func:`silo_policy`): each silo's
    budget is then at most the policy's ``max-epsilon``, at the policy's delta.
    Returns each hosted silo's instruction and the calibration steps; raises
    :class:`~flwr_jdp.privacy.guard.InstructionRefused` (nothing charged) otherwise."""
    policy = silo_policy(context, cfg)
    instructions, calibration_steps = read_instructions(cfg, conf, hosted)
    if not cfg.private or not instructions:
        return instructions, calibration_steps
    requests = {}
    for i, instruction in instructions.items():
        agreed = silo_agreement(cfg, i, accountant)
        if not (policy.trusts_run or agreed.noise_in_instruction):
            raise InstructionRefused(f"silo {i}: run-config key 'group-size'=0 (local-group-dp's data-dependent "
                                     f"noise) cannot be charged in this node's policy's terms ({policy.source})")
        agreed = replace(agreed, budget=policy.budget(agreed.budget), delta=policy.delta)
        if not agreed.refusal and calibration_steps != agreed.calibration_steps:
            raise InstructionRefused(
                f"silo {i}: calibration-steps {calibration_steps}, agreed {agreed.calibration_steps} "
                "(from local-steps, budget-rounds and accounting)")
        requests[i] = (agreed, instruction)
    charge(context, SILO_LEDGERS, requests, _unit(cfg), note=cfg.method, node_ledger=not policy.trusts_run)
    return instructions, calibration_steps


__all__ = ["INSTRUCTION_KEYS", "SILO_LEDGERS", "SiloAgreement", "cap_agreement", "charge_silos",
           "read_instructions", "reported_agreement", "silo_agreement", "silo_policy"]
