"""The Flower strategies of flwr-jdp, one per system (``flwr_jdp.strategies``)."""

from flwr_jdp.altmin.strategy import PrivAltMin
from flwr_jdp.joint_dp.strategy import JointDP, load_results
from flwr_jdp.joint_dp.validation import validate_replies
from flwr_jdp.mtl.strategy import DPMeanRegularizedMTL
from flwr_jdp.subject.strategy import SubjectLevelFedAvg
from flwr_jdp.winsorized.strategy import DifferentialPrivacyWinsorizedMean

__all__ = ["DPMeanRegularizedMTL", "DifferentialPrivacyWinsorizedMean", "JointDP", "PrivAltMin",
           "SubjectLevelFedAvg", "load_results", "validate_replies"]
