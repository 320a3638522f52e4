"""The Flower strategies of flwr-jdp (``flwr_jdp.strategies``; the folder
``strategies/`` at the repository's top level, installed inside ``flwr_jdp``).

:mod:`~flwr_jdp.strategies.accounted` is the one accounted round loop (charge, save,
release) every strategy runs on; each system has one strategy module on it:

- :class:`JointDP` (:mod:`~flwr_jdp.strategies.joint_dp`): joint DP, personal layers
  kept on each owner, shared layers released under DP;
- :class:`DPMeanRegularizedMTL` (:mod:`~flwr_jdp.strategies.dp_mtl`): DP
  mean-regularized multi-task learning;
- :class:`SubjectLevelFedAvg` (:mod:`~flwr_jdp.strategies.subject_level`):
  subject-level DP across silos;
- :class:`PrivAltMin` (:mod:`~flwr_jdp.strategies.priv_altmin`): private alternating
  minimization;
- :class:`DifferentialPrivacyWinsorizedMean` (:mod:`~flwr_jdp.strategies.winsorized`):
  user-level DP winsorized mean.
"""

from flwr_jdp.joint_dp.validation import validate_replies
from flwr_jdp.strategies.dp_mtl import DPMeanRegularizedMTL
from flwr_jdp.strategies.joint_dp import JointDP, load_results
from flwr_jdp.strategies.priv_altmin import PrivAltMin
from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
from flwr_jdp.strategies.winsorized import DifferentialPrivacyWinsorizedMean

__all__ = ["DPMeanRegularizedMTL", "DifferentialPrivacyWinsorizedMean", "JointDP", "PrivAltMin",
           "SubjectLevelFedAvg", "load_results", "validate_replies"]
