"""flwr-jdp: joint differential privacy for Flower.

Owner ``j``'s personal layers are trained on ``j``'s data without noise and never
leave ``j``; everything the other owners see (the shared parameters) is
differentially private with respect to ``j``'s data, with the unit of privacy
(record, user, owner) chosen by configuration.

The Flower strategies live in the repository folder ``strategies/`` and the
Server/ClientApps in ``apps/``; both are sub-packages of this package
(``flwr_jdp.strategies``, ``flwr_jdp.apps``). An installed wheel maps them there
through ``package-dir``; when the package is imported from a source tree or from a
Flower App bundle (FAB, which Flower unpacks and puts first on ``sys.path``), the
folder beside this one is added to the package path so that the same import names
resolve.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_root = _Path(__file__).resolve().parent.parent
if (_root / "apps" / "__init__.py").is_file() and not (
    _Path(__file__).resolve().parent / "apps"
).is_dir():
    __path__.append(str(_root))  # noqa: F821  (module __path__ of a package)
