"""What the check ran with: interpreter, torch, CUDA, device, this package's revision, and the
versions and locations of the packages it imported or carried.

The revision is ``git describe`` of the checkout when ``git`` and ``.git`` are there, else the
``REVISION`` file ``scripts/gpu_wheels.sh`` wrote beside the wheels (the GPU machine receives a
copy of the working tree, not necessarily its ``.git``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR_ENV = "GPU_WHEELS"
DEFAULT_WHEEL_DIR = ROOT / ".gpu_wheels"
# The distributions whose version and origin the header names (carried ones come first).
PACKAGES = ("sglang", "SQLAlchemy", "alembic", "Mako", "pydantic", "msgspec", "pyzmq")


def git_revision() -> str:
    try:
        described = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=12"],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        described = None
    if described is not None and described.returncode == 0 and described.stdout.strip():
        return f"{described.stdout.strip()} (git)"
    revision_file = Path(os.environ.get(WHEEL_DIR_ENV, DEFAULT_WHEEL_DIR)) / "REVISION"
    if revision_file.exists():
        return f"{revision_file.read_text().strip()} (from {revision_file.name}, no git here)"
    return "unknown (no git, no REVISION file)"


def package(name: str) -> str:
    try:
        distribution = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    where = str(distribution.locate_file(""))
    return f"{distribution.version} ({where})"


def module_origin(name: str) -> str:
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    return str(Path(origin).parent) if origin else "not found"


def torch_versions(device: str) -> dict[str, str]:
    import torch

    found = {"torch": f"{torch.__version__} ({Path(torch.__file__).parent})"}
    found["torch CUDA build"] = str(torch.version.cuda)
    if device == "cuda":
        # Asked in a child process, so that this process never initializes CUDA itself.
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import torch; p = torch.cuda.get_device_properties(0); "
                "print(f'{p.name}, {p.total_memory / 2**30:.1f} GiB, cc {p.major}.{p.minor}, "
                "{torch.cuda.device_count()} device(s)')",
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        found["device"] = probe.stdout.strip() or f"unreadable: {probe.stderr.strip()[-200:]}"
        found["driver"] = nvidia_driver()
    return found


def nvidia_driver() -> str:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return smi.stdout.strip() or "unknown"


def collect(device: str, daemon_kind: str, daemon_reason: str) -> dict[str, str]:
    """Everything the header prints, in order."""
    found = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "this package": f"{git_revision()}; layout_ledger from {module_origin('layout_ledger')}",
        **torch_versions(device),
    }
    for name in PACKAGES:
        found[name] = package(name)
    found["daemon"] = f"{daemon_kind} ({daemon_reason})"
    return found


def render(found: dict[str, str]) -> str:
    width = max(len(key) for key in found)
    return "\n".join(f"  {key:<{width}}  {value}" for key, value in found.items())
