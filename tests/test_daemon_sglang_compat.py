"""Existing requests behave exactly as in sglang 0.5.23's own daemon.

Two model-less daemons side by side with the same config: sglang's ``WeightCacheDaemon`` with
no hook at all (``--without-plugin``), and the same class with this plugin and a ledger at
version 0. Every existing request, well-formed or not, gets the same reply (or the same closed
connection) from both.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_integration.testing.daemon_control import (
    DaemonProcess,
    request,
    send_raw,
    start_daemon,
)

pytestmark = pytest.mark.timeout(120)

GEOMETRY = {"num_layers": 3, "num_logical_experts": 4, "num_physical_experts": 6}


@pytest.fixture(scope="module")
def daemons(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    directory = tmp_path_factory.mktemp("compat")
    sglang_own = start_daemon(directory, "sglang", record="no-plugin", **GEOMETRY)
    hooked = start_daemon(directory, "hooked", **GEOMETRY)
    yield sglang_own, hooked
    sglang_own.stop()
    hooked.stop()


def both(daemons: tuple[DaemonProcess, DaemonProcess], message: Any) -> tuple[Any, Any]:
    return request(daemons[0].socket_path, message), request(daemons[1].socket_path, message)


def frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def test_the_unhooked_daemon_is_sglangs_own(daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    reply = request(daemons[0].socket_path, {"type": "expert_layout_attach", "engine_id": "e"})
    assert reply == {"status": "error", "message": "Unknown request type: expert_layout_attach"}


def test_ping_is_unchanged(daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    theirs, ours = both(daemons, {"type": "ping"})
    assert theirs == ours == {"status": "ok"}


def test_query_config_is_unchanged(daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    theirs, ours = both(daemons, {"type": "query_config"})
    assert theirs == ours and theirs["status"] == "ok"


def test_fetch_state_without_the_field_at_version_0_is_unchanged(
    daemons: tuple[DaemonProcess, DaemonProcess],
) -> None:
    config = request(daemons[0].socket_path, {"type": "query_config"})["config"]
    theirs, ours = both(daemons, {"type": "fetch_state", "config": config})
    assert theirs["pid"] == daemons[0].pid and ours["pid"] == daemons[1].pid
    assert {**theirs, "pid": None} == {**ours, "pid": None}
    assert theirs["status"] == "ok" and theirs["transport_backend"] == "torch_ipc"


def test_fetch_state_with_a_mismatched_config_is_unchanged(
    daemons: tuple[DaemonProcess, DaemonProcess],
) -> None:
    config = request(daemons[0].socket_path, {"type": "query_config"})["config"]
    theirs, ours = both(daemons, {"type": "fetch_state", "config": {**config, "tp_rank": 1}})
    assert theirs == ours and theirs["status"] == "mismatch"


def test_an_unknown_request_type_is_unchanged(daemons: tuple[DaemonProcess, DaemonProcess]) -> None:
    for kind in ("status", "", None, 7, ["expert_layout_attach"], {"type": "ping"}):
        theirs, ours = both(daemons, {"type": kind})
        assert theirs == ours == {"status": "error", "message": f"Unknown request type: {kind}"}
    theirs, ours = both(daemons, {"no_type": True})
    assert theirs == ours


@pytest.mark.parametrize(
    "payload",
    [
        frame(pickle.dumps({"type": "fetch_state"})),  # no config: sglang raises KeyError
        frame(pickle.dumps({"type": "fetch_state", "config": {"model_path": "x"}})),
        frame(pickle.dumps({"type": "fetch_state", "config": [1, 2]})),
        frame(pickle.dumps(["type", "ping"])),  # not a dict
        frame(pickle.dumps(None)),
        frame(b"\x80\x05garbage"),  # not a pickle
        b"\x00\x00",  # a truncated header
        frame(b""),  # an empty frame
        b"",  # nothing at all
    ],
)
def test_requests_sglang_fails_on_close_the_connection_without_a_reply_in_both(
    daemons: tuple[DaemonProcess, DaemonProcess], payload: bytes
) -> None:
    theirs = send_raw(daemons[0].socket_path, payload)
    ours = send_raw(daemons[1].socket_path, payload)
    assert theirs == ours == b""
    theirs_ping, ours_ping = both(daemons, {"type": "ping"})
    assert theirs_ping == ours_ping == {"status": "ok"}


def test_both_daemons_log_the_same_error_for_a_request_sglang_cannot_handle(
    daemons: tuple[DaemonProcess, DaemonProcess],
) -> None:
    send_raw(daemons[0].socket_path, frame(pickle.dumps({"type": "fetch_state"})))
    send_raw(daemons[1].socket_path, frame(pickle.dumps({"type": "fetch_state"})))
    request(daemons[0].socket_path, {"type": "ping"})
    request(daemons[1].socket_path, {"type": "ping"})
    for daemon in daemons:
        assert "Error handling connection: 'config'" in daemon.log()
