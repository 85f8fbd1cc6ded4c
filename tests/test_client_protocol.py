"""The engine's layout client: typed outcomes over real Unix sockets, timeouts on every operation.

The older daemon is sglang 0.5.23's own ``WeightCacheDaemon`` serve loop without the plugin
(``model_less_daemon(record="no-plugin")`` in tests/test_engine_startup_hook.py). Replies that
no daemon would send (a malformed layout, an unknown status) come from a scripted peer on a real
Unix socket.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
from test_engine_startup_hook import model_less_daemon, scripted_peer

from layout_ledger.core.state import PendingMove
from layout_ledger.wire import protocol
from layout_ledger.wire.protocol import LayoutView, Outcome, ProtocolViolation
from sglang_integration.engine import client


def reply_with(body: Any) -> Any:
    def handle(conn: socket.socket) -> None:
        from sglang.srt.weight_cache.protocol import recv_msg, send_msg

        recv_msg(conn)
        send_msg(conn, body)

    return handle


# --- the older daemon -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_every_layout_request_to_an_older_daemon_reads_as_older_daemon(tmp_path: Path) -> None:
    with model_less_daemon(tmp_path, record="no-plugin") as older:
        path = older.socket_path
        attachment = client.attach(path, "engine-a")
        replies = {
            "attach": attachment.reply,
            "query": client.query(path),
            "begin": client.begin(path, "engine-a", 0, [0]),
            "commit": client.commit(path, "engine-a", {0: [0, 1, 2, 3]}),
            "abort": client.abort(path, "engine-a"),
        }
    assert not attachment.is_open
    for name, reply in replies.items():
        assert reply.outcome is Outcome.OLDER_DAEMON, (name, reply)
    assert replies["attach"].reason == "Unknown request type: expert_layout_attach"
    assert replies["query"].reason == "Unknown request type: expert_layout_query"


# --- no daemon, a dead daemon, a hung daemon ------------------------------------------------


def test_a_missing_socket_reads_as_no_daemon(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.sock")
    attachment = client.attach(path, "engine-a")
    assert attachment.reply.outcome is Outcome.NO_DAEMON
    assert not attachment.is_open
    assert client.query(path).outcome is Outcome.NO_DAEMON
    assert client.begin(path, "engine-a", 0, [1]).outcome is Outcome.NO_DAEMON


def test_a_socket_without_a_listener_reads_as_unreachable(tmp_path: Path) -> None:
    path = tmp_path / "crashed.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays; connect() is refused, as after a daemon crash
    reply = client.query(str(path))
    assert reply.outcome is Outcome.UNREACHABLE
    assert "ConnectionRefusedError" in (reply.reason or "")


def test_a_daemon_that_never_answers_times_out(tmp_path: Path) -> None:
    with scripted_peer(tmp_path / "hung.sock", lambda conn: None):
        started = time.monotonic()
        attachment = client.attach(str(tmp_path / "hung.sock"), "engine-a", timeout=0.5)
        elapsed = time.monotonic() - started
    assert attachment.reply.outcome is Outcome.UNREACHABLE
    assert "timed out" in (attachment.reply.reason or "")
    assert not attachment.is_open
    assert elapsed < 5


def test_a_daemon_that_closes_without_answering_reads_as_unreachable(tmp_path: Path) -> None:
    def close_at_once(conn: socket.socket) -> None:
        conn.recv(1 << 16)
        conn.close()

    with scripted_peer(tmp_path / "closing.sock", close_at_once):
        reply = client.query(str(tmp_path / "closing.sock"), timeout=5)
    assert reply.outcome is Outcome.UNREACHABLE
    assert "Connection closed" in (reply.reason or "")


def test_a_path_that_is_not_a_socket_is_never_connected(tmp_path: Path) -> None:
    path = tmp_path / "plain-file.sock"
    path.write_text("not a socket")
    reply = client.query(str(path))
    assert reply.outcome is Outcome.UNREACHABLE
    assert "not a socket owned by this user" in (reply.reason or "")


# --- replies that break the protocol --------------------------------------------------------


def layout(**overrides: Any) -> dict[str, Any]:
    base = {
        "version": 2,
        "digest": "ab" * 32,
        "physical_to_logical_map": [[0, 1], [1, 0]],
        "dirty": False,
        "dirty_reason": None,
        "pending": {"engine_id": "engine-b", "layers": [1], "base_version": 2},
        "attached": ["engine-b"],
        "non_following_fetch": False,
    }
    base.update(overrides)
    return base


def test_a_well_formed_layout_parses_into_typed_fields() -> None:
    parsed = LayoutView.from_wire(layout())
    assert parsed.version == 2
    assert parsed.pending == PendingMove("engine-b", (1,), 2)
    assert parsed.attached == ("engine-b",)


@pytest.mark.parametrize(
    "overrides",
    [
        {"version": -1},
        {"version": True},
        {"digest": "AB" * 32},
        {"digest": "ab"},
        {"physical_to_logical_map": [[0, 1.0]]},
        {"physical_to_logical_map": "0,1"},
        {"dirty": 0},
        {"dirty_reason": 3},
        {"pending": {"engine_id": "e", "layers": ["1"], "base_version": 2}},
        {"pending": [1]},
        {"attached": "engine-b"},
        {"non_following_fetch": None},
    ],
)
def test_a_malformed_layout_is_a_protocol_violation(overrides: dict[str, Any]) -> None:
    with pytest.raises(ProtocolViolation):
        LayoutView.from_wire(layout(**overrides))


def test_an_ok_reply_with_a_malformed_layout_reads_as_error(tmp_path: Path) -> None:
    body = {"status": protocol.OK, "layout": layout(version="2")}
    with scripted_peer(tmp_path / "bad.sock", reply_with(body)):
        reply = client.query(str(tmp_path / "bad.sock"))
    assert reply.outcome is Outcome.ERROR
    assert "malformed layout" in (reply.reason or "")


def test_an_unknown_status_reads_as_error_not_as_ok(tmp_path: Path) -> None:
    with scripted_peer(tmp_path / "odd.sock", reply_with({"status": "maybe", "reason": "?"})):
        reply = client.abort(str(tmp_path / "odd.sock"), "engine-a")
    assert reply.outcome is Outcome.ERROR
    assert "'maybe'" in (reply.reason or "")


def test_a_commit_acknowledged_without_version_and_digest_reads_as_error(tmp_path: Path) -> None:
    with scripted_peer(tmp_path / "c.sock", reply_with({"status": protocol.OK})):
        reply = client.commit(str(tmp_path / "c.sock"), "engine-a", {0: [1, 0]})
    assert reply.outcome is Outcome.ERROR
    assert "without a valid version and digest" in (reply.reason or "")
