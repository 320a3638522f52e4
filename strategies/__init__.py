"""Flower strategies of flwr-jdp (importable as ``flwr_jdp.strategies``)."""

from .dp_mtl import DPMeanRegularizedMTL
from .joint_dp import JointDP, load_results
from .priv_altmin import PrivAltMin
from .validation import validate_replies

__all__ = ["DPMeanRegularizedMTL", "JointDP", "PrivAltMin", "load_results", "validate_replies"]
