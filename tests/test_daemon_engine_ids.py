"""An engine id is printable text of at most 256 characters; a refused one is never stored raw.

Engine ids travel into the ledger, the daemon's log and the operator's terminal. An attach
with a newline and ANSI escapes in its id could forge a ``state: clean`` line there. Every request
that names an engine (attach, begin, commit, abort, fetch) refuses such an id with a reason; the
refusal's event stores no ``engine_id`` and shows the id in its reason only escaped to ASCII and
clipped to its first 64 characters (docs/protocol.md "Terms").
"""

from __future__ import annotations

import pickle
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from layout_ledger.core.errors import InvalidRequest
from layout_ledger.core.rules import MAX_ENGINE_ID, check_request_engine_id, shown_engine_id
from layout_ledger.wire import protocol as msg
from sglang_integration.testing.daemon_control import DaemonProcess, request, send_raw, start_daemon

FORGING = "engine-a\nstate: clean\x1b[0m\x1b[2K"
UNPRINTABLE = [
    FORGING,
    "tab\there",
    "nul\x00",
    "bell\x07",
    "right-to-left\u202eoverride",
    "zero\u200bwidth",
    "line\u2028separator",
    "no-break\u00a0space",
    "surrogate\ud800",
]
PRINTABLE = ["engine-a", "engine a", "host-1/pid-42:rank 0", "moteur-é", "エンジン", "e" * 256]


@pytest.mark.parametrize("engine_id", UNPRINTABLE, ids=repr)
def test_an_engine_id_that_is_not_printable_text_is_refused_and_shown_escaped(
    engine_id: str,
) -> None:
    with pytest.raises(InvalidRequest, match="engine_id must be printable text") as refused:
        check_request_engine_id(engine_id)
    reason = str(refused.value)
    assert reason.isascii() and reason.isprintable()
    assert shown_engine_id(engine_id) in reason


@pytest.mark.parametrize("engine_id", PRINTABLE, ids=repr)
def test_printable_engine_ids_of_at_most_256_characters_are_accepted(engine_id: str) -> None:
    assert check_request_engine_id(engine_id) == engine_id


def test_a_long_engine_id_is_refused_and_its_reason_shows_only_its_first_64_characters() -> None:
    long_id = "\x1b[31m" + "e" * 1019
    with pytest.raises(
        InvalidRequest, match="engine_id is 1024 characters; at most 256"
    ) as refused:
        check_request_engine_id(long_id)
    reason = str(refused.value)
    assert reason.isascii() and reason.isprintable() and len(reason) < 200
    assert "the first 64 of 1024 characters" in reason
    assert len(check_request_engine_id("e" * MAX_ENGINE_ID)) == MAX_ENGINE_ID


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    handle = start_daemon(tmp_path)
    yield handle
    handle.stop()


def _raw_request(socket_path: str, message: dict[str, object]) -> dict[str, object]:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    reply = send_raw(socket_path, struct.pack("!I", len(data)) + data)
    (length,) = struct.unpack("!I", reply[:4])
    decoded = pickle.loads(reply[4 : 4 + length])
    assert isinstance(decoded, dict)
    return decoded


def test_every_request_refuses_an_unprintable_or_long_engine_id_and_stores_it_nowhere_raw(
    daemon: DaemonProcess,
) -> None:
    config = request(daemon.socket_path, {"type": "query_config"})["config"]
    digest = request(daemon.socket_path, {"type": msg.QUERY})["layout"]["digest"]
    for engine_id in (FORGING, "e" * 1024):
        requests = [
            {"type": msg.ATTACH, "engine_id": engine_id},
            {"type": msg.BEGIN, "engine_id": engine_id, "base_version": 0, "layers": [0]},
            {"type": msg.COMMIT, "engine_id": engine_id, "rows": {}},
            {"type": msg.ABORT, "engine_id": engine_id},
            {
                "type": "fetch_state",
                "config": config,
                "expert_layout": {"engine_id": engine_id, "version": 0, "digest": digest},
            },
        ]
        for message in requests:
            reply = _raw_request(daemon.socket_path, message)
            assert reply["status"] in (msg.REFUSED, msg.LAYOUT_REFUSED), message["type"]
            reason = str(reply["reason"])
            assert reason.isascii() and reason.isprintable(), reason
            assert shown_engine_id(engine_id) in reason

    state = request(daemon.socket_path, {"type": msg.QUERY})["layout"]
    assert state["attached"] == [] and state["pending"] is None
    assert daemon.ledger_path is not None
    with sqlite3.connect(f"file:{daemon.ledger_path}?mode=ro", uri=True) as conn:
        refusals = conn.execute(
            "SELECT kind, engine_id, reason FROM events WHERE kind LIKE '%refused' ORDER BY 1"
        ).fetchall()
    assert sorted(kind for kind, _, _ in refusals) == sorted(
        [f"{verb}_refused" for verb in ("attach", "begin", "commit", "abort", "fetch")] * 2
    )
    for _, engine_id, reason in refusals:
        assert engine_id is None
        assert reason.isascii() and reason.isprintable() and len(reason) < 300
