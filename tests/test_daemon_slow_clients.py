"""A slow or silent client must not hold every engine (docs/protocol.md "Deadlines").

Real model-less daemons (sglang's serve loop with the hooks), real sockets. Each connection is
served on its own thread: its whole request must arrive within the deadline from the accept, its
reply must be taken within the deadline from the first send, else it is dropped and logged once.
Most tests use a short deadline (``--request-timeout``, the model-less daemon's form of the
launcher's ``--expert-layout-request-timeout``); one checks the 10 s target with the default.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layout_ledger.wire import protocol as msg
from sglang_integration import settings
from sglang_integration.engine import client
from sglang_integration.testing.daemon import parse_args
from sglang_integration.testing.daemon_control import DaemonProcess, request, start_daemon

pytestmark = pytest.mark.timeout(120)

SHORT = 1.0  # the deadline of most tests, seconds
DROPPED = "dropped a connection"


@contextlib.contextmanager
def short_deadline_daemon(
    directory: Path, timeout: float = SHORT, **geometry: int
) -> Iterator[DaemonProcess]:
    handle = start_daemon(directory, extra=["--request-timeout", str(timeout)], **geometry)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with short_deadline_daemon(tmp_path) as handle:
        yield handle


def connect(socket_path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30.0)
    conn.connect(socket_path)
    return conn


def seconds_until_closed(conn: socket.socket, since: float) -> float:
    """Read (and discard) until the daemon closes ``conn``; seconds from ``since``."""
    with contextlib.suppress(ConnectionResetError):
        while conn.recv(65536):
            pass
    return time.monotonic() - since


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!I", len(data)) + data


def dropped_lines(handle: DaemonProcess, count: int, wait: float = 30.0) -> list[str]:
    """The log's "dropped a connection" lines, once there are ``count`` (or after ``wait``)."""
    deadline = time.monotonic() + wait
    while True:
        lines = [line for line in handle.log().splitlines() if DROPPED in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


class Trickler(threading.Thread):
    """A slow client: a 4-byte header announcing 100 bytes, then one byte every ``every`` s."""

    def __init__(self, socket_path: str, every: float) -> None:
        super().__init__(daemon=True)
        self.conn = connect(socket_path)
        self.every = every
        self.started_at = time.monotonic()
        self.stop = threading.Event()

    def run(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.sendall(struct.pack("!I", 100))
            while not self.stop.wait(self.every):
                self.conn.sendall(b"x")


def test_a_silent_client_is_dropped_at_the_deadline_and_logged_once(
    daemon: DaemonProcess,
) -> None:
    started = time.monotonic()
    silent = connect(daemon.socket_path)
    with silent:
        elapsed = seconds_until_closed(silent, started)
    assert SHORT * 0.9 <= elapsed < SHORT + 2.0
    lines = dropped_lines(daemon, 1)
    assert len(lines) == 1
    assert "no whole request within 1 s of the accept (0 bytes received)" in lines[0]


def test_a_trickling_client_is_dropped_at_the_deadline_from_the_accept_not_from_its_last_byte(
    daemon: DaemonProcess,
) -> None:
    trickler = Trickler(daemon.socket_path, every=0.2)
    trickler.start()
    try:
        elapsed = seconds_until_closed(trickler.conn, trickler.started_at)
    finally:
        trickler.stop.set()
        trickler.join()
        trickler.conn.close()
    assert SHORT * 0.9 <= elapsed < SHORT + 2.0
    (line,) = dropped_lines(daemon, 1)
    assert "no whole request within 1 s of the accept" in line


def test_a_query_and_a_begin_are_answered_at_once_while_a_slow_and_a_silent_client_wait(
    tmp_path: Path,
) -> None:
    # A deadline long enough that both bad clients are still connected when the good requests
    # come: the good ones are answered at once, not after the bad ones' deadlines.
    with short_deadline_daemon(tmp_path, timeout=6.0) as daemon:
        trickler = Trickler(daemon.socket_path, every=0.5)
        trickler.start()
        silent = connect(daemon.socket_path)
        try:
            time.sleep(0.3)  # both are accepted and being read
            started = time.monotonic()
            state = request(daemon.socket_path, {"type": msg.QUERY}, timeout=3.0)
            queried = time.monotonic() - started
            engine = client.attach(daemon.socket_path, "engine-a")
            begun = client.begin(daemon.socket_path, "engine-a", 0, [1])
            answered = time.monotonic() - started
            engine.close()
        finally:
            trickler.stop.set()
            trickler.join()
            trickler.conn.close()
            silent.close()
    assert state["status"] == msg.OK and begun.ok
    assert queried < 1.0 and answered < 2.0


BIG = {"num_layers": 256, "num_physical_experts": 1024, "num_logical_experts": 256}


def test_a_client_that_never_reads_its_reply_is_dropped_at_the_reply_deadline_and_holds_no_one(
    tmp_path: Path,
) -> None:
    with short_deadline_daemon(tmp_path, **BIG) as daemon:
        hoarder = connect(daemon.socket_path)
        with hoarder:
            # A query's reply (the 256 x 1024 map, over 500 KB) fills the socket's buffers.
            hoarder.sendall(frame({"type": msg.QUERY}))
            time.sleep(0.2)
            started = time.monotonic()
            assert request(daemon.socket_path, {"type": "ping"}, timeout=3.0) == {"status": "ok"}
            pinged = time.monotonic() - started
            lines = dropped_lines(daemon, 1)
    assert pinged < 0.5
    assert len(lines) == 1
    assert "the client did not take its reply within 1 s" in lines[0]


def test_an_attach_connection_outlives_the_deadline_once_its_reply_is_sent(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-a")
    assert engine.reply.ok
    time.sleep(SHORT * 2.5)
    state = request(daemon.socket_path, {"type": msg.QUERY})["layout"]
    assert state["attached"] == ["engine-a"] and engine.is_open
    engine.close()
    deadline = time.monotonic() + 10.0
    while request(daemon.socket_path, {"type": msg.QUERY})["layout"]["attached"]:
        assert time.monotonic() < deadline, "the engine's attach connection closed, no detach"
        time.sleep(0.05)
    assert dropped_lines(daemon, 1, wait=0.0) == []


def test_the_daemon_listens_with_a_backlog_far_above_sglangs_8(daemon: DaemonProcess) -> None:
    # A stopped daemon accepts nothing: every connect waits in the listen backlog. Connects with
    # a timeout are non-blocking, as an engine's are, and fail with EAGAIN on a full backlog.
    os.kill(daemon.pid, signal.SIGSTOP)
    waiting: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(200):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(2.0)
            try:
                conn.connect(daemon.socket_path)
            except OSError:
                refused += 1
                conn.close()
            else:
                waiting.append(conn)
    finally:
        for conn in waiting:
            conn.close()
        os.kill(daemon.pid, signal.SIGCONT)
    assert refused == 0
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}


def test_with_the_default_deadline_a_query_is_answered_within_10_s_beside_slow_and_silent_clients(
    tmp_path: Path,
) -> None:
    daemon = start_daemon(tmp_path)  # no --request-timeout: the default, 5 s
    try:
        trickler = Trickler(daemon.socket_path, every=20.0)
        trickler.start()
        silent_since = time.monotonic()
        silent = connect(daemon.socket_path)
        try:
            time.sleep(0.3)
            started = time.monotonic()
            state = request(daemon.socket_path, {"type": msg.QUERY}, timeout=10.0)
            answered = time.monotonic() - started
            silent_dropped = seconds_until_closed(silent, silent_since)
        finally:
            trickler.stop.set()
            trickler.join()
            trickler.conn.close()
            silent.close()
    finally:
        daemon.stop()
    assert state["status"] == msg.OK
    assert answered < 10.0
    assert settings.DEFAULT_REQUEST_TIMEOUT == 5.0
    assert 4.5 <= silent_dropped < 8.0


def test_the_model_less_daemon_takes_its_deadline_from_the_flag_else_the_env_var_else_5_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["--socket", "s", "--ledger", "l", "--num-layers", "1"]
    argv += ["--num-logical-experts", "1", "--num-physical-experts", "1"]
    monkeypatch.delenv(settings.REQUEST_TIMEOUT.env, raising=False)
    assert parse_args(argv).request_timeout == 5.0
    monkeypatch.setenv(settings.REQUEST_TIMEOUT.env, "0.25")
    assert parse_args(argv).request_timeout == 0.25
    assert parse_args([*argv, "--request-timeout", "2"]).request_timeout == 2.0
    with pytest.raises(SystemExit):
        parse_args([*argv, "--request-timeout", "0"])


# --- an engine rank's one kept connection (docs/protocol.md "Framing") ---------------------------

ROW = [(slot + 1) % 8 for slot in range(10)]  # the model-less daemon's default geometry


def test_an_engine_ranks_begin_commit_and_abort_share_one_connection_past_the_idle_deadline(
    daemon: DaemonProcess,
) -> None:
    engine = client.attach(daemon.socket_path, "engine-a")
    moves = client.LayoutConnection(daemon.socket_path, "engine-a")
    try:
        assert moves.begin(0, [1]).ok
        time.sleep(SHORT * 2.5)  # idle longer than the deadline: the engine is attached
        assert moves.commit({1: ROW}).body["version"] == 1
        assert moves.begin(1, [2]).ok
        assert moves.abort().ok
        assert (moves.connects, moves.requests, moves.is_open) == (1, 4, True)
    finally:
        moves.close()
        engine.close()
    assert dropped_lines(daemon, 1, wait=0.5) == []
    assert "hung up" not in daemon.log()


def test_a_kept_connections_next_request_must_arrive_whole_within_the_deadline_of_its_first_byte(
    daemon: DaemonProcess,
) -> None:
    from sglang.srt.weight_cache.protocol import recv_msg

    engine = client.attach(daemon.socket_path, "engine-a")
    try:
        with connect(daemon.socket_path) as kept:
            kept.sendall(frame({"type": msg.ABORT, "engine_id": "engine-a"}))
            assert recv_msg(kept)["status"] == msg.REFUSED  # nothing pending; the connection stays
            time.sleep(SHORT * 1.5)
            started = time.monotonic()
            kept.sendall(struct.pack("!I", 100) + b"x")
            elapsed = seconds_until_closed(kept, started)
    finally:
        engine.close()
    assert SHORT * 0.9 <= elapsed < SHORT + 2.0
    (line,) = dropped_lines(daemon, 1)
    assert "no whole request within 1 s" in line


def test_a_kept_connection_of_an_engine_not_attached_ends_one_deadline_after_its_reply(
    daemon: DaemonProcess,
) -> None:
    from sglang.srt.weight_cache.protocol import recv_msg

    with connect(daemon.socket_path) as kept:
        kept.sendall(
            frame({"type": msg.BEGIN, "engine_id": "ghost", "base_version": 0, "layers": [0]})
        )
        assert recv_msg(kept)["status"] == msg.REFUSED
        elapsed = seconds_until_closed(kept, time.monotonic())
    assert SHORT * 0.9 <= elapsed < SHORT + 2.5
    assert dropped_lines(daemon, 1, wait=0.5) == []


def test_a_kept_connection_answers_any_other_request_with_an_error_and_ends(
    daemon: DaemonProcess,
) -> None:
    from sglang.srt.weight_cache.protocol import recv_msg

    engine = client.attach(daemon.socket_path, "engine-a")
    try:
        for other in ({"type": msg.QUERY}, {"type": msg.ABORT, "engine_id": "engine-b"}):
            with connect(daemon.socket_path) as kept:
                kept.sendall(frame({"type": msg.ABORT, "engine_id": "engine-a"}))
                assert recv_msg(kept)["status"] == msg.REFUSED
                kept.sendall(frame(other))
                reply = recv_msg(kept)
                assert reply["status"] == msg.ERROR
                assert "only begin, commit and abort" in reply["reason"]
                assert "engine-b" not in reply["reason"]
                assert seconds_until_closed(kept, time.monotonic()) < 2.0
    finally:
        engine.close()


def test_a_lost_kept_connection_is_never_reopened(tmp_path: Path) -> None:
    with short_deadline_daemon(tmp_path) as daemon:
        engine = client.attach(daemon.socket_path, "engine-a")
        moves = client.LayoutConnection(daemon.socket_path, "engine-a")
        assert moves.begin(0, [1]).ok
        daemon.stop()
        engine.close()
    lost = moves.begin(0, [1])
    assert lost.outcome is client.Outcome.UNREACHABLE
    again = moves.abort()
    assert again.outcome is client.Outcome.UNREACHABLE and "no connection" in again.reason
    assert (moves.connects, moves.is_open) == (1, False) and moves.lost is not None
