"""What the daemon hooks hand sglang's code in place of a socket, or of the socket module.

Each stand-in changes one or two methods and passes everything else through to what it stands
in for (``PassThrough``, the one ``__getattr__``): sglang's handler and transport may call any
socket method on a connection, and serve any name of the socket module.

- ``BoundedConnection`` (``connections``): reads and sends within the connection's deadlines;
- ``RecordingConnection``: keeps every byte ``recv_msg`` reads, so the frame can be replayed;
- ``ReplayConnection``: serves that frame again to sglang's original handler, then the socket;
- ``BacklogSocketModule``: the socket module whose ``socket`` class listens with a larger
  backlog, for serve's listening socket.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol


class Receiver(Protocol):
    """A connection's reads (a socket, or a ``BoundedConnection``)."""

    def recv(self, size: int, *flags: int) -> bytes: ...


class PassThrough:
    """Stands in for ``wrapped``: what a subclass does not define is ``wrapped``'s."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped: Any = wrapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class RecordingConnection:
    """Reads through to the connection and keeps every byte read (one request frame).

    Only ``recv``: it is handed to sglang's ``recv_msg`` alone, never to a handler.
    """

    def __init__(self, conn: Receiver) -> None:
        self._conn = conn
        self.received = bytearray()

    def recv(self, size: int) -> bytes:
        data = self._conn.recv(size)
        self.received.extend(data)
        return data


class ReplayConnection(PassThrough):
    """The connection, with the already-read frame served again to the first reads."""

    def __init__(self, conn: Receiver, already_read: bytes) -> None:
        super().__init__(conn)
        self._conn = conn
        self._replay = memoryview(bytes(already_read))

    def recv(self, size: int, *flags: int) -> bytes:
        if self._replay:
            chunk, self._replay = self._replay[:size], self._replay[size:]
            return bytes(chunk)
        return self._conn.recv(size, *flags)


class BacklogSocketModule(PassThrough):
    """The socket module, except that its ``socket`` class listens with at least ``backlog``."""

    def __init__(self, backlog: int) -> None:
        super().__init__(socket)

        class ListeningSocket(socket.socket):
            def listen(self, requested: int = backlog, /) -> None:
                super().listen(max(requested, backlog))

        self.socket = ListeningSocket
