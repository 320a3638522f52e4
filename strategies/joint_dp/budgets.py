"""Owner budgets of :class:`~flwr_jdp.strategies.JointDP` (local noise): the caps the
owners' nodes reported at set-up (node config ``max-epsilon``), a noise multiplier per
capped group, and what the run says about them (the set-up line, ``results.json``).
See :mod:`flwr_jdp.joint_dp.budgets`.
"""

from __future__ import annotations

from logging import WARNING

from flwr.common import log

from flwr_jdp.joint_dp.budgets import (
    NODE_KEY,
    BudgetGroup,
    describe,
    needed_noise,
    plan_budgets,
    unmet_caps,
)
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.privacy.ledger import owner_scope
from flwr_jdp.privacy.units import NoisePlacement


class OwnerBudgets:
    """The noise each owner adds, planned for its own budget.

    A part of :class:`~flwr_jdp.strategies.JointDP` (which holds the state it uses:
    ``owner_caps`` from the set-up, ``budget_groups`` and ``owner_noise`` planned here).
    """

    def _plan_owner_budgets(self) -> None:
        """Under local noise, a multiplier per group of owners capped below
        ``target-epsilon`` (the others add the run's); with a fixed
        ``noise-multiplier`` that would take a capped owner over its cap, a
        :class:`ConfigError` naming the owners, their nodes and the keys."""
        cfg = self.cfg
        self.budget_groups, self.owner_noise = [], {}
        capped = sorted(o for o, c in self.owner_caps.items() if c is not None and c < cfg.target_epsilon)
        if not cfg.dp:
            return
        if cfg.placement is not NoisePlacement.LOCAL:
            if capped:
                log(WARNING, "Owners %s set node config '%s' below target-epsilon; under noise-placement="
                    "'%s' one mechanism covers every owner at target-epsilon=%g, so their caps are not "
                    "planned for: their nodes charge each round to their ledgers and refuse the rounds that "
                    "would take them over their caps (only noise-placement='local' plans a budget per owner)",
                    capped[:10], NODE_KEY, cfg.noise_placement, cfg.target_epsilon)
            return
        groups = plan_budgets(cfg, self.schedule, self.owner_caps, self.noise_multiplier)
        for group, spent in unmet_caps(cfg, self.schedule, groups)[:1]:
            nodes = sorted({self.owner_node[o] for o in group.owners})
            raise ConfigError(
                f"owners {list(group.owners[:10])} (nodes {nodes[:10]}) cap their budget at epsilon "
                f"{group.budget:g} (node config '{NODE_KEY}'), but run-config '{self._key('noise-multiplier')}'="
                f"{group.noise_multiplier:g} would spend epsilon {spent:.4g} over "
                f"'{self._key('num-rounds')}'={cfg.num_rounds} rounds: set "
                f"'{self._key('noise-multiplier')}' = 0 (each owner's noise is then calibrated to its own "
                f"budget), raise it to at least {needed_noise(cfg, self.schedule, group):.4g}, or raise "
                f"those nodes' '{NODE_KEY}'")
        self.budget_groups = groups
        self.owner_noise = {o: g.noise_multiplier for g in groups if g.capped for o in g.owners}

    def noise_of(self, owner: int) -> float:
        """The noise multiplier ``owner`` adds (its group's, else the run's)."""
        return self.owner_noise.get(owner, self.noise_multiplier)

    def round_noise(self, owners: list[int]) -> float | dict[int, float]:
        """The noise multiplier of a round's ``owners``: the run's, or one per owner
        when some owner is capped."""
        return {o: self.noise_of(o) for o in owners} if self.owner_noise else self.noise_multiplier

    def _current_groups(self) -> list[BudgetGroup]:
        """The groups with the run's multiplier as it is now (a resumed run restores it)."""
        return [g if g.capped else BudgetGroup(g.budget, False, float(self.noise_multiplier), g.owners)
                for g in self.budget_groups]

    def budget_line(self) -> str | None:
        """The set-up line on owner budgets, if some owner is capped."""
        groups = self._current_groups()
        return describe(groups) if any(g.capped for g in groups) else None

    def budget_record(self) -> list[dict] | None:
        """``results.json``'s ``owner_budgets``: per group its budget, whether it is a
        node's cap, its noise multiplier, its owners and the epsilon spent (the most
        any of them has spent, from the ledger)."""
        if not self.budget_groups:
            return None
        groups = self._current_groups()
        if len(groups) == 1:  # every owner at the run's budget: the run's epsilon
            return [{**groups[0].as_dict(), "epsilon": self.ledger.epsilon()}]
        return [{**g.as_dict(), "epsilon": self.ledger.epsilon(scopes=[owner_scope(o) for o in g.owners])}
                for g in groups]
