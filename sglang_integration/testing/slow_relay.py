"""Daemons that misbehave on purpose: byte-faithful relays to a real daemon that hold some
replies back (a slow daemon) or rewrite their digest (a daemon that reports what it did not
record).

A relay listens on its own socket and relays each connection to the real daemon frame by frame,
one request after another (as the daemon serves an engine rank's kept connection). An attach
connection stays open both ways until the engine's EOF, so the daemon sees the engine's
presence as without the relay. For the tests and ``scripts/bench_engine.py``; each relay runs in
its own process (``start_relay``, ``start_slow_relay``).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RelayRule:
    """What a relay changes: replies to ``delayed`` request types held back ``delay`` seconds;
    the ``digest`` of ``ok`` replies to ``forged`` request types replaced by ``forged_digest``."""

    delayed: frozenset[str] = frozenset()
    delay: float = 0.0
    forged: frozenset[str] = frozenset()
    forged_digest: str = "0" * 64


def serve_relay(listen_path: str, upstream_path: str, rule: RelayRule, ready: Any) -> None:
    """Process target: relay ``listen_path`` to ``upstream_path`` by ``rule``; ``ready.set()``
    once bound."""
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    from layout_ledger.wire import protocol

    def relay(conn: socket.socket) -> None:
        with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.connect(upstream_path)
            while True:
                try:
                    request = recv_msg(conn)
                except ConnectionError:
                    return
                send_msg(upstream, request)
                reply = recv_msg(upstream)
                kind = request.get("type") if isinstance(request, dict) else None
                if kind in rule.delayed:
                    time.sleep(rule.delay)
                ok = isinstance(reply, dict) and reply.get("status") == protocol.OK
                if kind in rule.forged and ok:
                    reply = {**reply, "digest": rule.forged_digest}
                send_msg(conn, reply)
                if kind == protocol.ATTACH:
                    conn.settimeout(None)
                    while conn.recv(4096):
                        pass
                    return

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(listen_path)
    server.listen(64)
    ready.set()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=relay, args=(conn,), daemon=True).start()


def start_relay(listen_path: str | Path, upstream_path: str, rule: RelayRule) -> Any:
    """Start a relay in a forkserver process; returns the process (kill it when done)."""
    from sglang_integration.testing.daemon_control import process_context

    context = process_context()
    ready = context.Event()
    process = context.Process(
        target=serve_relay, args=(str(listen_path), upstream_path, rule, ready), daemon=True
    )
    process.start()
    if not ready.wait(60):
        process.kill()
        raise RuntimeError("the relay did not start")
    return process


def start_slow_relay(listen_path: str | Path, upstream_path: str, delay: float) -> Any:
    """A slow daemon: every begin, commit and abort reply held back ``delay`` seconds."""
    from layout_ledger.wire import protocol

    moves = frozenset({protocol.BEGIN, protocol.COMMIT, protocol.ABORT})
    return start_relay(listen_path, upstream_path, RelayRule(delayed=moves, delay=delay))
