"""A client that hangs up early is normal: the daemon logs one line for it, never a traceback.

A readiness probe that gives up, a port scan, an engine rank killed mid-request: each closes its
connection before it sent a whole request or before it read its reply. The operator reads the
daemon's log, so each such connection is one line there, without a traceback (a traceback is
for a failure of the daemon's own). Real model-less daemons, real Unix sockets.
"""

from __future__ import annotations

import pickle
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_integration.testing.daemon_control import DaemonProcess, request, start_daemon

pytestmark = pytest.mark.timeout(120)

HUNG_UP = "hung up"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    handle = start_daemon(tmp_path)
    try:
        yield handle
    finally:
        handle.stop()


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!I", len(data)) + data


def _connect(socket_path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30.0)
    conn.connect(socket_path)
    return conn


def _ping_and_hang_up(socket_path: str) -> None:
    """Send a whole ping and close without reading the reply.

    The client shuts its reading side first, so the daemon's reply can never be delivered
    whichever of the two is faster: its send fails with EPIPE, as it does when the client's
    close came first (what a probe that gave up does).
    """
    with _connect(socket_path) as conn:
        conn.shutdown(socket.SHUT_RD)
        conn.sendall(_frame({"type": "ping"}))


def _hang_up_lines(handle: DaemonProcess, count: int, wait: float = 30.0) -> list[str]:
    """The log's hang-up lines once there are ``count`` of them (or after ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        lines = [line for line in handle.log().splitlines() if HUNG_UP in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_client_that_hangs_up_before_reading_its_reply_is_one_log_line_without_traceback(
    daemon: DaemonProcess,
) -> None:
    _ping_and_hang_up(daemon.socket_path)
    (line,) = _hang_up_lines(daemon, 1)
    assert "a client hung up before taking its reply" in line
    assert "Broken pipe" in line
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}
    log = daemon.log()
    assert "Traceback" not in log
    assert "Error handling connection" not in log


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        (b"", 0),
        (b"\x00\x00", 2),
        (_frame({"type": "ping"})[:-3], len(_frame({"type": "ping"})) - 3),
    ],
    ids=["nothing", "half a header", "part of a request"],
)
def test_a_client_that_hangs_up_before_sending_its_whole_request_is_one_log_line(
    daemon: DaemonProcess, sent: bytes, received: int
) -> None:
    with _connect(daemon.socket_path) as conn:
        conn.sendall(sent)
    (line,) = _hang_up_lines(daemon, 1)
    assert f"a client hung up before sending its whole request ({received} bytes received)" in (
        line
    )
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}
    assert "Traceback" not in daemon.log()


def test_many_clients_hanging_up_are_one_line_each_and_the_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    for _ in range(10):
        _ping_and_hang_up(daemon.socket_path)
    assert len(_hang_up_lines(daemon, 10)) == 10
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}
    log = daemon.log()
    assert "Traceback" not in log
    assert len(_hang_up_lines(daemon, 10)) == 10


def test_a_request_sglang_cannot_handle_is_still_logged_with_its_traceback(
    daemon: DaemonProcess,
) -> None:
    from sglang_integration.testing.daemon_control import send_raw

    send_raw(daemon.socket_path, _frame({"type": "fetch_state"}))  # no config: a KeyError
    assert request(daemon.socket_path, {"type": "ping"}) == {"status": "ok"}
    deadline = time.monotonic() + 30.0
    while "Error handling connection: 'config'" not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    assert "Traceback" in daemon.log()
    assert HUNG_UP not in daemon.log()
