"""The layers of ``flwr_jdp``: generic code, one folder per system, and the two
façades users import (``flwr_jdp.strategies``, ``flwr_jdp.client``).

- Generic modules (privacy, training, data, models, the accounted round loop,
  records, config checks, ...) import no system folder and no façade.
- A system folder imports no other system folder.
- A system's client side (its protocol, client half, ClientApp state) never
  imports its server-side strategy: message keys live in the protocol module.
- Nothing imports ``research`` (the reproductions; not installed, not in the FAB).
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flwr_jdp"
SYSTEMS = ("joint_dp", "mtl", "altmin", "subject", "winsorized")
FACADES = ("flwr_jdp.strategies", "flwr_jdp.client")
CLIENT_SIDE = ("protocol.py", "client.py", "client_app.py", "owner_store.py", "release.py", "task.py")


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


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _system_of(path: Path) -> str | None:
    parts = path.relative_to(PKG).parts
    return parts[0] if len(parts) > 1 and parts[0] in SYSTEMS else None


def _modules():
    return [p for p in sorted(PKG.rglob("*.py")) if p.relative_to(PKG).as_posix() not in ("strategies.py", "client.py")]


def test_generic_code_imports_no_system_and_no_facade():
    systems = [f"flwr_jdp.{s}" for s in SYSTEMS]
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _modules() if _system_of(p) is None
           for m in _imports(p) if any(_under(m, s) for s in (*systems, *FACADES))]
    assert not bad


def test_no_system_imports_another_system_or_a_facade():
    bad = []
    for p in _modules():
        own = _system_of(p)
        if own is None:
            continue
        others = [f"flwr_jdp.{s}" for s in SYSTEMS if s != own]
        bad += [f"{p.relative_to(ROOT)}: {m}" for m in _imports(p) if any(_under(m, o) for o in (*others, *FACADES))]
    assert not bad


def test_client_side_modules_never_import_a_strategy():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _modules() if _system_of(p) and p.name in CLIENT_SIDE
           for m in _imports(p) if _under(m, f"flwr_jdp.{_system_of(p)}.strategy")]
    assert not bad


def test_every_system_has_its_folder_with_a_strategy_and_a_protocol():
    for s in SYSTEMS:
        assert (PKG / s / "strategy.py").is_file(), s
    for s in ("joint_dp", "mtl", "altmin", "subject"):
        assert (PKG / s / "protocol.py").is_file(), s


def test_nothing_in_the_package_imports_research():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in sorted(PKG.rglob("*.py")) for m in _imports(p)
           if _under(m, "research")]
    assert not bad


def test_research_is_neither_installed_nor_in_the_fab():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["flwr_jdp*"]
    assert not (PKG / "reproduce").exists()
    assert not [g for g in project["tool"]["flwr"]["app"]["fab-include"] if g.startswith("research")]


def test_importing_flwr_jdp_leaves_the_root_logger_alone():
    """Opacus's import gives the root logger a handler (logging.basicConfig), through
    which every DEBUG line of Flower's logger would be printed; flwr-jdp takes it back
    off, and keeps a root handler the application set up itself."""
    code = ("import logging, flwr_jdp.strategies, flwr_jdp.client; import opacus; "
            "print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
    code = ("import logging; logging.basicConfig(); import flwr_jdp.strategies; "
            "print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
