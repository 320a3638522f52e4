"""Flower strategies of flwr-jdp (importable as ``flwr_jdp.strategies``)."""

from .dp_mtl import DPMeanRegularizedMTL
from .joint_dp import JointDP, load_results
from .priv_altmin import PrivAltMin
from .validation import validate_replies
from .winsorized_dp import DifferentialPrivacyWinsorizedMean

__all__ = ["DPMeanRegularizedMTL", "DifferentialPrivacyWinsorizedMean", "JointDP", "PrivAltMin", "load_results", "validate_replies"]
