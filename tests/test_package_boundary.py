"""The layers of the repository: the library ``flwr_jdp/``, the Flower strategies
``strategies/`` (installed as ``flwr_jdp.strategies``) and the Flower Apps ``apps/``.

- The library (``flwr_jdp/``) imports neither the strategies nor the apps: no
  ``flwr_jdp.strategies``, no top-level ``strategies`` or ``apps``.
- Generic modules of the library (privacy, training, data, models, records, config
  checks, ...) import no system folder and no façade.
- A system folder imports no other system folder.
- The strategies import no app, and each other only as ``flwr_jdp.strategies``.
- An app imports no other app, and the strategies only as ``flwr_jdp.strategies``.
- Nothing imports ``research`` (the reproductions; not installed, not in the FAB),
  and the only import package installed is ``flwr_jdp``.
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flwr_jdp"
STRATEGIES = ROOT / "strategies"
APPS = ROOT / "apps"
SYSTEMS = ("joint_dp", "mtl", "altmin", "subject", "winsorized")
FACADES = ("flwr_jdp.strategies", "flwr_jdp.client")
#: each system's strategy module in strategies/
SYSTEM_STRATEGY = {"joint_dp": "joint_dp", "mtl": "dp_mtl", "subject": "subject_level",
                   "altmin": "priv_altmin", "winsorized": "winsorized"}
#: each system's Flower App in apps/ (and the benchmarks' FedAvg baseline)
APP_NAMES = ("joint_dp", "dp_mtl", "subject_dp", "priv_altmin", "winsorized", "fedavg")


def _imports(path: Path, runtime_only: bool = False):
    """Every module ``path`` imports; ``runtime_only``: less those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
                node.body = [ast.Pass()]
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
    return [p for p in sorted(PKG.rglob("*.py")) if p.relative_to(PKG).as_posix() != "client.py"]


def _py(folder: Path):
    return sorted(folder.rglob("*.py"))


def test_the_library_imports_neither_the_strategies_nor_the_apps():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _py(PKG) for m in _imports(p)
           if any(_under(m, x) for x in ("flwr_jdp.strategies", "strategies", "apps"))]
    assert not bad


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


def test_strategies_import_no_app_and_each_other_only_through_flwr_jdp_strategies():
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in _py(STRATEGIES) for m in _imports(p)
           if any(_under(m, x) for x in ("apps", "strategies"))]
    assert not bad


def test_apps_import_no_other_app_and_the_strategies_only_through_flwr_jdp_strategies():
    bad = []
    for name in APP_NAMES:
        for p in _py(APPS / name):
            own = f"apps.{name}"
            bad += [f"{p.relative_to(ROOT)}: {m}" for m in _imports(p)
                    if _under(m, "strategies") or (_under(m, "apps") and not _under(m, own))]
    assert not bad


def test_every_system_has_its_strategy_its_protocol_and_its_app():
    for s, module in SYSTEM_STRATEGY.items():
        assert (STRATEGIES / f"{module}.py").is_file() or (STRATEGIES / module / "__init__.py").is_file(), s
        assert not (PKG / s / "strategy.py").exists(), s
    for s in ("joint_dp", "mtl", "altmin", "subject"):
        assert (PKG / s / "protocol.py").is_file(), s
    for name in APP_NAMES:
        app = tomllib.loads((APPS / name / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
        for component in app["components"].values():
            module = component.split(":")[0]
            assert module.split(".")[0] == name, component  # a module inside the app's folder
            assert (APPS / name / (module.replace(".", "/") + ".py")).is_file(), component


def test_nothing_imports_research():
    bad = [f"{p.relative_to(ROOT)}: {m}" for folder in (PKG, STRATEGIES, APPS) for p in _py(folder)
           for m in _imports(p) if _under(m, "research")]
    assert not bad


def test_only_flwr_jdp_is_installed_and_research_is_not_in_the_fab():
    """The wheel holds one import package, ``flwr_jdp``, with the strategies inside it
    (``flwr_jdp.strategies`` from ``strategies/``): every library folder is listed
    (a forgotten one would be missing from a regular install), no top-level
    ``strategies`` or ``apps`` package."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    library = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py")}
    strategies = {".".join(("flwr_jdp", *p.parent.relative_to(ROOT).parts)) for p in STRATEGIES.rglob("__init__.py")}
    assert "flwr_jdp.strategies" in strategies
    assert set(setuptools["packages"]) == library | strategies
    assert setuptools["package-dir"] == {"flwr_jdp.strategies": "strategies"}
    assert not (PKG / "strategies").exists() and not (PKG / "strategies.py").exists()
    assert not (PKG / "reproduce").exists()
    assert not [g for g in project["tool"]["flwr"]["app"]["fab-include"] if g.startswith(("research", "flwr_jdp"))]


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_library_has_no_import_cycle():
    """No module of ``flwr_jdp/`` reaches itself through its imports (module level or
    inside a function): each can be read after the ones it uses."""
    modules = {_module_name(p): p for p in _py(PKG)}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path, runtime_only=True):
            # the longest module that names the import ("from a.b import c" is a.b, or a.b.c if a module)
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets - {n for n in targets if modules[n].name == "__init__.py" and name.startswith(n)}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])
