"""JointDP, the joint-DP strategy (:class:`~flwr_jdp.strategies.JointDP`), in parts a
reader can hold: :mod:`.strategy` (the class: its state, the accounted loop's
``prepare``/``start``), :mod:`.nodes` (set-up: the owners each node hosts, its model
checked), :mod:`.plan` (calibration, selection, the charge before each instruction), :mod:`.budgets`
(local noise: a noise multiplier per group of owners their nodes cap),
:mod:`.aggregation` (validation, the noised aggregate, the inner strategy's
post-processing) and :mod:`.results` (evaluation, round rows, what is saved).
"""

from flwr_jdp.strategies.joint_dp.aggregation import INNER_STRATEGIES
from flwr_jdp.strategies.joint_dp.results import load_results
from flwr_jdp.strategies.joint_dp.strategy import JointDP

__all__ = ["INNER_STRATEGIES", "JointDP", "load_results"]
