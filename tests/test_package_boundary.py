"""The installed package ``flwr_jdp`` stands alone: no module of it imports the
project's apps, strategies or research code (``research/``, the reproductions, is
not installed), and the wheel does not ship ``research``."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("flwr_jdp.apps", "flwr_jdp.strategies", "apps", "strategies", "research")


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # resolve "from ..x import y" against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


def test_flwr_jdp_imports_no_apps_strategies_or_research():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted((ROOT / "flwr_jdp").rglob("*.py"))
           for m in _imports(p) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad


def test_research_is_neither_installed_nor_in_the_fab():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if p == "research" or p.startswith(("research.", "flwr_jdp.reproduce"))]
    assert not [g for g in project["tool"]["flwr"]["app"]["fab-include"] if g.startswith("research")]
