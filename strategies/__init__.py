"""Flower strategies of flwr-jdp (importable as ``flwr_jdp.strategies``)."""

from .joint_dp import JointDP, load_results
from .priv_altmin import PrivAltMin
from .validation import validate_replies

__all__ = ["JointDP", "PrivAltMin", "load_results", "validate_replies"]
