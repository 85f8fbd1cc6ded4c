"""Presence by socket EOF: engine-side processes killed with SIGKILL at each point of a move.

The engine is a separate process (``EngineStandIn``) that attached to a model-less daemon
(sglang's real serve loop and request handling with the plugin, a real ledger) and was told to
begin or commit. It is then killed with SIGKILL; nothing tells the daemon but the kernel closing
the attach connection (the daemon never learns a PID), and the ledger must show what the
daemon concluded.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.protocol import Outcome
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    start_daemon,
)

pytestmark = pytest.mark.timeout(120)

LAYERS, LOGICAL, PHYSICAL = 4, 8, 10
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)
MOVED_ROW = [(slot + 5) % LOGICAL for slot in range(PHYSICAL)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    handle = start_daemon(
        tmp_path, num_layers=LAYERS, num_logical_experts=LOGICAL, num_physical_experts=PHYSICAL
    )
    yield handle
    handle.stop()


def layout(daemon: DaemonProcess) -> dict[str, Any]:
    return request(daemon.socket_path, {"type": msg.QUERY})["layout"]


def wait_detached(daemon: DaemonProcess, engine_id: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = layout(daemon)
        if engine_id not in state["attached"]:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon never detached {engine_id!r}")
        time.sleep(0.01)


def ledger_rows(daemon: DaemonProcess, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True) as conn:
        return conn.execute(sql, params).fetchall()


def fetch(daemon: DaemonProcess, field: dict[str, Any] | None = None) -> dict[str, Any]:
    config = request(daemon.socket_path, {"type": "query_config"})["config"]
    message: dict[str, Any] = {"type": "fetch_state", "config": config}
    if field is not None:
        message["expert_layout"] = field
    return request(daemon.socket_path, message)


def test_sigkill_after_begin_leaves_the_daemon_dirty_naming_engine_layers_and_base_version(
    daemon: DaemonProcess,
) -> None:
    engine = EngineStandIn.start(daemon.socket_path, "engine-killed")
    assert engine.begin(0, [3, 1]).ok
    engine.kill()

    state = wait_detached(daemon, "engine-killed")
    assert state["dirty"] is True and state["pending"] is None
    assert "engine 'engine-killed'" in state["dirty_reason"]
    assert "layers [1, 3] from version 0" in state["dirty_reason"]

    # The ledger records it: the dirty mark names the engine, the layers and the base version,
    # and the detach came from the connection's EOF.
    with LedgerReader(daemon.ledger_path) as reader:
        mark = reader.state().dirty
    assert mark is not None
    assert (mark.move.engine_id, mark.move.layers, mark.move.base_version) == (
        "engine-killed",
        (1, 3),
        0,
    )
    assert ledger_rows(
        daemon,
        "SELECT engine_id, layers, base_version FROM ledger_events WHERE kind = 'dirty'",
    ) == [("engine-killed", "[1, 3]", 0)]
    assert ledger_rows(
        daemon,
        "SELECT reason FROM ledger_events WHERE kind = 'detach' AND engine_id = ?",
        "engine-killed",
    ) == [("attach connection closed (EOF)",)]
    assert "expert layout is now dirty: engine 'engine-killed'" in daemon.log()

    # An older engine (no field) and a new engine (with the field, attached) are both refused.
    older = fetch(daemon)
    assert older["status"] == msg.LAYOUT_REFUSED and "expert layout is unknown" in older["reason"]
    newer = EngineStandIn.start(daemon.socket_path, "engine-new")
    try:
        assert newer.attach_reply.ok and newer.attach_reply.layout.dirty
        begin = newer.begin(0, [0])
        assert begin.outcome is Outcome.REFUSED
        assert "restart the daemon" in (begin.reason or "")
        field = {"engine_id": "engine-new", "version": 0, "digest": layout_digest(INITIAL)}
        refused = newer.fetch_state(
            request(daemon.socket_path, {"type": "query_config"})["config"], field
        )
        assert refused["status"] == msg.LAYOUT_REFUSED
        assert "engine 'engine-killed'" in refused["reason"]
    finally:
        newer.kill()


def test_sigkill_before_begin_detaches_without_dirtying(daemon: DaemonProcess) -> None:
    engine = EngineStandIn.start(daemon.socket_path, "engine-killed")
    assert engine.attach_reply.ok
    engine.kill()
    state = wait_detached(daemon, "engine-killed")
    assert state["dirty"] is False and state["pending"] is None
    assert fetch(daemon)["status"] == "ok"  # still served (a non-following fetch at version 0)


def test_sigkill_after_commit_keeps_the_committed_version_and_is_not_dirty(
    daemon: DaemonProcess,
) -> None:
    engine = EngineStandIn.start(daemon.socket_path, "engine-killed")
    assert engine.begin(0, [2]).ok
    assert engine.commit({2: MOVED_ROW}).body["version"] == 1
    engine.kill()
    state = wait_detached(daemon, "engine-killed")
    expected = [INITIAL[0], INITIAL[1], MOVED_ROW, INITIAL[3]]
    assert (state["dirty"], state["version"]) == (False, 1)
    assert state["physical_to_logical_map"] == expected

    # The next engine starts from version 1, fetches the weights and moves from there.
    successor = EngineStandIn.start(daemon.socket_path, "engine-next")
    try:
        assert successor.attach_reply.layout.version == 1
        field = {"engine_id": "engine-next", "version": 1, "digest": layout_digest(expected)}
        config = request(daemon.socket_path, {"type": "query_config"})["config"]
        assert successor.fetch_state(config, field)["status"] == "ok"
        assert successor.begin(1, [0]).ok
    finally:
        successor.kill()


def test_sigkill_after_abort_is_not_dirty(daemon: DaemonProcess) -> None:
    engine = EngineStandIn.start(daemon.socket_path, "engine-killed")
    assert engine.begin(0, [0]).ok
    assert engine.abort().ok
    engine.kill()
    assert wait_detached(daemon, "engine-killed")["dirty"] is False


def test_killing_one_engine_leaves_the_other_engines_attached(daemon: DaemonProcess) -> None:
    engines = [EngineStandIn.start(daemon.socket_path, f"engine-{n}") for n in range(5)]
    try:
        engines[2].kill()
        state = wait_detached(daemon, "engine-2")
        assert state["attached"] == ["engine-0", "engine-1", "engine-3", "engine-4"]
        assert engines[0].begin(0, [0]).outcome is Outcome.BUSY
        for engine in engines[1:]:
            if engine.engine_id != "engine-2":
                engine.kill()
        assert wait_detached(daemon, "engine-4")["attached"] == ["engine-0"]
        assert engines[0].begin(0, [0]).ok
    finally:
        for engine in engines:
            engine.kill()


def test_a_kill_racing_its_own_commit_leaves_memory_and_ledger_in_the_same_state(
    tmp_path: Path,
) -> None:
    """The serve loop (commit) and the watcher thread (detach) race; either may win, but the
    daemon's answers and the ledger's rows must describe the same state every time."""
    outcomes = set()
    for attempt in range(8):
        daemon = start_daemon(
            tmp_path / f"race-{attempt}",
            num_layers=LAYERS,
            num_logical_experts=LOGICAL,
            num_physical_experts=PHYSICAL,
        )
        try:
            engine = EngineStandIn.start(daemon.socket_path, "engine-racing")
            assert engine.begin(0, [0, 1]).ok
            # The kill's teardown takes the engine process some milliseconds; commits sent
            # 0-35 ms after the kill land on both sides of its EOF.
            committer = threading.Timer(
                attempt * 0.005,
                client.commit,
                args=(daemon.socket_path, "engine-racing", {0: MOVED_ROW, 1: MOVED_ROW}),
            )
            committer.start()
            engine.kill()
            committer.join(30)
            state = wait_detached(daemon, "engine-racing")
            with LedgerReader(daemon.ledger_path) as reader:
                on_disk = reader.state()
            assert (on_disk.version, on_disk.digest) == (state["version"], state["digest"])
            assert on_disk.physical_to_logical_map == state["physical_to_logical_map"]
            assert (on_disk.dirty is not None) == state["dirty"]
            assert on_disk.pending is None and state["pending"] is None
            assert list(on_disk.attached) == state["attached"] == []
            outcomes.add("dirty" if state["dirty"] else f"version {state['version']}")
        finally:
            daemon.stop()
    assert outcomes <= {"dirty", "version 1"}
