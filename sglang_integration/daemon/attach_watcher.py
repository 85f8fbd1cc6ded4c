"""One background thread that watches every open attach connection and reports each one's end.

An engine's attach connection is its presence on the daemon (docs/protocol.md "Presence"): the
engine never writes on it again, and the kernel closes it however the engine exits, SIGKILL
included.
The daemon hands the watcher its own duplicate of each such connection (``watch``); the
watcher waits on all of them at once with ``selectors`` and, on EOF or a socket error,
unregisters and closes the connection and calls ``on_closed(key, reason)`` on its thread.

Registration comes from the daemon's serve loop (another thread). A selector is not safe to
change while another thread is inside ``select``, so new connections go through a locked list
and a wake-up socket pair; only the watcher thread touches the selector.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import cast

logger = logging.getLogger(__name__)

EOF_REASON = "attach connection closed (EOF)"
# Bytes read per wake-up from an attach connection; an engine sends nothing there, so anything
# read is discarded.
_READ_SIZE = 4096


class WatcherStopped(RuntimeError):
    """``watch`` was called after ``stop``."""


class AttachWatcher:
    """Watches attach connections; ``on_closed(key, reason)`` runs once per ended connection."""

    def __init__(
        self,
        on_closed: Callable[[str, str], None],
        name: str = "expert-layout-attach-watcher",
    ) -> None:
        self._on_closed = on_closed
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._lock = threading.Lock()
        self._incoming: list[tuple[socket.socket, str]] = []
        self._watched = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def watched(self) -> int:
        """How many connections are watched (or handed over and about to be)."""
        with self._lock:
            return self._watched + len(self._incoming)

    def watch(self, conn: socket.socket, key: str) -> None:
        """Take ownership of ``conn`` and report its end under ``key``."""
        # A duplicate shares the file status flags with the daemon's original; the original
        # already runs in non-blocking mode under its timeout, and the watcher never blocks.
        conn.setblocking(False)
        with self._lock:
            if self._stopping:
                conn.close()
                raise WatcherStopped("the attach watcher has stopped; the daemon is shutting down")
            self._incoming.append((conn, key))
        self._wake()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread and close every watched connection without reporting it."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the attach watcher thread did not stop within %.0f s", timeout)
            return
        with self._lock:
            pending, self._incoming = self._incoming, []
        for conn, _ in pending:
            conn.close()
        for selector_key in list(self._selector.get_map().values()):
            watched = selector_key.fileobj  # every registered object is a socket
            if isinstance(watched, socket.socket) and watched is not self._wake_reader:
                watched.close()
        self._selector.close()
        self._wake_reader.close()
        self._wake_writer.close()

    # --- the watcher thread -------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the wake-up buffer is full: the thread is already due to wake
        except OSError:
            pass  # closed by stop(); nothing left to wake

    def _run(self) -> None:
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        while True:
            # Check before every select: a drain below may swallow the wake-up byte that stop()
            # sent after setting the flag, and select() would then wait for ever.
            with self._lock:
                if self._stopping:
                    return
            events = self._selector.select()
            with self._lock:
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
                self._watched += len(incoming)
            for conn, key in incoming:
                self._selector.register(conn, selectors.EVENT_READ, key)
            for selector_key, _ in events:
                if selector_key.fileobj is self._wake_reader:
                    self._drain_wake_ups()
                else:
                    self._read(selector_key)

    def _drain_wake_ups(self) -> None:
        try:
            while self._wake_reader.recv(_READ_SIZE):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _read(self, selector_key: selectors.SelectorKey) -> None:
        conn = cast(socket.socket, selector_key.fileobj)  # only sockets are registered
        try:
            data = conn.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            reason = f"attach connection failed ({type(exc).__name__}: {exc})"
        else:
            if data:
                return  # engines send nothing on an attach connection; ignore what arrives
            reason = EOF_REASON
        self._selector.unregister(conn)
        conn.close()
        with self._lock:
            self._watched -= 1
        try:
            self._on_closed(selector_key.data, reason)
        except Exception:
            # This thread must outlive any one engine's detach; the callback logs its own
            # failures, this is the last guard.
            logger.exception("handling the end of attach connection %r failed", selector_key.data)
