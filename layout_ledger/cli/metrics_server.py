"""The bounded HTTP server of ``layout-ledger metrics --serve``: ``/metrics``, never more threads.

An exporter is reached by whoever can reach its port, so it is bounded like the daemon's own
socket: one thread accepts and reads requests without blocking (``selectors``), at most
``max_connections`` connections are open at once (one more is closed at once), each must send
its whole request within ``deadline`` seconds of its accept and take its reply within as many
again, and ``workers`` threads answer. However many clients stall, the server holds
``1 + workers`` threads and ``max_connections`` sockets. Concurrent scrapes share one collection
(``SharedCollection``): one that arrives while a collection runs waits for that one's result.
HTTP/1.0 semantics: one request per connection, then close (Prometheus reconnects).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Defaults: a scrape is one small request; Prometheus scrapes every 15-60 s from one or two
# servers. 64 open connections and 5 s to send a request are far above what it needs.
MAX_CONNECTIONS = 64
DEADLINE_SECONDS = 5.0
WORKERS = 4
MAX_REQUEST_BYTES = 8192
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SharedCollection:
    """One collection at a time: a caller that arrives while one runs gets that one's result.

    So N concurrent scrapes cost one collection (the newest a caller can get without waiting
    for a second one), and the collector is never called from two threads at once."""

    def __init__(self, collect: Callable[[], bytes]) -> None:
        self._collect = collect
        self._condition = threading.Condition()
        self._running = False
        self._finished = 0  # collections finished so far
        self._result: bytes | BaseException = b""
        self.collections = 0  # collections run (for tests and the log)

    def get(self) -> bytes:
        with self._condition:
            if self._running:
                waiting_for = self._finished + 1
                while self._finished < waiting_for:
                    self._condition.wait()
                return self._unwrap(self._result)
            self._running = True
        result: bytes | BaseException
        try:
            result = self._collect()
        except Exception as exc:  # handed to every waiter, raised in each
            result = exc
        with self._condition:
            self.collections += 1
            self._result = result
            self._finished += 1
            self._running = False
            self._condition.notify_all()
        return self._unwrap(result)

    @staticmethod
    def _unwrap(result: bytes | BaseException) -> bytes:
        if isinstance(result, BaseException):
            raise result
        return result


@dataclass
class _Open:
    """A connection whose request is being read."""

    conn: socket.socket
    accepted: float
    received: bytearray = field(default_factory=bytearray)


class MetricsHTTPServer:
    """``/metrics`` on ``host:port`` (see the module docstring); ``close`` stops it."""

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[], bytes],
        *,
        max_connections: int = MAX_CONNECTIONS,
        deadline: float = DEADLINE_SECONDS,
        workers: int = WORKERS,
    ) -> None:
        self._render = render
        self._max = max_connections
        self._deadline = deadline
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(512)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._open: dict[int, _Open] = {}
        self._answering = 0  # connections handed to the workers, not yet closed
        self._lock = threading.Lock()
        self._ready: queue.Queue[tuple[_Open, bytes] | None] = queue.Queue()
        self._stop = threading.Event()
        self.rejected = 0  # connections closed at once: the cap was reached
        self.timed_out = 0  # connections dropped at their deadline
        self._threads = [threading.Thread(target=self._serve, name="metrics-accept", daemon=True)]
        self._threads += [
            threading.Thread(target=self._answer_loop, name=f"metrics-worker-{n}", daemon=True)
            for n in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def url(self) -> str:
        host, port = self.server_address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/metrics"

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open) + self._answering

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads[1:]:
            self._ready.put(None)
        for thread in self._threads:
            thread.join(10)
        for item in list(self._open.values()):
            item.conn.close()
        self._selector.close()
        self._listener.close()

    # --- the accept and read thread -------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            self._drop_overdue()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("metrics server: accept failed: %s", exc)
                return
            if self.open_connections >= self._max:
                self.rejected += 1
                conn.close()
                continue
            conn.setblocking(False)
            item = _Open(conn, time.monotonic())
            with self._lock:
                self._open[conn.fileno()] = item
            self._selector.register(conn, selectors.EVENT_READ, item)

    def _read(self, item: _Open) -> None:
        try:
            chunk = item.conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._forget(item, close=True)
            return
        item.received.extend(chunk)
        head, separator, _ = bytes(item.received).partition(b"\r\n\r\n")
        if not separator and b"\n\n" in item.received:
            head, separator = bytes(item.received).split(b"\n\n", 1)[0], b"\n\n"
        if separator:
            self._forget(item, close=False)
            with self._lock:
                self._answering += 1
            self._ready.put((item, head))
        elif len(item.received) > MAX_REQUEST_BYTES:
            self._forget(item, close=False)
            with self._lock:
                self._answering += 1
            self._ready.put((item, b""))  # answered 431

    def _drop_overdue(self) -> None:
        now = time.monotonic()
        for item in [i for i in list(self._open.values()) if now - i.accepted > self._deadline]:
            self.timed_out += 1
            self._forget(item, close=True)

    def _forget(self, item: _Open, *, close: bool) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(item.conn)
        with self._lock:
            self._open.pop(item.conn.fileno(), None)
        if close:
            item.conn.close()

    # --- the workers ------------------------------------------------------------------------

    def _answer_loop(self) -> None:
        while True:
            work = self._ready.get()
            if work is None:
                return
            item, head = work
            try:
                self._answer(item, head)
            except Exception:
                logger.exception("metrics server: answering a request failed")
            finally:
                item.conn.close()
                with self._lock:
                    self._answering -= 1

    def _answer(self, item: _Open, head: bytes) -> None:
        request_line = head.split(b"\n", 1)[0].decode("latin-1").strip()
        parts = request_line.split()
        if len(parts) < 2 or not head:
            self._send(item, 431 if not head else 400, b"bad request\n")
            return
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            self._send(item, 405, b"only GET and HEAD\n")
            return
        if target == "/metrics":
            try:
                body = self._render()
            except Exception as exc:
                logger.error("metrics server: collecting failed: %s", exc)
                self._send(item, 500, f"collecting the metrics failed: {exc}\n".encode())
                return
            self._send(item, 200, body, head_only=method == "HEAD")
        elif target == "/":
            self._send(item, 200, b"sglang expert layout ledger exporter: /metrics\n")
        else:
            self._send(item, 404, b"not found: see /metrics\n")

    def _send(self, item: _Open, code: int, body: bytes, *, head_only: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
        reason |= {431: "Request Header Fields Too Large", 500: "Internal Server Error"}
        content_type = CONTENT_TYPE if code == 200 else "text/plain; charset=utf-8"
        header = (
            f"HTTP/1.0 {code} {reason.get(code, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        item.conn.setblocking(True)
        item.conn.settimeout(self._deadline)  # the whole reply (sendall's timeout is total)
        try:
            item.conn.sendall(header if head_only else header + body)
        except OSError:
            self.timed_out += 1
