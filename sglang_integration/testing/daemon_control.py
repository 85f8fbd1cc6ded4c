"""Test and demo helpers: start and stop model-less daemons, and engine-side stand-in processes.

Importing sglang costs seconds on a small CPU, and the tests start many short-lived daemons and
engine-side processes. ``process_context()`` is a ``multiprocessing`` forkserver context whose
server imports sglang's daemon, the plugin and the ledger once; every process it starts is a
fresh, separate process forked from that warm server in milliseconds, and runs the same code a
cold start would (``sglang_integration.testing.daemon.main``, ``client.attach``...).
``start_daemon(..., via_cli=True)`` starts ``python -m sglang_integration.testing.daemon`` with
``subprocess`` instead, the way a person would.

- ``start_daemon`` / ``DaemonProcess``: a model-less daemon, ready when its socket serves.
- ``EngineStandIn``: a separate engine-side process that attaches to a daemon (the connection
  stays open for its lifetime), then begins, commits, aborts or fetches when told, and
  can be killed with SIGKILL at any point.
- ``request`` / ``send_raw``: one request (or raw bytes) on a short connection, sglang framing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from sglang_integration.testing.sglang_env import QUIET_SGLANG_ENV

# Imported once by the forkserver; a module missing here is imported by each child instead.
# One list for daemons and engine ranks alike: the server's preload list is fixed when it first
# starts, and whichever test or demo starts it first decides for everyone after.
PRELOAD_MODULES = (
    "sglang.srt.weight_cache.daemon",
    "sglang.srt.weight_cache.protocol",
    "sglang.srt.weight_cache.transport",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.utils",
    "layout_ledger.store.ledger",
    "layout_ledger.store.migrate",
    "alembic.command",
    "alembic.config",
    "alembic.script",
    "alembic.runtime.migration",
    "alembic.runtime.environment",
    "alembic.operations",
    "alembic.autogenerate",
    "layout_ledger.wire.service",
    "layout_ledger.history.reader",
    "sglang_integration.engine.client",
    "sglang_integration.daemon.hooks",
    "sglang_integration.testing.daemon",
    "sglang_integration.testing.expert_files",
    "sglang_integration.content.fingerprints",
    "sglang_integration.testing.daemon_control",
    # what an engine rank imports (sglang_integration.testing.cpu_engine)
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.weight_cache.ipc_loader",
    "sglang.srt.server_args",
    "sglang.srt.configs.model_config",
    "sglang.srt.models.registry",  # imports every model module: the first arch lookup
    "sglang.srt.eplb.eplb_manager",
    "sglang.srt.eplb.expert_location_updater",
    "sglang_integration.plugin",
    "sglang_integration.engine.startup",
    "sglang_integration.engine.ipc_loader",
    "sglang_integration.engine.metadata",
    "sglang_integration.engine.rebalance",
    "sglang_integration.engine.load_check",
    "sglang_integration.testing.shared_experts",
)

START_TIMEOUT = 90.0
REQUEST_TIMEOUT = 30.0


def process_context() -> ForkServerContext:
    """The forkserver context, its server running (started with ``PRELOAD_MODULES`` imported
    and ``QUIET_SGLANG_ENV`` set, which its children inherit)."""
    context = multiprocessing.get_context("forkserver")
    if not isinstance(context, ForkServerContext):
        raise RuntimeError("this platform has no multiprocessing forkserver")
    context.set_forkserver_preload(list(PRELOAD_MODULES))
    saved = {key: os.environ.get(key) for key in QUIET_SGLANG_ENV}
    os.environ.update(QUIET_SGLANG_ENV)  # the server reads these while it imports
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return context


# --- one request ---------------------------------------------------------------------------------


def request(
    socket_path: str | os.PathLike[str], message: Any, timeout: float = REQUEST_TIMEOUT
) -> Any:
    """Send one message and return the reply, with sglang's framing, on a new connection."""
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(os.fspath(socket_path))
        send_msg(conn, message)
        return recv_msg(conn)


def send_raw(
    socket_path: str | os.PathLike[str], data: bytes, timeout: float = REQUEST_TIMEOUT
) -> bytes:
    """Send raw bytes, close the sending side, and return whatever comes back before EOF."""
    received = bytearray()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(os.fspath(socket_path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                received.extend(chunk)
    return bytes(received)


def wait_until_serving(
    socket_path: str | os.PathLike[str],
    alive: Any,
    timeout: float = START_TIMEOUT,
    describe: Any = None,
) -> None:
    """Wait for the socket file, then for a ``ping`` answer (bind precedes listen in serve).

    A probe waits for its answer as long as the deadline allows: on a loaded machine a short
    probe timeout would fail a daemon that is merely slow (and hang up on it). A probe that
    fails (refused before listen, reset by a daemon that died) is retried until the deadline.
    """
    deadline = time.monotonic() + timeout
    path = os.fspath(socket_path)
    while True:
        if not alive():
            raise RuntimeError(
                f"the daemon for {path} exited while starting: {_describe(describe)}"
            )
        if os.path.exists(path):
            left = max(deadline - time.monotonic(), 1.0)
            try:
                if request(path, {"type": "ping"}, timeout=left) == {"status": "ok"}:
                    return
            except (OSError, EOFError):  # ConnectionError and TimeoutError are OSErrors
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no daemon served {path} within {timeout:.0f} s: {_describe(describe)}"
            )
        time.sleep(0.02)


def _describe(describe: Any) -> str:
    return "" if describe is None else str(describe())


# --- model-less daemons --------------------------------------------------------------------------


def redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (and its children's) to ``log_path``."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stderr


def _run_model_less_daemon(argv: list[str], log_path: str) -> None:
    """Forkserver child: the model-less daemon's ``main``, output to ``log_path``."""
    redirect_output(log_path)
    from sglang_integration.testing import daemon

    raise SystemExit(daemon.main(argv))


@dataclass
class DaemonProcess:
    """A running model-less daemon: its process, socket, ledger and log."""

    socket_path: str
    ledger_path: str | None
    log_path: str
    argv: list[str]
    process: BaseProcess | None = None
    popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        pid = None
        if self.process is not None:
            pid = self.process.pid
        elif self.popen is not None:
            pid = self.popen.pid
        if pid is None:
            raise RuntimeError("the daemon process has not started")
        return pid

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.popen is not None and self.popen.poll() is None

    def wait(self, timeout: float) -> int | None:
        """Wait for the exit; its exit code, or None if still running after ``timeout``."""
        if self.process is not None:
            self.process.join(timeout)
            return self.process.exitcode
        popen = self.popen
        if popen is None:
            return None
        try:
            return popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (sglang's handler stops the serve loop), then wait; SIGKILL if it hangs."""
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.pid, signal.SIGTERM)
            # sglang's handler only clears a flag; the loop sees it after accept() returns,
            # which a connection makes happen now rather than at its 1 s accept timeout.
            with contextlib.suppress(OSError, EOFError, ValueError):
                request(self.socket_path, {"type": "ping"}, timeout=2.0)
        code = self.wait(timeout)
        if self.is_alive():
            self.kill()
            return None
        return code

    def kill(self) -> None:
        """SIGKILL: a daemon crash (no clean end of its ledger incarnation)."""
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(self.pid, signal.SIGKILL)
        self.wait(30.0)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except FileNotFoundError:
            return ""


def daemon_argv(
    socket_path: str,
    ledger_path: str | None,
    *,
    num_layers: int,
    num_logical_experts: int,
    num_physical_experts: int,
    record: str = "ledger",
    extra: Sequence[str] = (),
) -> list[str]:
    """The model-less daemon's command line; ``record`` is ledger, memory, none or no-plugin."""
    argv = [
        "--socket",
        socket_path,
        "--num-layers",
        str(num_layers),
        "--num-logical-experts",
        str(num_logical_experts),
        "--num-physical-experts",
        str(num_physical_experts),
    ]
    if ledger_path is not None:
        argv += ["--ledger", ledger_path]
    flags = {"ledger": [], "memory": ["--in-memory"], "none": ["--no-record"]}
    flags["no-plugin"] = ["--without-plugin"]
    if record not in flags:
        raise ValueError(f"record must be one of {sorted(flags)}, got {record!r}")
    return argv + flags[record] + list(extra)


def start_daemon(
    directory: str | os.PathLike[str],
    name: str = "daemon",
    *,
    num_layers: int = 4,
    num_logical_experts: int = 8,
    num_physical_experts: int = 10,
    record: str = "ledger",
    ledger_path: str | os.PathLike[str] | None = None,
    via_cli: bool = False,
    extra: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> DaemonProcess:
    """Start a model-less daemon in ``directory`` and wait until it serves."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    socket_path = str(directory / f"{name}.sock")
    ledger = None
    if record == "ledger":
        ledger = (
            os.fspath(ledger_path) if ledger_path is not None else str(directory / f"{name}.sqlite")
        )
    log_path = str(directory / f"{name}.log")
    argv = daemon_argv(
        socket_path,
        ledger,
        num_layers=num_layers,
        num_logical_experts=num_logical_experts,
        num_physical_experts=num_physical_experts,
        record=record,
        extra=extra,
    )
    handle = DaemonProcess(socket_path, ledger, log_path, argv)
    if via_cli:
        with open(log_path, "ab") as log:
            handle.popen = subprocess.Popen(
                [sys.executable, "-m", "sglang_integration.testing.daemon", *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **QUIET_SGLANG_ENV},
            )
    else:
        handle.process = process_context().Process(
            target=_run_model_less_daemon, args=(argv, log_path), daemon=True
        )
        handle.process.start()
    try:
        wait_until_serving(socket_path, handle.is_alive, timeout, handle.log)
    except BaseException:
        handle.kill()
        raise
    return handle


def _signal(process: BaseProcess, signum: int) -> None:
    """Signal a still-running process (the forkserver reaps its children, so it may be gone)."""
    if process.pid is not None and process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)


# --- engine-side stand-ins -----------------------------------------------------------------------


def _engine_stand_in(socket_path: str, engine_id: str, commands: Connection) -> None:
    """Forkserver child: attach, report, then obey commands until told to exit or killed."""
    from sglang_integration.engine import client

    attachment = client.attach(socket_path, engine_id)
    commands.send(attachment.reply)
    while True:
        try:
            verb, fields = commands.recv()
        except EOFError:
            return  # the controlling process is gone
        if verb == "exit":
            attachment.close()
            commands.send(None)
            return
        if verb == "begin":
            reply: Any = client.begin(
                socket_path, engine_id, fields["base_version"], fields["layers"]
            )
        elif verb == "commit":
            reply = client.commit(socket_path, engine_id, fields["rows"])
        elif verb == "abort":
            reply = client.abort(socket_path, engine_id)
        elif verb == "fetch_state":
            message: dict[str, Any] = {"type": "fetch_state", "config": fields["config"]}
            if fields.get("expert_layout") is not None:
                message["expert_layout"] = fields["expert_layout"]
            reply = request(socket_path, message)
        else:
            reply = ValueError(f"unknown stand-in command {verb!r}")
        commands.send(reply)


@dataclass
class EngineStandIn:
    """A separate engine-side process attached to one daemon (see the module docstring)."""

    socket_path: str
    engine_id: str
    process: BaseProcess
    commands: Connection
    attach_reply: Any = None
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def start(
        cls,
        socket_path: str | os.PathLike[str],
        engine_id: str,
        timeout: float = START_TIMEOUT,
    ) -> EngineStandIn:
        context = process_context()
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_engine_stand_in,
            args=(os.fspath(socket_path), engine_id, theirs),
            daemon=True,
        )
        process.start()
        theirs.close()
        stand_in = cls(os.fspath(socket_path), engine_id, process, ours)
        stand_in.attach_reply = stand_in._receive(timeout)
        return stand_in

    @property
    def pid(self) -> int:
        if self.process.pid is None:
            raise RuntimeError("the stand-in has not started")
        return self.process.pid

    def _receive(self, timeout: float) -> Any:
        if not self.commands.poll(timeout):
            raise TimeoutError(f"engine stand-in {self.engine_id!r} did not answer in {timeout} s")
        return self.commands.recv()

    def _ask(self, verb: str, timeout: float = REQUEST_TIMEOUT, **fields: Any) -> Any:
        self.commands.send((verb, fields))
        reply = self._receive(timeout)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def begin(self, base_version: int, layers: Sequence[int]) -> Any:
        return self._ask("begin", base_version=base_version, layers=list(layers))

    def commit(self, rows: Mapping[int, Sequence[int]]) -> Any:
        return self._ask("commit", rows={layer: list(row) for layer, row in rows.items()})

    def abort(self) -> Any:
        return self._ask("abort")

    def fetch_state(self, config: Mapping[str, Any], expert_layout: Any = None) -> Any:
        return self._ask("fetch_state", config=dict(config), expert_layout=expert_layout)

    def kill(self) -> None:
        """SIGKILL the engine process (the kernel closes its attach connection)."""
        _signal(self.process, signal.SIGKILL)
        self.process.join(30)
        self._close()

    def exit(self) -> None:
        """A clean exit: close the attach connection, then end the process."""
        if self.process.is_alive():
            self._ask("exit")
        self.process.join(30)
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self.commands.close()
            self._closed = True


@contextlib.contextmanager
def stand_ins(
    socket_path: str | os.PathLike[str], engine_ids: Sequence[str]
) -> Iterator[list[EngineStandIn]]:
    """Several attached stand-ins, killed on the way out."""
    started: list[EngineStandIn] = []
    try:
        for engine_id in engine_ids:
            started.append(EngineStandIn.start(socket_path, engine_id))
        yield started
    finally:
        for stand_in in started:
            stand_in.kill()
