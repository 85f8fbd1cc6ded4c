"""How long a starting rank waits for another engine's pending move (``settings.WAIT_TIMEOUT``).

The daemon is a scripted peer on a real Unix socket whose layout always shows another engine's
move pending. The clock is the one stand-in: ``engine.startup``'s ``time`` is a virtual clock,
so the 300 s default is waited out in virtual seconds (its ``sleep`` advances it) while every
poll is a real ``expert_layout_query`` over the socket.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from test_engine_startup_hook import scripted_peer

from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import FindingKind
from layout_ledger.wire import protocol
from sglang_integration.engine import startup as engine_startup
from sglang_integration.settings import WAIT_TIMEOUT

MAP = trivial_map(3, 10, 8)


class VirtualClock:
    """``time.monotonic`` and ``time.sleep`` over virtual seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _always_pending(conn: socket.socket) -> None:
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    recv_msg(conn)
    layout = protocol.LayoutView(
        version=2,
        digest=layout_digest(MAP),
        physical_to_logical_map=MAP,
        dirty=False,
        dirty_reason=None,
        pending=protocol.PendingMove("engine-b", (0, 1), 2),
        attached=("engine-b", "engine-a"),
        non_following_fetch=False,
    )
    send_msg(conn, protocol.layout_reply(layout))


@pytest.mark.timeout(60)
def test_the_startup_wait_for_another_engines_move_defaults_to_300_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WAIT_TIMEOUT.env, raising=False)
    clock = VirtualClock()
    monkeypatch.setattr(engine_startup, "time", clock)
    path = tmp_path / "d.sock"
    with scripted_peer(path, _always_pending):
        finding, attachment = engine_startup.read_daemon(
            str(path), "engine-a", rank=0, initial_digest=layout_digest(MAP), poll_interval=25.0
        )
    assert attachment is not None
    attachment.close()
    assert finding.kind is FindingKind.STUCK
    assert finding.reason is not None
    assert finding.reason.endswith(
        "engine 'engine-b' began a move of layers [0, 1] from version 2, and it was still "
        "pending after 300 s (SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT)"
    )
    # It waited the whole 300 s, polling the daemon, and not a poll longer.
    assert clock.now == 300.0
