"""The product apart from its harness.

The wheel holds ``layout_ledger`` (with ``migrations/`` as ``layout_ledger.migrations``) and
``sglang_integration`` (setup.cfg); of
``sglang_integration.testing`` only what a user reuses to test a deployment (the model-less
daemon). The CPU harness (``scripts/harness``), the demo's cases (``scripts/demo_cases``) and the
one-GPU check (``scripts/gpu_single``) are not shipped, and no production module imports them.
The quiet sglang environment is written once, in ``layout_ledger.sglang_env``.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import demo_cases
import harness
from layout_ledger.sglang_env import GLOO_SOCKET_IFNAME_ENV, QUIET_ARCHS

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_DIRS = ("layout_ledger", "sglang_integration", "migrations")
HARNESS_PACKAGES = {"harness", "demo_cases", "gpu_single", "scripts", "tests"}
HARNESS_MODULES = {path.stem for path in (ROOT / "scripts" / "harness").glob("*.py")} - {"__init__"}


def _product_modules() -> list[Path]:
    return sorted(path for name in PRODUCT_DIRS for path in (ROOT / name).rglob("*.py"))


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


def test_no_production_module_imports_the_harness_or_the_demo() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _product_modules()
        for line, name in _imported_top_names(ast.parse(path.read_text(), str(path)))
        if name in HARNESS_PACKAGES
    ]
    assert len(_product_modules()) > 20
    assert offenders == []


def test_the_harness_and_the_demo_live_outside_every_installed_package() -> None:
    packages = _installed_packages()
    assert "sglang_integration.testing" in packages
    assert not [name for name in packages if name.split(".")[0] in HARNESS_PACKAGES]
    scripts = ROOT / "scripts"
    assert Path(harness.__file__).parent == scripts / "harness"
    assert Path(demo_cases.__file__).parent == scripts / "demo_cases"
    assert not (scripts / "__init__.py").exists()
    assert {"cpu_engine", "daemon_control", "shared_experts"} <= HARNESS_MODULES
    shipped = {
        path.relative_to(ROOT).as_posix()
        for folder in packages.values()
        for path in folder.iterdir()
        if path.stem in HARNESS_MODULES | HARNESS_PACKAGES
    }
    assert shipped == set()


def test_the_quiet_sglang_environment_is_written_in_one_place() -> None:
    home = ROOT / "layout_ledger" / "sglang_env.py"
    # The list itself, and the gloo variable set in Python ("NAME") or in a shell (NAME=).
    spellings = (QUIET_ARCHS, f'"{GLOO_SOCKET_IFNAME_ENV}"', f"{GLOO_SOCKET_IFNAME_ENV}=")
    written = [
        path.relative_to(ROOT).as_posix()
        for pattern in ("*.py", "*.sh", "*.toml", "*.cfg", "*.ini")
        for path in ROOT.rglob(pattern)
        if ".venv" not in path.parts
        and path != home
        and any(text in path.read_text() for text in spellings)
    ]
    assert QUIET_ARCHS in home.read_text()
    assert written == []
