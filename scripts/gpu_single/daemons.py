"""The check's daemons: which kind runs, starting and stopping them, reading their ledgers.

Two kinds, the same command-line arguments and ledger:

- ``sglang``: ``python -m sglang_integration.testing.daemon``, the model-less daemon: sglang
  0.5.23's real ``WeightCacheDaemon`` serve loop and handler with this package's hooks;
- ``ledger-service``: ``python -m gpu_single.standin_daemon``, where sglang cannot be imported
  (what it stands in for: ``STAND_IN_NOTE`` and that module's docstring).

``auto`` picks ``sglang`` when this interpreter can import the daemon's whole sglang chain (tried
in a child process, with a time limit), else ``ledger-service``, and says why.

Each daemon is a separate process writing its log into the work directory: on CUDA started the
way a person starts it (``python -m MODULE``); on the CPU path forked from the check's
forkserver, which imported sglang once, running the same module's ``main``. The ledgers are read
with the ``layout-ledger`` command line (``python -m layout_ledger.cli``), as an operator would.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from layout_ledger.core.layout import Geometry

SGLANG = "sglang"
LEDGER_SERVICE = "ledger-service"
AUTO = "auto"
KINDS = (AUTO, SGLANG, LEDGER_SERVICE)

MODULES = {
    SGLANG: "sglang_integration.testing.daemon",
    LEDGER_SERVICE: "gpu_single.standin_daemon",
}
STAND_IN_NOTE = (
    "stand-in daemon: sglang's WeightCacheDaemon serve loop, its ping/unknown-type handler and "
    "its framing (send_msg/recv_msg) are restated in scripts/gpu_single (standin_daemon, "
    "standin_framing); the ledger, LayoutService, the attach watcher, daemon_hooks' connection "
    "hook and the engines' client are this package's own code"
)
# What the model-less daemon and the engines' client import of sglang.
SGLANG_PROBE = (
    "import sglang.srt.weight_cache.daemon, sglang.srt.weight_cache.protocol, "
    "sglang.srt.weight_cache.transport, sglang.srt.plugins.hook_registry, sglang.srt.utils"
)
PROBE_TIMEOUT = 180.0
READY_TIMEOUT = 180.0


class DaemonError(RuntimeError):
    """A daemon did not start, stop, or answer as the check needs."""


def choose_kind(requested: str, python: str) -> tuple[str, str]:
    """The kind to run and why (``auto``: ``sglang`` when its import chain imports here)."""
    if requested != AUTO:
        return requested, f"--daemon {requested}"
    try:
        probe = subprocess.run(
            [python, "-c", SGLANG_PROBE],
            check=False,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return LEDGER_SERVICE, f"importing sglang took over {PROBE_TIMEOUT:.0f} s"
    if probe.returncode == 0:
        return SGLANG, "sglang's daemon modules import in this interpreter"
    last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
    return LEDGER_SERVICE, f"sglang's daemon modules do not import here: {last}"


class ForkedDaemon:
    """A daemon forked from the check's forkserver (CPU path), with ``Popen``'s few methods."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process

    @property
    def returncode(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        self.process.join(timeout)
        if self.process.is_alive():
            raise subprocess.TimeoutExpired("daemon", timeout)
        return self.process.exitcode


@dataclass
class DaemonHandle:
    name: str
    kind: str
    socket_path: str
    ledger_path: str
    log_path: str
    process: subprocess.Popen[bytes] | ForkedDaemon

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            text = []
        return f"--- last lines of {self.log_path}:\n" + "\n".join(text)


def daemon_argv(socket_path: str, ledger_path: str, geometry: Geometry) -> list[str]:
    """The arguments both kinds take (the model-less daemon's)."""
    return [
        "--socket",
        socket_path,
        "--ledger",
        ledger_path,
        "--num-layers",
        str(geometry.num_layers),
        "--num-logical-experts",
        str(geometry.num_logical_experts),
        "--num-physical-experts",
        str(geometry.num_physical_slots),
    ]


def start_daemon(
    kind: str,
    directory: Path,
    name: str,
    geometry: Geometry,
    python: str,
    *,
    forkserver: BaseContext | None = None,
) -> DaemonHandle:
    """Start one daemon of ``kind`` (not waiting for it: see ``wait_ready``): ``python -m
    MODULE ARGS``, or, given the CPU path's ``forkserver``, a process forked from it that runs
    the same module's ``main(ARGS)`` (the server imported sglang once for every process)."""
    socket_path = str(directory / f"{name}.sock")
    ledger_path = str(directory / f"{name}.sqlite")
    log_path = str(directory / f"{name}.log")
    argv = daemon_argv(socket_path, ledger_path, geometry)
    process: subprocess.Popen[bytes] | ForkedDaemon
    if forkserver is None:
        with open(log_path, "ab") as log:
            command = [python, "-m", MODULES[kind], *argv]
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    else:
        child = forkserver.Process(target=run_forked_daemon, args=(kind, argv, log_path))
        child.start()
        process = ForkedDaemon(child)
    return DaemonHandle(name, kind, socket_path, ledger_path, log_path, process)


def run_forked_daemon(kind: str, argv: list[str], log_path: str) -> None:
    """Forkserver child: the daemon module's ``main(argv)``, its output to ``log_path``."""
    from sglang_integration.testing.cpu_engine import release_forkserver
    from sglang_integration.testing.daemon_control import redirect_output

    release_forkserver()  # so that it dies with the check even when the check is SIGKILLed
    redirect_output(log_path)
    raise SystemExit(importlib.import_module(MODULES[kind]).main(argv))


def wait_ready(daemon: DaemonHandle, timeout: float = READY_TIMEOUT) -> float:
    """Wait for the ready file both kinds write once the socket listens; seconds waited."""
    started = time.monotonic()
    ready = Path(f"{daemon.socket_path}.ready")
    while not ready.exists():
        if daemon.process.poll() is not None:
            raise DaemonError(
                f"daemon {daemon.name} exited ({daemon.process.returncode}) before it was "
                f"ready\n{daemon.log_tail()}"
            )
        if time.monotonic() - started > timeout:
            raise DaemonError(f"daemon {daemon.name} not ready in {timeout} s\n{daemon.log_tail()}")
        time.sleep(0.05)
    return time.monotonic() - started


def stop_daemons(started: list[DaemonHandle], timeout: float = 30.0) -> list[int | None]:
    """SIGTERM to every daemon at once (both kinds end their loop and their ledger incarnation
    cleanly); each exit code, or None where it had to be killed."""
    for daemon in started:
        if daemon.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                daemon.process.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout
    for daemon in started:
        try:
            codes.append(daemon.process.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            kill_daemon(daemon)
            codes.append(None)
    return codes


def kill_daemon(daemon: DaemonHandle) -> None:
    if daemon.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            daemon.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.process.wait(15)


def ledger_cli(python: str, verb: str, ledger_paths: list[str]) -> list[tuple[int, Any]]:
    """``layout-ledger VERB --json LEDGER`` on every ledger at once: each exit code and parsed
    output."""
    running = [
        subprocess.Popen(
            [python, "-m", "layout_ledger.cli.app", verb, "--json", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in ledger_paths
    ]
    found: list[tuple[int, Any]] = []
    for process in running:
        stdout, stderr = process.communicate(timeout=120)
        try:
            found.append((process.returncode, json.loads(stdout)))
        except json.JSONDecodeError:
            found.append((process.returncode, {"stdout": stdout, "stderr": stderr}))
    return found
