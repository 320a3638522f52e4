"""flwr-jdp: joint differential privacy for Flower.

Owner ``j``'s personal layers are trained on ``j``'s data without noise and never
leave ``j``; everything the other owners see (the shared parameters) is
differentially private with respect to ``j``'s data, with the unit of privacy
(record, user, owner) chosen by configuration.

The library of the repository's strategies (``strategies/``, installed as
:mod:`flwr_jdp.strategies`) and Flower Apps (``apps/``): per system (``joint_dp``,
``mtl``, ``subject``, ``altmin``, ``winsorized``) its message keys (``protocol``),
config, plans and client side; generic code apart (``privacy``, ``training``,
``data``, ``models``). Users import the strategies from :mod:`flwr_jdp.strategies`
and the client halves from :mod:`flwr_jdp.client`.
"""

__version__ = "0.1.0"



def import_opacus_quietly() -> None:
    """Import Opacus without the root-logger handler its import installs
    (``logging.basicConfig`` in ``opacus.utils.module_utils``): with it, every DEBUG
    line of Flower's logger (which propagates) would be printed. A root handler the
    application configured itself is kept. Called before each of the package's
    Opacus imports (Opacus is imported on first use: a process that never needs it,
    such as a ServerApp, skips its import time)."""
    import logging
    import sys

    if "opacus" in sys.modules:
        return
    root = logging.getLogger()
    before = list(root.handlers)
    import opacus.utils.module_utils  # noqa: F401

    for handler in list(root.handlers):
        if handler not in before:
            root.removeHandler(handler)
