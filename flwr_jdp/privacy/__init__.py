"""Privacy core: units, events, accountants, the ledger, calibration, mechanisms."""

from .accountants import ACCOUNTANTS, epsilon
from .calibration import calibrate
from .ledger import SERVER_SCOPE, PrivacyLedger, owner_scope
from .mechanisms import GaussianSumMechanism
from .units import NoisePlacement, PrivacyUnit

__all__ = [
    "ACCOUNTANTS",
    "GaussianSumMechanism",
    "NoisePlacement",
    "PrivacyLedger",
    "PrivacyUnit",
    "SERVER_SCOPE",
    "calibrate",
    "epsilon",
    "owner_scope",
]
