"""The engine rank's socket side of the expert layout protocol (docs/protocol.md).

Every request goes through ``sglang.srt.weight_cache.protocol.send_msg`` / ``recv_msg`` (one
length-prefixed pickled dict each way), on the daemon's control socket. ``attach`` keeps its
connection open for the engine's lifetime (the daemon detaches the engine on EOF, however the
engine exits); an engine rank's begin, commit and abort go over one ``LayoutConnection`` for its
life; every other request (and the module's ``begin``, ``commit`` and ``abort``, for tools and
tests) uses its own short connection. Every socket operation has a timeout, and only a socket
node owned by this user is connected to.

The shapes are ``layout_ledger.wire.protocol``'s: each call sends a request's ``to_wire`` and
returns ``Reply.from_wire`` of the answer, one typed ``Outcome``, so callers never match strings.
This module adds the two outcomes only the socket layer finds: ``NO_DAEMON`` (no socket file at the
path; the IPC loader then falls back to disk) and ``UNREACHABLE`` (the socket exists but the
daemon could not be read: connection refused, timeout, reset, not a socket owned by this user).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence

from layout_ledger.wire.protocol import (
    AbortRequest,
    AttachRequest,
    BeginRequest,
    CommitRequest,
    ContentCheckRequest,
    LayoutRequest,
    LeaseRequest,
    Outcome,
    QueryRequest,
    ReleaseRequest,
    ReloadRequest,
    RepairRequest,
    Reply,
)
from layout_ledger.wire.socket_node import socket_node_problem

logger = logging.getLogger(__name__)

# ``Outcome`` and ``Reply`` are protocol's, named here too because every call returns them.
__all__ = [
    "DEFAULT_REQUEST_TIMEOUT",
    "Attachment",
    "LayoutConnection",
    "Outcome",
    "Reply",
    "abort",
    "attach",
    "begin",
    "commit",
    "content_check",
    "lease",
    "query",
    "release",
    "repair",
]

# Seconds for each connect, send and receive. The daemon serves each connection on its own
# thread and bounds each request and reply itself (``settings.REQUEST_TIMEOUT``, 5 s by
# default), so a healthy daemon answers well within this.
DEFAULT_REQUEST_TIMEOUT = 30.0
# Seconds for the reply to ``expert_layout_reload``: the daemon reads the changed slots' experts
# from its checkpoint before it answers (a layer's local experts: up to 1.6 GB in BF16 at
# DeepSeek-V3's EP 16), so a healthy daemon on a slow disk may take minutes.
RELOAD_TIMEOUT = 600.0


class Attachment:
    """An attach request's reply and, when it was ``ok``, the connection kept open.

    The connection is the engine's presence on the daemon: keep this object referenced for the
    engine's lifetime (dropping it closes the socket and detaches the engine).
    """

    def __init__(self, socket_path: str, engine_id: str, reply: Reply, conn: socket.socket | None):
        self.socket_path = socket_path
        self.engine_id = engine_id
        self.reply = reply
        self._conn = conn

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def close(self) -> None:
        """Detach now (the daemon sees EOF)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __repr__(self) -> str:
        return (
            f"Attachment(socket_path={self.socket_path!r}, engine_id={self.engine_id!r}, "
            f"outcome={self.reply.outcome.value}, open={self.is_open})"
        )


def attach(
    socket_path: str,
    engine_id: str,
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
    role: str | None = None,
) -> Attachment:
    """``expert_layout_attach`` (as ``role``; None sends none: active); on ``ok`` the returned
    ``Attachment`` holds the open connection."""
    request = AttachRequest(engine_id, role)
    conn, reply = _exchange(socket_path, request, timeout, keep_open=True)
    if conn is not None and not reply.ok:
        conn.close()
        conn = None
    if conn is not None:
        # Nothing is read or written on the attach connection again; only its EOF matters.
        conn.settimeout(None)
    return Attachment(socket_path, engine_id, reply, conn)


def query(socket_path: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_query``: the daemon's layout state, or ``no_record``."""
    return _request(socket_path, QueryRequest(), timeout)


def begin(
    socket_path: str,
    engine_id: str,
    base_version: int,
    layers: Sequence[int],
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> Reply:
    """``expert_layout_begin``: mark a move of ``layers`` from ``base_version`` pending."""
    return _request(socket_path, BeginRequest(engine_id, base_version, layers), timeout)


def commit(
    socket_path: str,
    engine_id: str,
    rows: Mapping[int, Sequence[int]],
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> Reply:
    """``expert_layout_commit``: store the rows; an ``ok`` body has a valid version and digest."""
    return _request(socket_path, CommitRequest(engine_id, rows), timeout)


def abort(socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_abort``: drop this engine's pending move without a change."""
    return _request(socket_path, AbortRequest(engine_id), timeout)


def content_check(socket_path: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_content_check``: an ``ok`` reply has ``content`` (``ContentView``)."""
    return _request(socket_path, ContentCheckRequest(), timeout)


def repair(
    socket_path: str,
    engine_id: str,
    rows: Mapping[int, Sequence[int]],
    fingerprints: Mapping[int, Sequence[str]],
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
    *,
    expected_fingerprints: Mapping[int, Mapping[int, str]] | None = None,
) -> Reply:
    """``expert_layout_repair``: an ``ok`` body has the new version and digest.

    ``expected_fingerprints``: ``{layer: {expert: fingerprint}}`` of the experts the rows name
    in the daemon's local slots (it accepts a slot named as an expert it never held only so)."""
    request = RepairRequest(engine_id, rows, fingerprints, expected_fingerprints)
    return _request(socket_path, request, timeout)


def reload(
    socket_path: str,
    engine_id: str,
    *,
    base_version: int,
    version: int,
    digest: str,
    physical_to_logical_map: Sequence[Sequence[int]],
    timeout: float = RELOAD_TIMEOUT,
) -> Reply:
    """``expert_layout_reload``: the daemon reloads from its checkpoint the local slots whose
    expert changes and records ``version``; an ``ok`` reply has its ``layout``."""
    request = ReloadRequest(engine_id, base_version, version, digest, physical_to_logical_map)
    return _request(socket_path, request, timeout)


def lease(socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_lease``: a standby's lease, before it serves."""
    return _request(socket_path, LeaseRequest(engine_id), timeout)


def release(socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_release``: a standby ends its lease."""
    return _request(socket_path, ReleaseRequest(engine_id), timeout)


class LayoutConnection:
    """One engine rank's begin, commit and abort to its daemon, over one connection for its life.

    The connection is opened by the first request and kept; the daemon serves the next
    requests on it, each within its deadlines (docs/protocol.md "Framing"). It is never
    reopened: once a request fails in transport (its reply may be lost while the daemon acted
    on it), it and every later request answer ``UNREACHABLE`` naming the first failure, and
    the engine stops rebalancing (``lost`` says why). Not thread-safe: one caller at a time
    (the rank's rebalance agent).
    """

    def __init__(
        self, socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT
    ) -> None:
        self.socket_path = socket_path
        self.engine_id = engine_id
        self.timeout = timeout
        self.lost: str | None = None
        self.requests = 0  # requests sent over the connection
        self.connects = 0  # connections opened (at most one)
        self._conn: socket.socket | None = None

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def begin(self, base_version: int, layers: Sequence[int]) -> Reply:
        return self._request(BeginRequest(self.engine_id, base_version, layers))

    def commit(self, rows: Mapping[int, Sequence[int]]) -> Reply:
        return self._request(CommitRequest(self.engine_id, rows))

    def abort(self) -> Reply:
        return self._request(AbortRequest(self.engine_id))

    def close(self) -> None:
        """Close the connection (the daemon's thread for it sees EOF and ends)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.lost is None:
            self.lost = "the connection was closed"

    def _request(self, request: LayoutRequest) -> Reply:
        if self.lost is not None:
            return Reply(Outcome.UNREACHABLE, f"no connection to {self.socket_path}: {self.lost}")
        if self._conn is None:
            conn, reply = _exchange(self.socket_path, request, self.timeout, keep_open=True)
            self.connects += 1
            self.requests += 1
            if conn is None:
                self.lost = reply.reason
            self._conn = conn
            return reply
        self.requests += 1
        conn = self._conn
        request_type = str(request.to_wire()["type"])
        try:
            raw = _send_and_receive(conn, request.to_wire())
        except _TRANSPORT_ERRORS as exc:
            reply = _transport_failure(self.socket_path, request_type, exc)
        except Exception as exc:  # unpickling a broken frame can raise anything
            reply = _unreadable(self.socket_path, request_type, exc)
        else:
            return Reply.from_wire(raw, request_type=request_type, peer=self.socket_path)
        self._conn = None
        conn.close()
        self.lost = reply.reason
        return reply

    def __repr__(self) -> str:
        return (
            f"LayoutConnection(socket_path={self.socket_path!r}, engine_id={self.engine_id!r}, "
            f"open={self.is_open}, lost={self.lost!r})"
        )


# --- internals -----------------------------------------------------------------------------


def _request(socket_path: str, request: LayoutRequest, timeout: float) -> Reply:
    _, reply = _exchange(socket_path, request, timeout, keep_open=False)
    return reply


def _exchange(
    socket_path: str, request: LayoutRequest, timeout: float, *, keep_open: bool
) -> tuple[socket.socket | None, Reply]:
    """Send one request and read one reply; return the connection too when ``keep_open``."""
    wire = request.to_wire()
    request_type: str = wire["type"]
    absent = socket_node_problem(socket_path)
    if absent is not None:
        return None, absent
    # Import sglang's framing before connecting: a first import takes seconds, and the daemon
    # drops a connection that sends no whole request within its deadline of the accept.
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(socket_path)
        send_msg(conn, wire)
        raw = recv_msg(conn)
    except FileNotFoundError:
        conn.close()
        return None, Reply(Outcome.NO_DAEMON, f"no daemon socket at {socket_path}")
    except _TRANSPORT_ERRORS as exc:
        conn.close()
        return None, _transport_failure(socket_path, request_type, exc)
    except Exception as exc:  # unpickling a broken frame can raise anything
        conn.close()
        return None, _unreadable(socket_path, request_type, exc)
    reply = Reply.from_wire(raw, request_type=request_type, peer=socket_path)
    if keep_open:
        return conn, reply
    conn.close()
    return None, reply


# OSError covers refused, reset, broken pipe and socket.timeout; recv_msg raises ConnectionError
# (an OSError) on EOF and ValueError on an oversized frame.
_TRANSPORT_ERRORS = (OSError, EOFError, ValueError)


def _send_and_receive(conn: socket.socket, wire: dict[str, object]) -> object:
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    send_msg(conn, wire)
    return recv_msg(conn)


def _transport_failure(socket_path: str, request_type: str, exc: BaseException) -> Reply:
    return Reply(
        Outcome.UNREACHABLE,
        f"could not read the daemon at {socket_path} ({request_type}): {type(exc).__name__}: {exc}",
    )


def _unreadable(socket_path: str, request_type: str, exc: BaseException) -> Reply:
    return Reply(
        Outcome.ERROR,
        f"the daemon at {socket_path} sent an unreadable reply to {request_type}: "
        f"{type(exc).__name__}: {exc}",
    )
