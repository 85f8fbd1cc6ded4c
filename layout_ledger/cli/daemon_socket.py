"""The CLI's one way to write: a request over a daemon's control socket (``cordon``, ``uncordon``,
``heal``).

sglang's framing, as ``sglang.srt.weight_cache.protocol.send_msg``/``recv_msg`` frame it: a
4-byte big-endian length and one pickled dict each way; written here so that the CLI imports no
sglang. The reply is unpickled by an unpickler that builds only plain values (dicts, lists,
strings, numbers, booleans, None: no class is ever looked up), so a reply cannot run code, and
only a socket node owned by this user is connected to (the engine's own rule). The reply is read
with ``wire.protocol.Reply.from_wire``, as an engine reads it.
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from typing import Any, Protocol

from layout_ledger.wire.protocol import Outcome, Reply
from layout_ledger.wire.socket_node import socket_node_problem

# Seconds for the connect, the send and the reply; the daemon answers within its own request
# deadline (5 s by default).
TIMEOUT = 10.0
# A cordon's reply is a few hundred bytes; anything far larger is no reply of this protocol.
MAX_REPLY_BYTES = 1 << 20
_HEADER = struct.Struct("!I")


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain values only: a pickle that names any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the reply names {module}.{name}; a daemon's reply holds plain values only"
        )


class WireRequest(Protocol):
    """A request the CLI sends (``protocol.CordonRequest``, ``UncordonRequest``, ...)."""

    def to_wire(self) -> dict[str, Any]: ...


def ask(socket_path: str, request: WireRequest, timeout: float = TIMEOUT) -> Reply:
    """Send ``request`` to the daemon at ``socket_path`` and read its one reply (never raises:
    a socket that is not there is ``NO_DAEMON``, one that cannot be read ``UNREACHABLE``)."""
    wire = request.to_wire()
    request_type: str = wire["type"]
    problem = socket_node_problem(socket_path)
    if problem is not None:
        return problem
    data = pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(socket_path)
            conn.sendall(_HEADER.pack(len(data)) + data)
            (length,) = _HEADER.unpack(_read_exactly(conn, _HEADER.size))
            if length > MAX_REPLY_BYTES:
                raise ValueError(f"a reply of {length} bytes; at most {MAX_REPLY_BYTES} expected")
            body = _read_exactly(conn, length)
    except (FileNotFoundError, ConnectionRefusedError):
        return Reply(Outcome.NO_DAEMON, f"no daemon listens on {socket_path}")
    except (OSError, EOFError) as exc:
        return Reply(
            Outcome.UNREACHABLE,
            f"could not read the daemon at {socket_path} ({request_type}): "
            f"{type(exc).__name__}: {exc}",
        )
    except ValueError as exc:
        return Reply(Outcome.ERROR, f"the daemon at {socket_path} sent {exc}")
    try:
        raw = _PlainUnpickler(io.BytesIO(body)).load()
    except Exception as exc:  # unpickling a broken frame can raise anything
        return Reply(
            Outcome.ERROR,
            f"the daemon at {socket_path} sent an unreadable reply to {request_type}: "
            f"{type(exc).__name__}: {exc}",
        )
    return Reply.from_wire(raw, request_type=request_type, peer=socket_path)


def unsuccessful_result(reply: Reply) -> str:
    """The result a command reports for a reply that did not do what it asked (one name per
    outcome, the same in every command that asks daemons: ``cordon``, ``uncordon``, ``heal``)."""
    return _UNSUCCESSFUL.get(reply.outcome, "error")


_UNSUCCESSFUL = {
    Outcome.NO_RECORD: "no_record",
    Outcome.NO_DAEMON: "not_running",
    Outcome.REFUSED: "refused",
    Outcome.OLDER_DAEMON: "older_daemon",
    Outcome.UNREACHABLE: "unreachable",
}


def _read_exactly(conn: socket.socket, count: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < count:
        chunk = conn.recv(count - len(buffer))
        if not chunk:
            raise EOFError("the daemon closed the connection before its reply was whole")
        buffer.extend(chunk)
    return bytes(buffer)
