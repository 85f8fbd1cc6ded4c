"""The daemon's expert layout requests, over a real Unix socket to sglang's real WeightCacheDaemon.

Each test starts a model-less daemon (``sglang_integration.testing.daemon``: sglang's real
``serve`` loop and ``_handle_connection`` with this plugin's hooks, a real ledger file) in its own
process, and talks to it with the engine-side client or with raw requests. Engines that must be
separate processes are ``EngineStandIn``\\ s. The ledger is read back with ``LedgerReader`` and
the stable ``ledger_events`` view.
"""

from __future__ import annotations

import sqlite3
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
MOVED_ROW = [(slot + 3) % LOGICAL for slot in range(PHYSICAL)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    handle = start_daemon(
        tmp_path,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the malformed-request tests, with engine-A attached from this process.

    Those tests leave no move pending and the map unchanged, so they can share it.
    """
    handle = start_daemon(
        tmp_path_factory.mktemp("shared"),
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
    )
    engine = client.attach(handle.socket_path, "engine-A")
    assert engine.reply.ok
    yield handle
    engine.close()
    handle.stop()


def layout(daemon: DaemonProcess) -> dict[str, Any]:
    reply = request(daemon.socket_path, {"type": msg.QUERY})
    assert reply["status"] == msg.OK, reply
    return reply["layout"]


def events(daemon: DaemonProcess) -> list[dict[str, Any]]:
    """The ledger's events through the forensic view, oldest first."""
    assert daemon.ledger_path is not None
    with sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute("SELECT * FROM ledger_events ORDER BY event_id")]


def kinds(daemon: DaemonProcess) -> list[str]:
    return [event["kind"] for event in events(daemon)]


def cache_config(daemon: DaemonProcess) -> dict[str, Any]:
    return request(daemon.socket_path, {"type": "query_config"})["config"]


def wait_detached(daemon: DaemonProcess, engine_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_id in layout(daemon)["attached"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon never detached {engine_id!r}")
        time.sleep(0.01)


# --- versions, begin / commit / abort ---------------------------------------------------------


def test_commit_stores_the_pending_rows_and_increments_the_version(daemon: DaemonProcess) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        assert engine.reply.ok and engine.reply.layout is not None
        assert engine.reply.layout.version == 0
        assert engine.reply.layout.digest == layout_digest(INITIAL)
        assert client.begin(daemon.socket_path, "engine-A", 0, [2, 0]).ok
        assert layout(daemon)["pending"] == {
            "engine_id": "engine-A",
            "layers": [0, 2],
            "base_version": 0,
        }

        committed = client.commit(daemon.socket_path, "engine-A", {0: MOVED_ROW, 2: MOVED_ROW})
        expected = [MOVED_ROW, INITIAL[1], MOVED_ROW, INITIAL[3]]
        assert committed.ok, committed
        assert committed.body["version"] == 1
        assert committed.body["digest"] == layout_digest(expected)

        state = layout(daemon)
        assert (state["version"], state["pending"]) == (1, None)
        assert state["physical_to_logical_map"] == expected
        # The commit is in the ledger file (written before the reply).
        with LedgerReader(daemon.ledger_path) as reader:
            on_disk = reader.state()
        assert (on_disk.version, on_disk.digest) == (1, layout_digest(expected))
        assert on_disk.physical_to_logical_map == expected

        assert client.begin(daemon.socket_path, "engine-A", 1, [1]).ok
        assert client.commit(daemon.socket_path, "engine-A", {1: MOVED_ROW}).body["version"] == 2
    finally:
        engine.close()


def test_abort_clears_the_move_without_a_change(daemon: DaemonProcess) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        assert client.begin(daemon.socket_path, "engine-A", 0, [1, 3]).ok
        assert client.abort(daemon.socket_path, "engine-A").ok
        state = layout(daemon)
        assert (state["version"], state["pending"]) == (0, None)
        assert state["physical_to_logical_map"] == INITIAL
        again = client.abort(daemon.socket_path, "engine-A")
        assert again.outcome is Outcome.REFUSED and "no move pending" in (again.reason or "")
        assert kinds(daemon)[-3:] == ["begin", "abort", "abort_refused"]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ({0: MOVED_ROW}, "rows cover layers [0]"),  # one of the two pending layers
        ({0: MOVED_ROW, 1: MOVED_ROW, 2: MOVED_ROW}, "rows cover layers [0, 1, 2]"),
        ({0: MOVED_ROW, 1: MOVED_ROW[:-1]}, f"has {PHYSICAL - 1} slots"),
        ({0: MOVED_ROW, 1: [LOGICAL, *MOVED_ROW[1:]]}, f"outside [0, {LOGICAL})"),
        ({0: MOVED_ROW, 1: [-1, *MOVED_ROW[1:]]}, f"outside [0, {LOGICAL})"),
        ({0: MOVED_ROW, 1: [0.0, *MOVED_ROW[1:]]}, "expected an int"),
        ({"0": MOVED_ROW, 1: MOVED_ROW}, "is not an int layer"),
        ([MOVED_ROW, MOVED_ROW], "rows must be a dict"),
    ],
)
def test_a_refused_commit_leaves_the_move_pending_and_the_map_unchanged(
    shared: DaemonProcess, rows: Any, why: str
) -> None:
    assert client.begin(shared.socket_path, "engine-A", 0, [0, 1]).ok
    try:
        reply = request(
            shared.socket_path, {"type": msg.COMMIT, "engine_id": "engine-A", "rows": rows}
        )
        assert reply["status"] == msg.REFUSED and why in reply["reason"], reply
        state = layout(shared)
        assert state["pending"] == {"engine_id": "engine-A", "layers": [0, 1], "base_version": 0}
        assert (state["version"], state["physical_to_logical_map"]) == (0, INITIAL)
        assert kinds(shared)[-1] == "commit_refused"
    finally:
        assert client.abort(shared.socket_path, "engine-A").ok


def test_a_pending_move_can_be_committed_after_a_refused_commit(daemon: DaemonProcess) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        assert client.begin(daemon.socket_path, "engine-A", 0, [0, 1]).ok
        bad = client.commit(daemon.socket_path, "engine-A", {0: MOVED_ROW})
        assert bad.outcome is Outcome.REFUSED
        good = client.commit(daemon.socket_path, "engine-A", {0: MOVED_ROW, 1: MOVED_ROW})
        assert good.ok and good.body["version"] == 1
    finally:
        engine.close()


def test_a_commit_from_another_engine_is_refused_and_leaves_the_move_pending(
    shared: DaemonProcess,
) -> None:
    assert client.begin(shared.socket_path, "engine-A", 0, [0]).ok
    try:
        reply = client.commit(shared.socket_path, "engine-B", {0: MOVED_ROW})
        assert reply.outcome is Outcome.REFUSED
        assert "engine 'engine-A'" in (reply.reason or "")
        assert layout(shared)["pending"]["engine_id"] == "engine-A"
        assert client.abort(shared.socket_path, "engine-B").outcome is Outcome.REFUSED
        assert layout(shared)["pending"]["engine_id"] == "engine-A"
    finally:
        assert client.abort(shared.socket_path, "engine-A").ok


# --- malformed moves ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base_version", "layers", "why"),
    [
        (0, [], "layers is empty"),
        (0, [1, 1], "appears twice"),
        (0, [LAYERS], f"outside [0, {LAYERS})"),
        (0, [-1], f"outside [0, {LAYERS})"),
        (0, [0, "1"], "is not an int"),
        (0, [True], "is not an int"),
        (0, list(range(100_000)), f"the model has {LAYERS} layers"),
        (0, "0,1", "layers must be a list"),
        (1, [0], "is not the current version 0"),
        ("0", [0], "base_version must be an int"),
        (None, [0], "base_version must be an int"),
    ],
)
def test_a_malformed_begin_is_refused_and_changes_nothing(
    shared: DaemonProcess, base_version: Any, layers: Any, why: str
) -> None:
    before = kinds(shared)
    reply = request(
        shared.socket_path,
        {
            "type": msg.BEGIN,
            "engine_id": "engine-A",
            "base_version": base_version,
            "layers": layers,
        },
    )
    assert reply["status"] == msg.REFUSED and why in reply["reason"], reply
    state = layout(shared)
    assert state["pending"] is None and state["attached"] == ["engine-A"]
    assert kinds(shared) == [*before, "begin_refused"]


def test_begin_from_an_engine_that_is_not_attached_is_refused(shared: DaemonProcess) -> None:
    reply = client.begin(shared.socket_path, "ghost", 0, [0])
    assert reply.outcome is Outcome.REFUSED and "not attached" in (reply.reason or "")
    assert layout(shared)["pending"] is None


def test_a_second_begin_of_the_same_engine_is_refused_while_its_move_is_pending(
    shared: DaemonProcess,
) -> None:
    assert client.begin(shared.socket_path, "engine-A", 0, [0]).ok
    try:
        again = client.begin(shared.socket_path, "engine-A", 0, [1])
        assert again.outcome is Outcome.REFUSED and "already has a move" in (again.reason or "")
        assert layout(shared)["pending"]["layers"] == [0]
    finally:
        assert client.abort(shared.socket_path, "engine-A").ok


def test_an_engine_id_already_attached_cannot_attach_twice(shared: DaemonProcess) -> None:
    second = client.attach(shared.socket_path, "engine-A")
    assert second.reply.outcome is Outcome.REFUSED and not second.is_open
    assert "already attached" in (second.reply.reason or "")
    assert layout(shared)["attached"] == ["engine-A"]


# --- the one-mover rule ---------------------------------------------------------------------------


def test_a_standby_makes_begin_busy_and_takes_over_at_the_current_version_when_the_first_exits(
    daemon: DaemonProcess,
) -> None:
    first = EngineStandIn.start(daemon.socket_path, "engine-A")
    standby = None
    try:
        assert first.attach_reply.ok
        assert first.begin(0, [0]).ok
        assert first.commit({0: MOVED_ROW}).body["version"] == 1

        standby = EngineStandIn.start(daemon.socket_path, "engine-B-standby")
        assert standby.attach_reply.ok and standby.attach_reply.layout.version == 1
        busy = first.begin(1, [1])
        assert busy.outcome is Outcome.BUSY and "engine-B-standby" in (busy.reason or "")
        assert standby.begin(1, [1]).outcome is Outcome.BUSY
        # A begin that would be refused is refused, never busy (stale base version).
        assert standby.begin(0, [1]).outcome is Outcome.REFUSED
        assert layout(daemon)["pending"] is None and kinds(daemon).count("begin_busy") == 2

        first.exit()
        wait_detached(daemon, "engine-A")
        stale = standby.begin(0, [1])
        assert stale.outcome is Outcome.REFUSED
        assert "is not the current version 1" in (stale.reason or "")
        assert standby.begin(1, [1]).ok
        assert standby.commit({1: MOVED_ROW}).body["version"] == 2
    finally:
        first.kill()
        if standby is not None:
            standby.kill()


def test_a_standby_that_attached_during_a_move_must_name_the_version_after_it(
    daemon: DaemonProcess,
) -> None:
    first = EngineStandIn.start(daemon.socket_path, "engine-A")
    standby = None
    try:
        assert first.begin(0, [0, 1]).ok
        standby = EngineStandIn.start(daemon.socket_path, "engine-B")
        assert standby.attach_reply.layout.pending.engine_id == "engine-A"
        assert first.commit({0: MOVED_ROW, 1: MOVED_ROW}).body["version"] == 1  # commit still ok
        first.kill()
        wait_detached(daemon, "engine-A")
        assert standby.begin(0, [2]).outcome is Outcome.REFUSED
        assert standby.begin(1, [2]).ok
    finally:
        first.kill()
        if standby is not None:
            standby.kill()


# --- fetch_state and engines that do not follow the layout ----------------------------------------


def test_a_fetch_without_the_field_at_version_0_is_served_and_then_disables_moves(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        served = request(
            daemon.socket_path, {"type": "fetch_state", "config": cache_config(daemon)}
        )
        assert served["status"] == "ok" and served["entries"] == {}
        assert layout(daemon)["non_following_fetch"] is True
        refused = client.begin(daemon.socket_path, "engine-A", 0, [0])
        assert refused.outcome is Outcome.REFUSED
        assert "does not follow the expert layout" in (refused.reason or "")
        assert [e["kind"] for e in events(daemon)][-2:] == ["non_following_fetch", "begin_refused"]
    finally:
        engine.close()


def test_a_fetch_with_a_matching_digest_from_an_unattached_engine_disables_moves(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        field = {"engine_id": "engine-unattached", "version": 0, "digest": layout_digest(INITIAL)}
        served = request(
            daemon.socket_path,
            {"type": "fetch_state", "config": cache_config(daemon), "expert_layout": field},
        )
        assert served["status"] == "ok"
        assert client.begin(daemon.socket_path, "engine-A", 0, [0]).outcome is Outcome.REFUSED
    finally:
        engine.close()


def test_a_following_fetch_is_served_and_leaves_moves_enabled(daemon: DaemonProcess) -> None:
    engine = EngineStandIn.start(daemon.socket_path, "engine-A")
    try:
        field = {"engine_id": "engine-A", "version": 0, "digest": layout_digest(INITIAL)}
        served = engine.fetch_state(cache_config(daemon), field)
        assert served["status"] == "ok"
        assert layout(daemon)["non_following_fetch"] is False
        assert engine.begin(0, [0]).ok
    finally:
        engine.kill()


def test_fetch_state_is_refused_with_a_reason_when_the_digest_differs_or_a_move_is_pending(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        config = cache_config(daemon)
        wrong = {"engine_id": "engine-A", "version": 0, "digest": "0" * 64}
        reply = request(
            daemon.socket_path, {"type": "fetch_state", "config": config, "expert_layout": wrong}
        )
        assert reply["status"] == msg.LAYOUT_REFUSED and "restart the engine" in reply["reason"]
        assert client.begin(daemon.socket_path, "engine-A", 0, [0]).ok
        right = {"engine_id": "engine-A", "version": 0, "digest": layout_digest(INITIAL)}
        reply = request(
            daemon.socket_path, {"type": "fetch_state", "config": config, "expert_layout": right}
        )
        assert reply["status"] == msg.LAYOUT_REFUSED and "is moving layers [0]" in reply["reason"]
        assert kinds(daemon).count("fetch_refused") == 2
    finally:
        engine.close()


def test_a_config_mismatch_gets_sglangs_reply_before_any_layout_check(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-A")
    try:
        assert client.begin(daemon.socket_path, "engine-A", 0, [0]).ok  # a fetch would be refused
        config = {**cache_config(daemon), "tp_size": 2}
        reply = request(daemon.socket_path, {"type": "fetch_state", "config": config})
        assert reply == {"status": "mismatch", "daemon_config": cache_config(daemon)}
        assert "fetch_refused" not in kinds(daemon)
    finally:
        engine.close()


# --- a daemon without a record (no --enable-eplb) ---------------------------------------------


def test_a_daemon_without_a_record_answers_no_record_and_serves_fetches(tmp_path: Path) -> None:
    daemon = start_daemon(
        tmp_path,
        num_layers=LAYERS,
        num_logical_experts=LOGICAL,
        num_physical_experts=PHYSICAL,
        record="none",
    )
    try:
        attach = client.attach(daemon.socket_path, "engine-A")
        assert attach.reply.outcome is Outcome.NO_RECORD and not attach.is_open
        assert client.query(daemon.socket_path).outcome is Outcome.NO_RECORD
        for reply in (
            client.begin(daemon.socket_path, "engine-A", 0, [0]),
            client.commit(daemon.socket_path, "engine-A", {0: MOVED_ROW}),
            client.abort(daemon.socket_path, "engine-A"),
        ):
            assert reply.outcome is Outcome.REFUSED and "--enable-eplb" in (reply.reason or "")
        served = request(
            daemon.socket_path, {"type": "fetch_state", "config": cache_config(daemon)}
        )
        assert served["status"] == "ok"
        assert list(tmp_path.glob("*.sqlite*")) == []
    finally:
        assert daemon.stop() == 0
