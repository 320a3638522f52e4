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

import dp_accounting as dpa
import numpy as np
import torch
from flwr.app import Context

from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.owner_guard import AgreedRelease, Instruction, owner_policy
from flwr_jdp.joint_dp.owner_store import OWNER_LEDGERS
from flwr_jdp.joint_dp.schedule import owner_plan
from flwr_jdp.joint_dp.secure_sum import MIN_NODES, _check_setup, secure_sum_mod  # noqa: F401 (re-exported)
from flwr_jdp.privacy.guard import charge
from flwr_jdp.privacy.skellam import SkellamPlan, round_units, skellam_noise, to_field


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
    charge(context, OWNER_LEDGERS, {owner: (agreed, instruction)}, cfg.privacy_unit, note=f"session {session}",
           node_ledger=not policy.trusts_run)
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


__all__ = ["MIN_NODES", "AgreedDistributed", "UnitEncoder", "agreed_distributed", "charge_distributed", "encode_release",
           "owner_plan", "secure_sum_mod"]
