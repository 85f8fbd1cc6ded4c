"""The documented install works: a wheel built from this repository installs into an SGLang
environment with ``--no-deps`` and registers the console script and sglang's plugin entry point.

The wheel is built once for this module (``pip wheel --no-deps --no-build-isolation`` from a copy
of the files the build reads, so the checkout gets no ``build/``). The "SGLang environment" is a
scratch virtual environment whose ``sglang.pth`` adds this suite's site-packages (sglang 0.5.23,
torch, SQLAlchemy, alembic) after the scratch one's own: plain path lines, so this checkout's
editable install (a finder that ``.pth`` would run) is not active there. The wheel goes in with
``pip --python SCRATCH install --no-deps --no-index``, as the README says to install it
(``--no-deps`` here only because this scratch environment has no index to resolve from).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

import layout_ledger

ROOT = Path(__file__).resolve().parents[1]
# What setuptools reads to build the wheel (setup.cfg names the packages and the README).
BUILD_INPUTS = (
    "setup.cfg",
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "layout_ledger",
    "migrations",
    "sglang_integration",
)


def _pip(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *argv],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch SGLang environment with the wheel installed (--no-deps); its bin/python."""
    work = tmp_path_factory.mktemp("package")
    source = work / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in BUILD_INPUTS:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    wheels = work / "wheels"
    _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(wheels),
        ".",
        cwd=source,
    )
    (wheel,) = wheels.glob("*.whl")
    environment = work / "sglang-env"
    venv.EnvBuilder(with_pip=False).create(environment)
    python = environment / "bin" / "python"
    own_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(own_site) / "sglang.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    yield python


def _run(python: Path, code: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=python.parents[2],
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_wheel_installs_its_console_script_into_the_sglang_environment(scratch):
    script = scratch.parent / "layout-ledger"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    shown = subprocess.run(
        [script, "--version"], capture_output=True, text=True, env=env, check=False
    )
    assert (shown.returncode, shown.stdout) == (0, f"layout-ledger {layout_ledger.__version__}\n")
    where = _run(scratch, "import layout_ledger, sglang; print(layout_ledger.__file__)")
    assert where.startswith(str(scratch.parents[1])), "the wheel's package, not this checkout's"


def test_the_wheel_registers_the_plugin_entry_point_sglang_discovers(scratch):
    # sglang 0.5.23 discovers general plugins with importlib.metadata.entry_points(group=...)
    # (srt/plugins/__init__.py line 57) and loads each one; the same call here, in the wheel's
    # environment, finds this package's plugin in the installed wheel.
    found = _run(
        scratch,
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='sglang.srt.plugins') "
        "if e.name == 'expert_layout_ledger']\n"
        "register = ep.load()\n"
        "import sys\n"
        "print(ep.dist.version, sys.modules[register.__module__].__file__, "
        "'sglang' in sys.modules)",
    )
    version, module, sglang_imported = found.split()
    assert version == layout_ledger.__version__
    assert module.startswith(str(scratch.parents[1]))
    assert sglang_imported == "False", "loading the entry point imports nothing of sglang"


def test_the_package_version_is_written_once_and_the_wheel_carries_the_license(scratch):
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["metadata"]["version"] == "attr: layout_ledger.__version__"
    assert re.search(
        r'__version__ = "\d+\.\d+\.\d+"', (ROOT / "layout_ledger/__init__.py").read_text()
    )
    licensed = _run(
        scratch,
        "from importlib.metadata import distribution\n"
        "d = distribution('sglang-expert-layout-ledger')\n"
        "print(d.metadata['License'], [str(f) for f in d.files if 'LICENSE' in str(f)])",
    )
    assert licensed.startswith("Apache-2.0 ") and "LICENSE" in licensed
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_extras_are_ranges_and_the_python_ci_runs_is_the_one_required():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = config["options.extras_require"]
    requirements = [
        line.strip() for name in extras for line in extras[name].splitlines() if line.strip()
    ]
    pinned = [line for line in requirements if "==" in line]
    assert pinned == [], "an extra installs beside SGLang's own packages: ranges, not pins"
    assert "sglang" not in extras, "sglang is the environment, installed as its docs say"
    # CI (.ci/run -> scripts/test.sh -> scripts/bootstrap.sh) runs Python 3.11 only.
    assert config["options"]["python_requires"] == ">=3.11"
    assert 'python="${PYTHON:-python3.11}"' in (ROOT / "scripts" / "bootstrap.sh").read_text()
