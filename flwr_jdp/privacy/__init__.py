"""Privacy core: units, events, accountants, the ledger, calibration, mechanisms.

The names below are imported on first use (PEP 562), so that importing one
submodule, for example :mod:`.mechanisms` in a ClientApp, does not load
dp-accounting.
"""

import importlib

_EXPORTS = {
    "ACCOUNTANTS": "backends",
    "GaussianSumMechanism": "mechanisms",
    "LaplaceSumMechanism": "mechanisms",
    "NoisySumMechanism": "mechanisms",
    "SymmetricGaussianMechanism": "mechanisms",
    "NoisePlacement": "units",
    "PrivacyLedger": "ledger",
    "PrivacyUnit": "units",
    "SERVER_SCOPE": "ledger",
    "calibrate": "calibration",
    "epsilon": "accountants",
    "owner_scope": "ledger",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
