"""The package layout: which folders ship, and which room may import which.

The wheel holds ``layout_ledger`` (with ``migrations/`` as ``layout_ledger.migrations``) and
``sglang_integration`` (setup.cfg), each folder a package. Imports run one way (docs/design.md
"The code"): the rulebook (``core``) imports nothing of the project; the wire and the store
build on it; the history (the tools' read side) on the store; the CLI on all of them. The write
path (``core``, ``wire``, ``store``: what the daemon runs) never imports the history or the CLI,
and nothing imports in a circle. On the plugin's side, the daemon and the engine never import
each other, the engine never opens a ledger file, and only the test toolkit
(``sglang_integration.testing``) may import everything. The demo's cases (``scripts/demo_cases``)
and the one-GPU check (``scripts/gpu_single``) are not shipped, and nothing shipped imports them.
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path

import demo_cases
from layout_ledger.cli.sglang_export_check import QUIET_ARCHS
from sglang_integration.testing.sglang_env import GLOO_SOCKET_IFNAME_ENV

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("layout_ledger", "sglang_integration", "migrations")
UNSHIPPED_PACKAGES = {"demo_cases", "gpu_single", "scripts", "tests", "harness"}

# Each room and the rooms it may import (itself always). "layout_ledger" alone is the top-level
# package (its __version__).
ALLOWED = {
    "layout_ledger": set(),
    "layout_ledger.core": set(),
    "layout_ledger.wire": {"layout_ledger.core"},
    "layout_ledger.store": {"layout_ledger", "layout_ledger.core"},
    "layout_ledger.history": {"layout_ledger.core", "layout_ledger.store"},
    "layout_ledger.cli": {
        "layout_ledger",
        "layout_ledger.core",
        "layout_ledger.wire",
        "layout_ledger.store",
        "layout_ledger.history",
    },
    "layout_ledger.migrations": {"layout_ledger.core", "layout_ledger.store"},
    "sglang_integration": set(),
    "sglang_integration.settings": {"layout_ledger.store"},
    "sglang_integration.content": {"layout_ledger.core"},
    "sglang_integration.daemon": {
        "layout_ledger",
        "layout_ledger.core",
        "layout_ledger.wire",
        "layout_ledger.store",
        "sglang_integration",
        "sglang_integration.settings",
        "sglang_integration.content",
    },
    "sglang_integration.engine": {
        "layout_ledger.core",
        "layout_ledger.wire",
        "sglang_integration",
        "sglang_integration.settings",
        "sglang_integration.content",
    },
    "sglang_integration.plugin": {
        "sglang_integration",
        "sglang_integration.daemon",
        "sglang_integration.engine",
    },
}
WRITE_PATH = ("layout_ledger.core", "layout_ledger.wire", "layout_ledger.store")
READ_PATH = ("layout_ledger.history", "layout_ledger.cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "migrations":
        parts[0:1] = ["layout_ledger", "migrations"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for folder in PRODUCT_DIRS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every project module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` imports the module; ``from module import name``
            # the module.
            targets = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        for imported in targets:
            target = imported
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _room(name: str) -> str:
    for room in sorted(ALLOWED, key=len, reverse=True):
        if name == room or name.startswith(room + "."):
            return room
    return name


def _imported_top_names(tree: ast.AST) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module.split(".")[0]))
    return names


def _installed_packages() -> dict[str, Path]:
    """setup.cfg's packages, each with the folder it is installed from (``package_dir``)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    names = setup["options"]["packages"].split()
    mapped = dict(
        (part.strip() for part in line.split("="))
        for line in setup["options"]["package_dir"].strip().splitlines()
    )
    return {name: ROOT / mapped.get(name, name.replace(".", "/")) for name in sorted(names)}


def test_every_folder_of_the_product_is_an_installed_package_and_nothing_else_is() -> None:
    packages = _installed_packages()
    folders = {
        _module_name(init)
        for folder in PRODUCT_DIRS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(packages) == folders
    assert not [name for name in packages if name.split(".")[0] in UNSHIPPED_PACKAGES]
    assert Path(demo_cases.__file__).parent == ROOT / "scripts" / "demo_cases"
    assert not (ROOT / "scripts" / "__init__.py").exists()
    assert not (ROOT / "scripts" / "harness").exists()


def test_each_room_imports_only_the_rooms_below_it() -> None:
    graph = _graph()
    offenders = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if not name.startswith("sglang_integration.testing")
        for target in sorted(targets)
        if _room(target) != _room(name) and _room(target) not in ALLOWED[_room(name)]
    ]
    assert len(graph) > 60
    assert offenders == []


def test_the_write_path_never_imports_the_read_path() -> None:
    graph = _graph()
    offenders = [
        f"{name} imports {target}"
        for name, targets in sorted(graph.items())
        if name.startswith(WRITE_PATH)
        for target in sorted(targets)
        if target.startswith(READ_PATH)
    ]
    assert offenders == []


def test_no_module_imports_in_a_circle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            circle = []
            while True:
                member = stack.pop()
                circle.append(member)
                if member == node:
                    break
            if len(circle) > 1:
                circles.append(sorted(circle))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == []


def test_importing_the_write_path_loads_no_history_or_cli_module() -> None:
    write_path = sorted(name for name in _graph() if name.startswith(WRITE_PATH))
    code = (
        "import importlib, sys\n"
        f"for name in {write_path!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({READ_PATH!r}))\n"
        "print(loaded)\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert len(write_path) > 20
    assert output.strip() == "[]"


def test_no_shipped_module_imports_the_demo_the_gpu_check_or_the_tests() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _modules().values()
        for line, name in _imported_top_names(ast.parse(path.read_text(), str(path)))
        if name in UNSHIPPED_PACKAGES
    ]
    assert offenders == []


def test_only_the_test_toolkit_imports_the_test_toolkit() -> None:
    offenders = [
        f"{name} imports {target}"
        for name, targets in sorted(_graph().items())
        if not name.startswith("sglang_integration.testing")
        for target in sorted(targets)
        if target.startswith("sglang_integration.testing")
    ]
    assert offenders == []


def test_the_quiet_sglang_environment_is_written_in_one_place() -> None:
    homes = {
        QUIET_ARCHS: ROOT / "layout_ledger" / "cli" / "sglang_export_check.py",
        f'"{GLOO_SOCKET_IFNAME_ENV}"': ROOT / "sglang_integration" / "testing" / "sglang_env.py",
    }
    spellings = (*homes, f"{GLOO_SOCKET_IFNAME_ENV}=")
    written = [
        path.relative_to(ROOT).as_posix()
        for pattern in ("*.py", "*.sh", "*.toml", "*.cfg", "*.ini")
        for path in ROOT.rglob(pattern)
        if ".venv" not in path.parts
        and path not in homes.values()
        and any(text in path.read_text() for text in spellings)
    ]
    for text, home in homes.items():
        assert text in home.read_text()
    assert written == []


def test_no_tracked_file_points_outside_the_repository_for_its_contract() -> None:
    """The repo's own docs carry everything: nothing names the project's shared folder."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = ("../shared", "PROTOCOL.md", "DESIGN.md", "STYLE.md", "seed/000_")
    hits = [
        f"{name}: {word}"
        for name in tracked
        if name.endswith((".py", ".md", ".sh", ".toml", ".cfg", ".ini", ".yml"))
        and name != "tests/test_package_layout.py"
        for word in outside
        if word in (ROOT / name).read_text(encoding="utf-8", errors="replace")
    ]
    assert not hits, hits
