"""Each connection the daemon accepts, served on its own thread within deadlines.

sglang's serve loop handles one connection at a time, each with a 30 s timeout per socket
operation, so one client that sends nothing, trickles its request, or never reads its reply
holds every other engine (a rebalance's begin included) for 30 s or longer. The daemon hooks
hand each accepted connection to ``ConnectionThreads`` instead, and serve's loop goes straight
back to ``accept``: bad clients are served side by side, and each is dropped at its deadline.
A client that hangs up early (before its whole request arrived, or before it took its reply: a
readiness probe that gave up, a rank killed mid-request) is normal: one line in the log, no
traceback; a traceback is kept for a failure of the daemon's own.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sglang_integration.daemon.socket_stand_ins import PassThrough

logger = logging.getLogger(__name__)

# Connections served at once. Each one ends within its deadlines; each may hold one request
# frame in memory, which sglang's recv_msg caps at 256 MiB.
MAX_CONNECTIONS = 64
# Seconds between two looks, on an idle kept connection, at whether its engine is attached.
IDLE_CHECK = 1.0


class DeadlinePassed(TimeoutError):
    """A client did not send its whole request, or take its reply, within the deadline."""


class BoundedConnection(PassThrough):
    """A connection whose reads end at the request deadline and whose sends at the reply one.

    ``recv`` raises ``DeadlinePassed`` once ``timeout`` seconds have passed since ``accepted``
    (a ``time.monotonic`` instant), however many bytes arrived before; ``sendall`` raises it
    when the reply is not taken within ``timeout`` seconds of the first send. Everything else
    is the socket's (``PassThrough``).
    """

    def __init__(self, conn: socket.socket, accepted: float, timeout: float) -> None:
        super().__init__(conn)
        self._conn = conn
        self._timeout = timeout
        self._request_deadline = accepted + timeout
        self._reply_deadline: float | None = None
        self.received = 0

    @property
    def replying(self) -> bool:
        """Whether the reply's first send has begun (the request was read)."""
        return self._reply_deadline is not None

    def recv(self, size: int, *flags: int) -> bytes:
        # A deadline already passed still reads what is already buffered (timeout 0 is a
        # non-blocking read); only a read that would have to wait fails.
        self._conn.settimeout(max(self._request_deadline - time.monotonic(), 0.0))
        try:
            data = self._conn.recv(size, *flags)
        except (TimeoutError, BlockingIOError) as exc:
            raise DeadlinePassed(
                f"no whole request within {self._timeout:g} s of the accept "
                f"({self.received} bytes received)"
            ) from exc
        self.received += len(data)
        return data

    def next_request(self, keep_waiting: Callable[[], bool]) -> bool:
        """Wait for the next request on a kept connection; True once its first byte is here.

        The deadlines start again from that byte: the whole request within ``timeout`` seconds,
        its reply taken within ``timeout`` of its first send. Idle between requests, the wait
        lasts while ``keep_waiting()`` says so (checked every ``IDLE_CHECK`` seconds) and at most
        ``timeout`` seconds once it does not. False at EOF (the client closed at a frame
        boundary, as a client of one request does), on a socket error, or when the idle wait
        ended: the connection ends without a log line.
        """
        idle_since = time.monotonic()
        while True:
            try:
                readable, _, _ = select.select([self._conn], [], [], IDLE_CHECK)
                if readable:
                    self._conn.settimeout(0.0)
                    first = self._conn.recv(1, socket.MSG_PEEK)
                    if not first:
                        return False
                    break
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):  # reset by the peer, or closed by the daemon's stop
                return False
            now = time.monotonic()
            if keep_waiting():
                idle_since = now
            elif now - idle_since >= self._timeout:
                return False
        self._request_deadline = time.monotonic() + self._timeout
        self._reply_deadline = None
        self.received = 0
        return True

    def sendall(self, data: Any, *flags: int) -> None:
        now = time.monotonic()
        if self._reply_deadline is None:
            self._reply_deadline = now + self._timeout
        self._conn.settimeout(max(self._reply_deadline - now, 0.0))
        try:
            self._conn.sendall(data, *flags)
        except (TimeoutError, BlockingIOError) as exc:
            raise DeadlinePassed(
                f"the client did not take its reply within {self._timeout:g} s"
            ) from exc


Handler = Callable[[BoundedConnection], None]


class ConnectionThreads:
    """Serves each submitted connection on its own thread, within ``timeout`` seconds.

    - the whole request must arrive within ``timeout`` seconds of the accept, however it
      trickles; the reply must be taken within ``timeout`` seconds of its first send;
    - otherwise the connection is shut down and closed, and one warning is logged.

    While fewer than ``max_connections`` are open, any request that arrives whole is answered
    at once, whatever else is connected; at ``max_connections`` serve's loop waits for one to
    end (each ends within its deadlines) and new connections wait in the listen backlog.
    Handling itself (a ledger write) is not bounded: the record's lock orders the transitions,
    as it already does between the serve loop and the attach watcher.

    An attach connection is bounded the same way until its reply is sent; the attach watcher
    holds its own duplicate from then on. A failed or late attach reply shuts the connection
    down, which the watcher sees as EOF (the engine is detached).
    """

    def __init__(self, timeout: float, max_connections: int = MAX_CONNECTIONS) -> None:
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}
        self._stopping = False

    def submit(self, conn: socket.socket, handle: Handler) -> None:
        """Serve ``conn`` with ``handle`` on a new thread and return at once.

        ``conn`` stays the caller's (sglang's serve loop closes it when this returns); the
        thread serves a duplicate. Blocks only while ``max_connections`` are open.
        """
        accepted = time.monotonic()
        self._slots.acquire()
        try:
            own = conn.dup()
        except OSError as exc:
            self._slots.release()
            logger.error("could not take over a connection (%s); it is closed unanswered", exc)
            return
        thread = threading.Thread(
            target=self._serve,
            args=(own, accepted, handle),
            name="expert-layout-connection",
            daemon=True,
        )
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._open[own] = thread
        if stopping:
            self._release(own)
            return
        try:
            thread.start()
        except RuntimeError as exc:  # no thread could be started (a resource limit)
            logger.error("could not start a thread for a connection (%s); it is closed", exc)
            self._release(own)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut every open connection down and wait for its thread; none is accepted after."""
        with self._lock:
            self._stopping = True
            serving = list(self._open.items())
        for conn, _ in serving:
            _shut_down(conn)
        deadline = time.monotonic() + timeout
        for _, thread in serving:
            if thread.ident is not None:
                thread.join(max(deadline - time.monotonic(), 0.0))
        if any(thread.is_alive() for _, thread in serving):
            logger.error("connection threads were still running %.0f s after the stop", timeout)

    def _serve(self, own: socket.socket, accepted: float, handle: Handler) -> None:
        bounded = BoundedConnection(own, accepted, self.timeout)
        try:
            handle(bounded)
        except DeadlinePassed as exc:
            logger.warning("dropped a connection: %s", exc)
            _shut_down(own)
        except ConnectionError as exc:
            # The client closed its end (EPIPE, ECONNRESET, or EOF inside sglang's recv_msg).
            logger.warning("%s (%s)", self._hang_up(bounded), exc)
            _shut_down(own)
        except Exception as exc:
            # What sglang's serve loop does with an exception from _handle_connection.
            logger.error("Error handling connection: %s", exc, exc_info=True)
            _shut_down(own)
        finally:
            self._release(own)

    def _hang_up(self, bounded: BoundedConnection) -> str:
        with self._lock:
            stopping = self._stopping
        if stopping:
            return "a connection was closed by the daemon's stop"
        if bounded.replying:
            return "a client hung up before taking its reply"
        return (
            f"a client hung up before sending its whole request ({bounded.received} bytes received)"
        )

    def _release(self, own: socket.socket) -> None:
        with self._lock:
            self._open.pop(own, None)
        own.close()
        self._slots.release()


def _shut_down(conn: socket.socket) -> None:
    """End the connection for every descriptor of it (an attach watcher's duplicate sees EOF)."""
    with contextlib.suppress(OSError):  # already closed, or reset by the peer
        conn.shutdown(socket.SHUT_RDWR)
