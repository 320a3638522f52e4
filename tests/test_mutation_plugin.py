"""Import aliases for mutation testing (``mutmut run``; docs/mutation.md).

setuptools maps ``flwr_jdp.strategies`` to the top-level folder ``strategies/`` and
``flwr_jdp.apps`` to ``apps/``. mutmut copies the sources into ``./mutants`` and
names every mutant after its file's path (``strategies.validation.x_...``), and its
trampolines only switch a mutant on in a function whose ``__module__`` is that
name. Imported as ``flwr_jdp.strategies.validation`` the module would be named
otherwise and no mutant of ``strategies/`` would ever run.

This module is loaded as a pytest plugin by ``[tool.mutmut] pytest_add_cli_args``
(``-p tests.test_mutation_plugin``). Inside the ``mutants/`` copy only, it puts a
finder first on ``sys.meta_path`` that answers ``flwr_jdp.strategies[.X]`` and
``flwr_jdp.apps[.X]`` with the modules ``strategies[.X]`` and ``apps[.X]`` of that
copy, so both import names give one module, named after its path; and before each
test it puts Flower's logger in one state (see :func:`pytest_runtest_setup`).
In a plain ``pytest`` run this module does nothing (it is collected, and holds one
check of the alias logic).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

#: Package-dir mappings of pyproject.toml: import name -> folder (= module name).
ALIASES = {"flwr_jdp.strategies": "strategies", "flwr_jdp.apps": "apps"}


def _real_name(fullname: str) -> str | None:
    for alias, real in ALIASES.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return real + fullname[len(alias):]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, real: str) -> None:
        self.real = real

    def create_module(self, spec):
        # The real module, already executed; the import system keeps its
        # __name__, __spec__ and __path__ (they are set) and binds it to the alias.
        return importlib.import_module(self.real)

    def exec_module(self, module) -> None:
        return None


class AliasFinder(importlib.abc.MetaPathFinder):
    """``flwr_jdp.strategies.X`` -> the module ``strategies.X`` (same object)."""

    def find_spec(self, fullname, path=None, target=None):
        real = _real_name(fullname)
        if real is None:
            return None
        is_pkg = "." not in real
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real), is_package=is_pkg)


def _in_mutants_copy() -> bool:
    root = Path(__file__).resolve().parents[1]
    return root.name == "mutants" and all((root / real / "__init__.py").is_file() for real in ALIASES.values())


def install() -> bool:
    """Put :class:`AliasFinder` first on ``sys.meta_path`` (in ``mutants/`` only)."""
    if not _in_mutants_copy():
        return False
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        root = str(Path(__file__).resolve().parents[1])
        if root not in sys.path:
            sys.path.insert(0, root)
        sys.meta_path.insert(0, AliasFinder())
    return True


install()


def pytest_runtest_setup(item):
    """(Plugin hook: runs under ``-p tests.test_mutation_plugin`` only.) Start every
    test with Flower's logger as :meth:`JointDP.start` leaves it (``propagate =
    False``), so a test does not depend on whether a JointDP run came before it in
    the process: mutmut runs each mutant's tests in an order of its own, and
    ``test_owner_guard.py::test_owners_refuse_an_instruction_with_less_privacy_than_agreed``
    fails its ``caplog`` check when it is the first JointDP run of a process."""
    import logging

    logging.getLogger("flwr").propagate = False


def test_alias_names():
    assert _real_name("flwr_jdp.strategies") == "strategies"
    assert _real_name("flwr_jdp.strategies.validation") == "strategies.validation"
    assert _real_name("flwr_jdp.apps.owner_state") == "apps.owner_state"
    assert _real_name("flwr_jdp.strategiesx") is None
    assert _real_name("flwr_jdp.privacy.mechanisms") is None
