"""The owner's side of distributed noise (``noise-placement = "distributed"``).

Each round of the central protocol (one Poisson sample of every owner's units, one
step), an owner:

1. checks the instruction against its own plan and charges its own ledger before any
   data is read (:func:`charge_distributed`): the noise multiplier must keep the run's
   ``num-rounds`` rounds of the owner's own accounting of the released sum within
   its budget (``target-epsilon``, or its node's policy's ``max-epsilon`` if smaller,
   at the policy's delta), and the noise share it adds is computed here, never taken
   from the server: from the run config (``num-owners``, ``dropout-tolerance``,
   ``colluding-owners``), but never below ``mu / honest-owners`` of its node's policy
   (:mod:`flwr_jdp.privacy.policy` states why the ledger may then charge ``mu``);
2. rounds each unit's scaled clipped gradient to integers in the DP pass
   (:class:`UnitEncoder`), sums them, adds its Skellam share and reduces the sum
   modulo :data:`~flwr_jdp.privacy.skellam.MODULUS` (:func:`encode_release`);
3. hands that vector to Flower's SecAgg+ client mod (:func:`secure_sum_mod`), which
   masks it: the server only ever holds masked vectors and, once it unmasks, the sum
   over the surviving nodes.

Unit, sensitivity and noise are stated in :mod:`flwr_jdp.privacy.skellam`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from logging import WARNING

import dp_accounting as dpa
import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, log, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig, minimum_survivors
from flwr_jdp.joint_dp.owner_guard import AgreedRelease, Instruction, owner_policy
from flwr_jdp.joint_dp.owner_store import OWNER_LEDGERS
from flwr_jdp.privacy.guard import charge
from flwr_jdp.privacy.skellam import MODULUS, SkellamPlan, round_units, skellam_noise, to_field


def owner_plan(cfg: JobConfig, noise_multiplier: float, dim: int, scale: float) -> SkellamPlan:
    """The Skellam plan of a run: the server's and every owner's (same formula)."""
    return SkellamPlan(
        clipping_norm=float(cfg.clipping_norm), scale=float(scale), dim=int(dim),
        noise_multiplier=float(noise_multiplier), num_owners=int(cfg.num_owners),
        min_survivors=minimum_survivors(cfg.num_owners, cfg.dropout_tolerance),
        colluding=int(cfg.colluding_owners))


@dataclasses.dataclass(frozen=True)
class AgreedDistributed(AgreedRelease):
    """What an owner accepts under distributed noise: one Poisson-sampled secure sum per
    round at any rate in (0, 1] (the rate the owner samples its own units at is the
    one it accounts), with a noise multiplier whose ``rounds`` rounds stay within the
    budget, at the scale the server announced (accounted exactly, whatever it is)."""

    dim: int = 0
    scale: float = 1.0
    cfg: JobConfig | None = None

    def event(self, instruction: Instruction) -> dpa.DpEvent:
        assert self.cfg is not None
        return owner_plan(self.cfg, instruction.noise_multiplier, self.dim, self.scale).event(
            instruction.sample_rate)


def agreed_distributed(cfg: JobConfig, dim: int, scale: float, max_epsilon: float | None,
                       delta: float | None = None) -> AgreedDistributed:
    budget = cfg.target_epsilon if max_epsilon is None else min(cfg.target_epsilon, float(max_epsilon))
    return AgreedDistributed(
        unit=cfg.unit, max_sample_rate=1.0, max_steps=1, fixed_noise=float(cfg.noise_multiplier),
        rounds=int(cfg.num_rounds), budget=float(budget), delta=float(cfg.delta if delta is None else delta),
        accountant="rdp",
        neighbouring=cfg.neighbouring, rate_from="a probability", steps_from="one step per round",
        dim=int(dim), scale=float(scale), cfg=cfg)


def charge_distributed(cfg: JobConfig, context: Context, owner: int, instruction: Instruction,
                       dim: int, scale: float, session: str) -> SkellamPlan:
    """Check the instruction against the owner's own plan and ledger, charge and save
    the ledger (:func:`flwr_jdp.privacy.guard.charge`) in its node's policy's terms,
    and return the plan whose noise share the owner adds: the run's share, never less
    than ``mu`` over the policy's ``honest-owners``. Raises
    :class:`~flwr_jdp.privacy.guard.InstructionRefused`."""
    from flwr_jdp.privacy.guard import InstructionRefused

    if not (np.isfinite(scale) and scale >= 1.0 / cfg.clipping_norm):
        raise InstructionRefused(f"scale {scale!r} is not a number >= 1 / clipping-norm")
    policy = owner_policy(context, cfg)
    agreed = agreed_distributed(cfg, dim, scale, policy.max_epsilon, policy.delta)
    charge(context, OWNER_LEDGERS, {owner: (agreed, instruction)}, cfg.privacy_unit, note=f"session {session}")
    return owner_plan(cfg, instruction.noise_multiplier, dim, scale).with_honest_floor(policy.honest_owners)


class UnitEncoder:
    """Turns the rows of one Poisson batch's clipped per-unit gradients (units x d) into
    the integer sum of their conditionally rounded, scaled values (float64, exact)."""

    def __init__(self, plan: SkellamPlan, rng: np.random.Generator) -> None:
        self.plan = plan
        self.rng = rng
        self.units = 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        scaled = rows.detach().to(torch.float64).cpu().numpy() * self.plan.scale
        self.units += scaled.shape[0]
        rounded = round_units(scaled, self.plan.delta_2, self.rng)
        return torch.from_numpy(rounded.sum(axis=0).astype(np.float64))


def encode_release(integer_sum: list[np.ndarray], plan: SkellamPlan, rng: np.random.Generator) -> list[np.ndarray]:
    """The owner's vector for the secure sum: its integer sum plus its noise share
    ``Sk(share_mu)`` in every coordinate, reduced modulo :data:`MODULUS` (int64)."""
    out = []
    for a in integer_sum:
        ints = np.rint(np.asarray(a, dtype=np.float64)).astype(np.int64)
        noisy = ints + skellam_noise(ints.size, plan.share_mu, rng).reshape(ints.shape)
        out.append(to_field(noisy))
    return out


def secure_sum_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: messages of Flower's SecAgg+ protocol go through Flower's
    ``secaggplus_mod``; at its collect stage the app's train handler runs (through the
    app's other mods) and the sum of its reply's arrays (one record per owner the node
    hosts, each already an element vector modulo :data:`MODULUS`) is what SecAgg+
    masks. The reply then carries nothing else: no per-owner count or metric. Other
    messages pass through. :class:`~flwr_jdp.client.JointDPClient` puts it first on
    the user's ClientApp."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    _check_setup(msg.content.config_records[RECORD_KEY_CONFIGS])

    def train(inner: Message, ctx: Context) -> Message:
        reply = call_next(inner, ctx)
        if reply.has_error():  # refused or failed: this node drops out of the secure sum
            raise RuntimeError(reply.error.reason)
        cfg_rec = inner.content.config_records.get(protocol.CONFIG)
        wanted = len(list(cfg_rec.get(protocol.OWNERS, []))) if cfg_rec is not None else 0
        if len(reply.content.array_records) != wanted:
            # an owner of this node failed: its noise share would be missing from the sum the server
            # unmasks, which counts this node's owners as survivors, so the whole node leaves the round
            raise RuntimeError(f"{wanted - len(reply.content.array_records)} of this node's {wanted} owners "
                               "did not release; the node leaves the secure sum")
        total: list[np.ndarray] | None = None
        for record in reply.content.array_records.values():
            arrays = [np.asarray(a, dtype=np.int64) for a in record.to_numpy_ndarrays()]
            if np.any([np.any((a < 0) | (a >= MODULUS)) for a in arrays]):
                raise RuntimeError("the release is not a vector of field elements")
            total = arrays if total is None else [np.mod(t + a, MODULUS) for t, a in zip(total, arrays, strict=True)]
        if total is None:
            raise RuntimeError("the train handler replied without arrays")
        # SecAgg+ maps x in [-M/2, M/2] to x + M/2 (clipping range M/2, M levels): exact for these integers
        params = [a.astype(np.float64) - MODULUS / 2 for a in total]
        fitres = FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(params), num_examples=1,
                        metrics={})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=inner)

    try:
        return secaggplus_mod(msg, context, train)
    except Exception:
        log(WARNING, "Secure aggregation: this node leaves the round (see the error above)")
        raise


#: The fewest nodes a secure sum may hold at any stage. Flower's SecAgg+ seeds each mask's
#: generator with 32 bits of its key: with two nodes only one pairwise mask hides a node's
#: vector once the server has unmasked, which a search of 2**32 seeds could remove; with three
#: or more, at least two masks (64 bits) remain.
MIN_NODES = 3


def _check_setup(rec: ConfigRecord) -> None:
    """A node takes part only in the secure sum flwr-jdp's server plans: the field and
    its encoding as :func:`secure_sum_mod` uses them, unit weights, and a reconstruction
    threshold of at least :data:`MIN_NODES` (an honest server's; a node cannot check the
    others' replies)."""
    if rec.get(Key.STAGE) != Stage.SETUP:
        return
    expected = {Key.CLIPPING_RANGE: float(MODULUS // 2), Key.TARGET_RANGE: MODULUS, Key.MOD_RANGE: MODULUS,
                Key.MAX_WEIGHT: 1.0}
    wrong = [k for k, v in expected.items() if rec.get(k) != v]
    if wrong or int(rec.get(Key.THRESHOLD, 0)) < MIN_NODES:
        raise RuntimeError(f"secure aggregation set-up refused: {wrong or 'threshold'} not as flwr-jdp plans it "
                           f"(ranges 2**31, unit weights, threshold >= {MIN_NODES})")


__all__ = ["MIN_NODES", "AgreedDistributed", "UnitEncoder", "agreed_distributed", "charge_distributed", "encode_release",
           "owner_plan", "secure_sum_mod"]
