"""Daemon restarts: a new incarnation, the old history kept, crashes named.

Model-less daemons (sglang's real serve loop with the plugin) on one ledger file, started one
after another; one of them through ``python -m sglang_integration.testing.daemon`` itself.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire import protocol as msg
from sglang_integration.engine import client
from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    EngineStandIn,
    request,
    start_daemon,
)

pytestmark = pytest.mark.timeout(180)

LAYERS, LOGICAL, PHYSICAL = 3, 6, 8
INITIAL = trivial_map(LAYERS, PHYSICAL, LOGICAL)
ROW_A = [(slot + 1) % LOGICAL for slot in range(PHYSICAL)]
ROW_B = [(slot + 2) % LOGICAL for slot in range(PHYSICAL)]


def start(directory: Path, **options: Any) -> DaemonProcess:
    return start_daemon(
        directory,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        **options,
    )


def incarnations(daemon: DaemonProcess) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT incarnation_id, end_state, current_version FROM ledger_incarnations "
            "ORDER BY incarnation_id"
        ).fetchall()


def test_a_daemon_restarted_with_restore_initial_starts_at_version_0_keeping_the_history(
    tmp_path: Path,
) -> None:
    first = start(tmp_path)
    engine = client.attach(first.socket_path, "engine-A")
    assert client.begin(first.socket_path, "engine-A", 0, [0]).ok
    assert client.commit(first.socket_path, "engine-A", {0: ROW_A}).ok
    assert client.begin(first.socket_path, "engine-A", 1, [0, 2]).ok
    assert client.commit(first.socket_path, "engine-A", {0: ROW_B, 2: ROW_A}).ok
    engine.close()
    assert first.stop() == 0  # SIGTERM: a clean exit
    assert incarnations(first) == [(1, "clean", 2)]

    # python -m sglang_integration.testing.daemon, loading sglang's initial layout (the
    # default, restoring version 2, is tests/test_daemon_restore.py's)
    second = start(tmp_path, via_cli=True, extra=["--expert-layout-restore", "initial"])
    try:
        state = request(second.socket_path, {"type": msg.QUERY})["layout"]
        assert (state["version"], state["physical_to_logical_map"]) == (0, INITIAL)
        assert state["restored_from"] is None
        assert state["digest"] == layout_digest(INITIAL)
        with LedgerReader(second.ledger_path) as reader:
            previous = reader.state(1)
            current = reader.state()
        assert previous.version == 2
        assert previous.physical_to_logical_map == [ROW_B, INITIAL[1], ROW_A]
        assert (current.incarnation_id, current.version) == (2, 0)
        with sqlite3.connect(f"file:{second.ledger_path}?mode=ro", uri=True) as conn:
            history = conn.execute(
                "SELECT version, slots FROM ledger_layout_history "
                "WHERE incarnation_id = 1 AND layer = 0 ORDER BY version"
            ).fetchall()
        assert [(version, json.loads(slots)) for version, slots in history] == [
            (0, INITIAL[0]),
            (1, ROW_A),
            (2, ROW_B),
        ]
        assert "the previous daemon incarnation" not in second.log()  # it ended clean
    finally:
        assert second.stop() == 0
    assert incarnations(second) == [(1, "clean", 2), (2, "clean", 0)]


def test_the_next_start_names_a_killed_daemons_incarnation_and_its_end_state(
    tmp_path: Path,
) -> None:
    first = start(tmp_path)
    engine = EngineStandIn.start(first.socket_path, "engine-A")
    assert engine.begin(0, [1]).ok
    first.kill()  # the daemon crashes while engine-A's move is pending
    engine.kill()

    second = start(tmp_path)
    try:
        log = second.log()
        assert "the previous daemon incarnation 1 ended unknown" in log
        rows = incarnations(second)
        assert rows[0][:2] == (1, "unknown") and rows[1] == (2, None, 0)
        state = request(second.socket_path, {"type": msg.QUERY})["layout"]
        assert (state["version"], state["dirty"], state["pending"]) == (0, False, None)
    finally:
        second.stop()


def test_the_next_start_names_a_dirty_incarnation(tmp_path: Path) -> None:
    first = start(tmp_path)
    engine = EngineStandIn.start(first.socket_path, "engine-A")
    assert engine.begin(0, [2]).ok
    engine.kill()
    deadline = time.monotonic() + 10
    while not request(first.socket_path, {"type": msg.QUERY})["layout"]["dirty"]:
        assert time.monotonic() < deadline, "the daemon never saw the engine's EOF"
        time.sleep(0.01)
    assert first.stop() == 0
    assert incarnations(first)[0][1] == "dirty"

    second = start(tmp_path)
    try:
        assert "the previous daemon incarnation 1 ended dirty" in second.log()
        assert request(second.socket_path, {"type": msg.QUERY})["layout"]["dirty"] is False
    finally:
        second.stop()


def test_a_second_daemon_on_the_same_ledger_fails_at_start(tmp_path: Path) -> None:
    first = start(tmp_path, name="first")
    try:
        with pytest.raises(RuntimeError, match="exited while starting"):
            start(tmp_path, name="second", ledger_path=first.ledger_path)
        log = (tmp_path / "second.log").read_text()
        assert "cannot open the expert layout ledger" in log
        assert request(first.socket_path, {"type": "ping"}) == {"status": "ok"}
    finally:
        first.stop()
