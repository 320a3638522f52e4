"""Owner budgets the server plans for (local noise): a node's own cap, node config
``max-epsilon``, reported at set-up and met by the noise the server asks for.

A SuperNode may cap the budget of the owners it hosts below the run's
``target-epsilon`` with its policy's ``max-epsilon`` (:mod:`flwr_jdp.privacy.policy`;
absent: no policy, no cap). The cap is
public metadata, like the owners' sizes: every owner reports it at set-up
(:data:`flwr_jdp.joint_dp.protocol.MAX_EPSILON`), and under ``noise-placement =
"local"`` the server plans for it:

- owners without a cap, or with a cap >= ``target-epsilon``, add the run's noise
  multiplier (calibrated for ``target-epsilon``, or the fixed ``noise-multiplier``);
- the owners with the same cap ``c < target-epsilon`` form a group whose noise
  multiplier is calibrated for ``c`` by the same function as the run's
  (:func:`~flwr_jdp.joint_dp.schedule.calibrate_schedule`: the same rounds, the
  group's own sampling rates and steps, the run's accountant, delta and
  neighbouring relation), so that the most exposed owner of the group reaches ``c``
  after ``num-rounds`` rounds and none exceeds it.

The ledger records each owner's release with its own multiplier (one scope per
owner), so each owner's epsilon and the run's (the maximum over owners) are exact.
Each owner still checks its instruction against its own budget, ``min(max-epsilon,
target-epsilon)`` (:mod:`flwr_jdp.joint_dp.owner_guard`), and refuses less noise.

A fixed ``noise-multiplier`` is the noise the run was configured with: a capped
owner it cannot keep within its cap over ``num-rounds`` rounds fails the start-up
(:func:`unmet_caps`), naming the owner, its node, the node config key and the
run-config keys, before anything is spent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr_jdp.joint_dp.config import JobConfig
from flwr_jdp.joint_dp.schedule import Schedule, calibrate_schedule
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.policy import OwnerPolicy

#: The node config key of an owner's own cap.
NODE_KEY = "max-epsilon"


def node_max_epsilon(node_config: Mapping[str, Any]) -> float | None:
    """The cap a node sets on its owners' budget (node config ``max-epsilon``), or
    None without one; a value that is not a finite number > 0 is a
    :class:`ConfigError` naming the node config key (read as the node's policy reads
    it, :class:`flwr_jdp.privacy.policy.OwnerPolicy`, which also reads a policy file)."""
    if node_config.get(NODE_KEY) is None:
        return None
    return OwnerPolicy.from_mapping({NODE_KEY: node_config[NODE_KEY]}).max_epsilon


def owner_budget(cfg: JobConfig, cap: float | None) -> float:
    """The epsilon an owner with ``cap`` may spend: ``min(cap, target-epsilon)``."""
    return float(cfg.target_epsilon) if cap is None else min(float(cfg.target_epsilon), float(cap))


@dataclass(frozen=True)
class BudgetGroup:
    """Owners planned for the same budget, with the noise multiplier they add."""

    budget: float  # min(cap, target-epsilon)
    capped: bool  # a cap below target-epsilon
    noise_multiplier: float
    owners: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "capped": self.capped, "noise_multiplier": self.noise_multiplier,
                "owners": list(self.owners)}


def plan_budgets(cfg: JobConfig, schedule: Schedule, caps: Mapping[int, float | None],
                 run_noise: float) -> list[BudgetGroup]:
    """The owners grouped by budget: capped groups (smallest cap first), each with
    its own multiplier (calibrated for its cap over its owners' schedule; with a
    fixed ``noise-multiplier``, that one), then the owners at ``target-epsilon`` with
    ``run_noise``. Every owner of ``schedule`` is in exactly one group."""
    capped: dict[float, list[int]] = {}
    rest: list[int] = []
    for o in sorted(schedule.owner_rates):
        budget = owner_budget(cfg, caps.get(o))
        if budget < cfg.target_epsilon:
            capped.setdefault(budget, []).append(o)
        else:
            rest.append(o)
    groups = []
    for budget in sorted(capped):
        owners = tuple(capped[budget])
        z = (calibrate_schedule(dataclasses.replace(cfg, target_epsilon=budget), schedule.restricted(owners))
             if cfg.calibrate else float(run_noise))
        groups.append(BudgetGroup(budget, True, float(z), owners))
    if rest:
        groups.append(BudgetGroup(float(cfg.target_epsilon), False, float(run_noise), tuple(rest)))
    return groups


def planned_epsilon(cfg: JobConfig, schedule: Schedule, group: BudgetGroup) -> float:
    """The most any owner of ``group`` spends over ``num-rounds`` rounds at the
    group's multiplier (the run's accountant, delta and neighbouring relation)."""
    events = schedule.restricted(group.owners).run_events(cfg, group.noise_multiplier, cfg.num_rounds)
    return max(epsilon(e, cfg.delta, cfg.accountant, cfg.neighbouring) for e in events)


def unmet_caps(cfg: JobConfig, schedule: Schedule, groups: list[BudgetGroup]) -> list[tuple[BudgetGroup, float]]:
    """The capped groups whose multiplier would take an owner over its cap within
    ``num-rounds`` rounds (only a fixed ``noise-multiplier`` can), with the epsilon
    it would reach."""
    out = []
    for group in groups:
        if group.capped:
            spent = planned_epsilon(cfg, schedule, group)
            if spent > group.budget * (1 + 1e-9):
                out.append((group, spent))
    return out


def needed_noise(cfg: JobConfig, schedule: Schedule, group: BudgetGroup) -> float:
    """The smallest multiplier keeping ``group`` within its budget over ``num-rounds``."""
    return calibrate_schedule(dataclasses.replace(cfg, target_epsilon=group.budget),
                              schedule.restricted(group.owners))


def _count(n: int) -> str:
    return f"{n} owner{'s' if n != 1 else ''}"


def describe(groups: list[BudgetGroup]) -> str:
    """One line: ``owner budgets: 2 owners capped at epsilon 1 (noise multiplier
    3.214), 14 at 8 (1.021)``."""
    parts = []
    for g in groups:
        if g.capped:
            parts.append(f"{_count(len(g.owners))} capped at epsilon {g.budget:g} "
                         f"(noise multiplier {g.noise_multiplier:.4g})")
        else:
            parts.append(f"{len(g.owners) if parts else _count(len(g.owners))} at {g.budget:g} "
                         f"({'' if parts else 'noise multiplier '}{g.noise_multiplier:.4g})")
    return "owner budgets: " + ", ".join(parts)


__all__ = ["NODE_KEY", "BudgetGroup", "describe", "needed_noise", "node_max_epsilon", "owner_budget",
           "plan_budgets", "planned_epsilon", "unmet_caps"]
