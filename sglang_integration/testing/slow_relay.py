"""A daemon slowed on purpose: a byte-faithful relay that holds every move reply back.

Listens on its own socket and relays each connection to a real daemon, frame by frame (as the
daemon serves an engine rank's kept connection); every begin, commit and abort reply is held
back ``delay`` seconds before it is passed on. An attach connection stays open both ways until
the engine's EOF, so the daemon sees the engine's presence as without the relay. For the
tests and ``scripts/bench_engine.py``; run it in its own process (``start_slow_relay``).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any


def serve_slow_relay(listen_path: str, upstream_path: str, delay: float, ready: Any) -> None:
    """Process target: relay ``listen_path`` to ``upstream_path``; ``ready.set()`` once bound."""
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    from layout_ledger.wire import protocol

    slowed = {protocol.BEGIN, protocol.COMMIT, protocol.ABORT}

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
                if kind in slowed:
                    time.sleep(delay)
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


def start_slow_relay(listen_path: str | Path, upstream_path: str, delay: float) -> Any:
    """Start the relay in a forkserver process; returns the process (kill it when done)."""
    from sglang_integration.testing.daemon_control import process_context

    context = process_context()
    ready = context.Event()
    process = context.Process(
        target=serve_slow_relay, args=(str(listen_path), upstream_path, delay, ready), daemon=True
    )
    process.start()
    if not ready.wait(60):
        process.kill()
        raise RuntimeError("the slow relay did not start")
    return process
