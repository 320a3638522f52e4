"""A pytest plugin for mutation testing (``mutmut run``; docs/mutation.md).

Loaded by ``[tool.mutmut] pytest_add_cli_args`` (``-p tests.test_mutation_plugin``):
before each test it puts Flower's logger in one state and empties the per-process
caches of the mutated accounting code (see :func:`pytest_runtest_setup`). With
``FLWR_JDP_MUTATION_TESTS`` set (comma-separated test files) it keeps only the tests
of those files (:func:`pytest_collection_modifyitems`): the accounting modules are
covered by almost every test, and a survivor there would rerun all of them, so they
are mutated against their own unit tests (docs/mutation.md). In a plain ``pytest``
run it is collected and does nothing else.
"""

from __future__ import annotations


def strategies_from_the_mutated_copy() -> bool:
    """Under ``mutmut run`` (the tests run inside ``./mutants``, a copy of
    ``[tool.mutmut] source_paths``), make ``flwr_jdp.strategies`` the mutated copy of
    ``strategies/``: installed, that package is mapped to the repository's
    ``strategies/`` (``[tool.setuptools.package-dir]``), which mutmut's ``sys.path``
    does not reach, so the tests would run the unmutated strategies. Returns whether
    it did (never in a plain ``pytest`` run)."""
    import sys
    from pathlib import Path

    here = Path.cwd()
    if here.name != "mutants" or not (here / "strategies" / "__init__.py").is_file():
        return False
    if "flwr_jdp.strategies" in sys.modules:
        raise RuntimeError("flwr_jdp.strategies was imported before the mutation plugin")
    import flwr_jdp

    if Path(flwr_jdp.__file__).resolve().parent.parent != here.resolve():
        return False  # not the mutated copy of flwr_jdp
    flwr_jdp.__path__.append(str(here))  # flwr_jdp.strategies = ./strategies
    return True


strategies_from_the_mutated_copy()


def pytest_runtest_setup(item):
    """(Plugin hook: runs under ``-p tests.test_mutation_plugin`` only.) Start every
    test with Flower's logger as :meth:`JointDP.start` leaves it (``propagate =
    False``), so a test does not depend on whether a JointDP run came before it in
    the process: mutmut runs each mutant's tests in an order of its own, and
    ``test_owner_guard.py::test_owners_refuse_an_instruction_with_less_privacy_than_agreed``
    fails its ``caplog`` check when it is the first JointDP run of a process."""
    import logging

    logging.getLogger("flwr").propagate = False
    clear_caches()


def scope() -> tuple[str, ...]:
    """The test files ``FLWR_JDP_MUTATION_TESTS`` names (empty: no restriction)."""
    import os

    raw = os.environ.get("FLWR_JDP_MUTATION_TESTS", "")
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def pytest_collection_modifyitems(config, items):
    """(Plugin hook.) Under ``FLWR_JDP_MUTATION_TESTS``, deselect every test outside
    the files it names."""
    files = scope()
    if not files:
        return
    keep = [item for item in items if item.nodeid.split("::")[0] in files]
    drop = [item for item in items if item.nodeid.split("::")[0] not in files]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


#: Per-process caches (``functools.lru_cache``) of mutated code: a test that finds its
#: value cached by an earlier test never calls the function, so mutmut's coverage
#: pass would not link the test to it, and a mutant's run could read a value the
#: unmutated code computed. Emptied before every test under mutmut.
CACHED = (
    ("flwr_jdp.privacy.accountants", ("_base_pld", "_self_composed_pld", "_cached_epsilon")),
    ("flwr_jdp.privacy.events", ("_canonical_cached",)),
    ("flwr_jdp.privacy.rdp", ("_base_rdp",)),
    ("flwr_jdp.privacy.horizontal", ("sqrt_rounds",)),
    ("flwr_jdp.joint_dp.seed_model", ("_seeded_model",)),
)


def clear_caches() -> int:
    """Empty the caches of :data:`CACHED`; returns how many were emptied."""
    import importlib

    emptied = 0
    for module, names in CACHED:
        mod = importlib.import_module(module)
        for name in names:
            getattr(mod, name).cache_clear()
            emptied += 1
    return emptied


def test_plugin_hook_sets_one_logger_state():
    import logging

    logging.getLogger("flwr").propagate = True
    pytest_runtest_setup(None)
    assert logging.getLogger("flwr").propagate is False


def test_plugin_scope_keeps_only_the_named_files(monkeypatch):
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    class Hook:
        deselected = []

        def pytest_deselected(self, items):
            self.deselected.extend(items)

    class Config:
        hook = Hook()

    items = [Item("tests/test_a.py::t1"), Item("tests/test_b.py::t2"), Item("tests/test_a.py::t3")]
    monkeypatch.delenv("FLWR_JDP_MUTATION_TESTS", raising=False)
    pytest_collection_modifyitems(Config(), items)
    assert len(items) == 3 and not Config.hook.deselected
    monkeypatch.setenv("FLWR_JDP_MUTATION_TESTS", "tests/test_a.py, tests/test_c.py")
    pytest_collection_modifyitems(Config(), items)
    assert [i.nodeid for i in items] == ["tests/test_a.py::t1", "tests/test_a.py::t3"]
    assert [i.nodeid for i in Config.hook.deselected] == ["tests/test_b.py::t2"]


def test_plugin_empties_the_accounting_caches():
    import dp_accounting as dpa

    from flwr_jdp.privacy import accountants

    accountants.epsilon(dpa.GaussianDpEvent(3.0), 1e-5)
    assert accountants._cached_epsilon.cache_info().currsize > 0
    assert clear_caches() == 7
    assert accountants._cached_epsilon.cache_info().currsize == 0
    assert accountants._base_pld.cache_info().currsize == 0
