"""Stage 1: the daemon's expert memory shared by IPC handles, moved by A, read by B.

Processes, in order (each a separate process; ``Processes.close`` ends whatever still runs):

1. one daemon per geometry (``daemons``), each with its own SQLite ledger;
2. the holder (``holder``): allocates and fills the experts, serializes their IPC handles;
3. engine A (``engines``): maps the memory, replays its commits through its daemon; exits;
4. ``layout-ledger status`` on each ledger;
5. engine B, started after A exited: adopts each ledger's layout, reads every slot;
6. engine "ignored": B without the plugin's record, reads every slot against the initial layout;
7. the holder reads its own tensors; the daemons get SIGTERM; ``layout-ledger status`` and
   ``verify`` on each ledger.

Rows: ``ipc_rows`` (one table per geometry, the CPU demo's case-1 rows) and ``setup_rows``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from gpu_single import daemons
from gpu_single.engines import EngineOrder, GeometryPlan, run_engine
from gpu_single.geometry import ExpertGeometry, deepseek_v3_geometry, small_geometry
from gpu_single.holder import run_holder
from gpu_single.ipc_rows import geometry_rows, setup_rows
from gpu_single.moves import demo_case1_moves, shuffled_moves
from gpu_single.results import Stage

HOLDER_TIMEOUT = 300.0
ENGINE_TIMEOUT = 300.0
DSV3_REBALANCES = 3
DSV3_EP_SIZE = 8


class StageFailure(RuntimeError):
    """A process of the stage failed, died or did not answer in time."""


@dataclass
class IpcSettings:
    device: str
    scale: int
    daemon_kind: str
    work: Path
    python: str
    context: BaseContext


@dataclass
class Processes:
    """Everything the stage started, ended by ``close`` however the stage ends."""

    daemons: list[daemons.DaemonHandle] = field(default_factory=list)
    others: list[BaseProcess] = field(default_factory=list)
    holder_channel: Connection | None = None

    def close(self) -> None:
        if self.holder_channel is not None:
            with contextlib.suppress(OSError, ValueError):
                self.holder_channel.send(("exit", None))
        for process in self.others:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(10)
        for daemon in self.daemons:
            daemons.kill_daemon(daemon)


def stage_geometries(scale: int) -> list[ExpertGeometry]:
    return [small_geometry(), deepseek_v3_geometry(1, scale)]


def make_plans(geometries: list[ExpertGeometry], sockets: list[str]) -> tuple[GeometryPlan, ...]:
    plans = []
    for geometry, socket_path in zip(geometries, sockets, strict=True):
        if geometry.name == "small":
            moves = demo_case1_moves(geometry)
        else:
            moves = shuffled_moves(geometry, DSV3_REBALANCES, DSV3_EP_SIZE)
        plans.append(GeometryPlan(geometry, socket_path, moves))
    return tuple(plans)


def receive(channel: Connection, process: BaseProcess, timeout: float, what: str) -> Any:
    """The process's next message; raise if it died, failed or did not answer in time."""
    deadline = time.monotonic() + timeout
    while not channel.poll(0.2):
        if not process.is_alive() and not channel.poll(0):
            raise StageFailure(f"{what} exited ({process.exitcode}) without a report")
        if time.monotonic() > deadline:
            raise StageFailure(f"{what} did not answer within {timeout:.0f} s")
    try:
        message = channel.recv()
    except EOFError:
        process.join(5)
        raise StageFailure(f"{what} exited ({process.exitcode}) without a report") from None
    if message.get("event") == "error":
        raise StageFailure(f"{what} failed:\n{message['error']}")
    return message


def start_holder(
    settings: IpcSettings, geometries: list[ExpertGeometry], processes: Processes
) -> tuple[Connection, BaseProcess]:
    ours, theirs = settings.context.Pipe()
    holder = settings.context.Process(
        target=run_holder, args=(settings.device, geometries, theirs), name="holder"
    )
    holder.start()
    theirs.close()
    processes.others.append(holder)
    processes.holder_channel = ours
    return ours, holder


def engine_handles(channel: Connection, holder: BaseProcess) -> bytes:
    """The holder's IPC handles for the next engine."""
    channel.send(("share", None))
    blob: bytes = receive(channel, holder, HOLDER_TIMEOUT, "the holder")["blob"]
    return blob


def run_role(
    settings: IpcSettings, role: str, plans: tuple[GeometryPlan, ...], blob: bytes
) -> dict[str, Any]:
    """Start one engine process on these handles, wait for its report and its exit."""
    order = EngineOrder(
        role, settings.device, blob, plans, settings.daemon_kind == daemons.LEDGER_SERVICE
    )
    ours, theirs = settings.context.Pipe()
    engine = settings.context.Process(target=run_engine, args=(order, theirs), name=role)
    engine.start()
    theirs.close()
    try:
        report: dict[str, Any] = receive(ours, engine, ENGINE_TIMEOUT, f"engine {role}")
        engine.join(60)
        if engine.is_alive():
            raise StageFailure(f"engine {role} reported but did not exit")
    finally:
        if engine.is_alive():
            engine.kill()
            engine.join(10)
        ours.close()
    report["exit_code"] = engine.exitcode
    return report


def ledger_states(settings: IpcSettings, started: list[daemons.DaemonHandle]) -> list[Any]:
    paths = [daemon.ledger_path for daemon in started]
    found = daemons.ledger_cli(settings.python, "status", paths)
    # status --json is a list of one per ledger (a package from before that: the report itself).
    return [
        output["ledgers"][0] if isinstance(output.get("ledgers"), list) else output
        for _, output in found
    ]


def run_ipc_stage(settings: IpcSettings) -> list[Stage]:
    """The stage's tables: setup, then one per geometry."""
    geometries = stage_geometries(settings.scale)
    setup = Stage("1 setup", "Stage 1: processes, memory and IPC handles")
    tables = [Stage(f"1 {g.name}", f"Stage 1, {g.name}: {g.description}") for g in geometries]
    started = time.monotonic()
    processes = Processes()
    try:
        facts = _run(settings, geometries, processes)
        setup_rows(setup, settings.device, settings.daemon_kind, geometries, facts)
        for table, plan in zip(tables, facts["plans"], strict=True):
            geometry_rows(table, plan, facts)
    except (StageFailure, daemons.DaemonError) as exc:
        for stage in (setup, *tables):
            stage.status = "failed: a process of the stage failed"
        setup.notes += [str(exc), *(daemon.log_tail() for daemon in processes.daemons)]
    finally:
        processes.close()
    for stage in (setup, *tables):
        stage.seconds = time.monotonic() - started
    return [setup, *tables]


def _run(
    settings: IpcSettings, geometries: list[ExpertGeometry], processes: Processes
) -> dict[str, Any]:
    kind, work = settings.daemon_kind, settings.work
    forkserver = settings.context if settings.context.get_start_method() == "forkserver" else None
    daemon_handles = [
        daemons.start_daemon(
            kind,
            work,
            f"daemon-{g.name}",
            g.layout_geometry(),
            settings.python,
            forkserver=forkserver,
        )
        for g in geometries
    ]
    processes.daemons.extend(daemon_handles)
    channel, holder = start_holder(settings, geometries, processes)
    ready = receive(channel, holder, HOLDER_TIMEOUT, "the holder")
    daemon_wait = [daemons.wait_ready(handle) for handle in daemon_handles]
    plans = make_plans(geometries, [handle.socket_path for handle in daemon_handles])
    facts: dict[str, Any] = {"plans": plans, "holder": ready, "daemon_wait": daemon_wait}
    progress("holder and daemons ready")
    facts["A"] = run_role(settings, "A", plans, engine_handles(channel, holder))
    progress("engine A done and exited")
    facts["after_A"] = ledger_states(settings, daemon_handles)
    facts["B"] = run_role(settings, "B", plans, engine_handles(channel, holder))
    progress("engine B done and exited")
    facts["ignored"] = run_role(settings, "ignored", plans, engine_handles(channel, holder))
    progress("engine B ignoring the record done and exited")
    channel.send(("read", None))
    facts["holder_held"] = receive(channel, holder, HOLDER_TIMEOUT, "the holder")["held"]
    facts["daemon_exit"] = daemons.stop_daemons(daemon_handles)
    facts["after_stop"] = ledger_states(settings, daemon_handles)
    paths = [daemon.ledger_path for daemon in daemon_handles]
    facts["verify"] = [code for code, _ in daemons.ledger_cli(settings.python, "verify", paths)]
    progress("daemons stopped, ledgers read")
    return facts


_T0 = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f} s] stage 1: {message}", flush=True)
