"""A pytest plugin for mutation testing (``mutmut run``; docs/mutation.md).

Loaded by ``[tool.mutmut] pytest_add_cli_args`` (``-p tests.test_mutation_plugin``):
before each test it puts Flower's logger in one state (see
:func:`pytest_runtest_setup`). In a plain ``pytest`` run it is collected and does
nothing else.
"""

from __future__ import annotations


def pytest_runtest_setup(item):
    """(Plugin hook: runs under ``-p tests.test_mutation_plugin`` only.) Start every
    test with Flower's logger as :meth:`JointDP.start` leaves it (``propagate =
    False``), so a test does not depend on whether a JointDP run came before it in
    the process: mutmut runs each mutant's tests in an order of its own, and
    ``test_owner_guard.py::test_owners_refuse_an_instruction_with_less_privacy_than_agreed``
    fails its ``caplog`` check when it is the first JointDP run of a process."""
    import logging

    logging.getLogger("flwr").propagate = False


def test_plugin_hook_sets_one_logger_state():
    import logging

    logging.getLogger("flwr").propagate = True
    pytest_runtest_setup(None)
    assert logging.getLogger("flwr").propagate is False
