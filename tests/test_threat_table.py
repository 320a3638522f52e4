"""The threat table of docs/guarantees.md is complete and every row is tested.

docs/guarantees.md's *Threat table* lists every value the server or the run submitter
controls: every run-config key of the joint-DP system, every field of every message a
node receives (set-up, train, each SecAgg+ stage, evaluate), and node selection and
dropouts. This file parses the table and fails when

- a run-config key (a field of :class:`~flwr_jdp.joint_dp.config.JobConfig`), a
  message field (:mod:`flwr_jdp.joint_dp.protocol`, Flower's SecAgg+ keys) or node
  selection / dropouts has no row;
- a row names no test, or a test that does not exist;
- a named test is not in the fast tier (marked ``slow`` or ``extended``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest
from flwr.common.secure_aggregation.secaggplus_constants import Key

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import JobConfig

ROOT = Path(__file__).resolve().parents[1]
GUARANTEES = ROOT / "docs" / "guarantees.md"
HEADING = "## Threat table"

#: Fields of the messages a node receives from the server, by stage.
SERVER_FIELDS = {
    "set-up": [protocol.PUBLIC_PERSONAL],
    "train": [protocol.SHARED, protocol.ROUND, protocol.OWNERS, protocol.SAMPLE_RATES, protocol.STEPS,
              protocol.NOISE_MULTIPLIER, protocol.SESSION, protocol.SCALE],
    "secagg": [Key.STAGE, Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE,
               Key.TARGET_RANGE, Key.MOD_RANGE, Key.MAX_WEIGHT, Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2,
               Key.CIPHERTEXT_LIST, Key.SOURCE_LIST, Key.ACTIVE_NODE_ID_LIST, Key.DEAD_NODE_ID_LIST],
}
#: Rows that are not a key or a field.
OTHER_ROWS = ["node selection", "dropouts", "evaluate message", "extra records", "concurrent runs"]

TEST_REF = re.compile(r"tests/(test_[A-Za-z0-9_]+\.py)::([A-Za-z0-9_]+)")


def _rows() -> list[tuple[str, str, str]]:
    text = GUARANTEES.read_text()
    assert HEADING in text, f"docs/guarantees.md has no '{HEADING}' section"
    section = text.split(HEADING, 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line.replace("|", "").strip()) <= {"-", " "}:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0].lower().startswith("value"):
            continue
        rows.append((cells[0], " | ".join(cells[1:-1]), cells[-1]))
    return rows


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def _marks(node: ast.AST) -> set[str]:
    out = set()
    for dec in getattr(node, "decorator_list", []):
        text = ast.unparse(dec)
        for mark in ("slow", "extended"):
            if f"mark.{mark}" in text:
                out.add(mark)
    return out


def _tests_of(path: Path) -> tuple[dict[str, set[str]], set[str]]:
    """Test functions (module level and in classes) with their marks, and the module's marks."""
    tree = ast.parse(path.read_text())
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            text = ast.unparse(node.value)
            module_marks |= {m for m in ("slow", "extended") if f"mark.{m}" in text}
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            found[node.name] = _marks(node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and sub.name.startswith("test"):
                    found[sub.name] = _marks(node) | _marks(sub)
    return found, module_marks


def test_the_threat_table_has_a_row_for_every_run_config_key() -> None:
    named = set().union(*(_names(r[0]) for r in _rows()))
    keys = {f.name.replace("_", "-") for f in fields(JobConfig)}
    missing = sorted(keys - named)
    assert not missing, f"run-config keys without a row in the threat table: {missing}"


@pytest.mark.parametrize("stage", sorted(SERVER_FIELDS))
def test_the_threat_table_has_a_row_for_every_message_field(stage: str) -> None:
    named = set().union(*(_names(r[0]) for r in _rows()))
    missing = sorted(set(SERVER_FIELDS[stage]) - named)
    assert not missing, f"{stage} message fields without a row in the threat table: {missing}"


def test_the_threat_table_has_rows_for_selection_dropouts_and_replies() -> None:
    first = " ".join(r[0].lower() for r in _rows())
    missing = [name for name in OTHER_ROWS if name not in first]
    assert not missing, f"no row for {missing}"


def test_every_row_names_existing_fast_tier_tests() -> None:
    cache: dict[str, tuple[dict[str, set[str]], set[str]]] = {}
    problems = []
    for value, _, tests in _rows():
        refs = TEST_REF.findall(tests)
        if not refs:
            problems.append(f"{value}: names no test")
        for file, name in refs:
            path = ROOT / "tests" / file
            if not path.is_file():
                problems.append(f"{value}: tests/{file} does not exist")
                continue
            if file not in cache:
                cache[file] = _tests_of(path)
            found, module_marks = cache[file]
            if name not in found:
                problems.append(f"{value}: tests/{file}::{name} does not exist")
            elif found[name] | module_marks:
                problems.append(f"{value}: tests/{file}::{name} is not in the fast tier")
    assert not problems, "\n".join(problems)
