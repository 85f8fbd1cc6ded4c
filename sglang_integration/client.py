"""The engine rank's side of the expert layout protocol (PROTOCOL.md), over sglang's framing.

Every request goes through ``sglang.srt.weight_cache.protocol.send_msg`` / ``recv_msg`` (one
length-prefixed pickled dict each way), on the daemon's control socket. ``attach`` keeps its
connection open for the engine's lifetime (the daemon detaches the engine on EOF, however the
engine exits); every other request uses its own short connection.

Each call returns a ``Reply`` whose ``outcome`` says, once and typed, what happened, so callers
never match strings:

- ``OK``, ``NO_RECORD``, ``BUSY``, ``REFUSED``: the daemon's own statuses;
- ``OLDER_DAEMON``: the daemon answered ``error`` with "Unknown request type" (sglang 0.5.23
  without the plugin); it keeps no record and ignores the layout requests;
- ``ERROR``: any other ``error`` reply, or a reply that breaks the protocol;
- ``NO_DAEMON``: no socket file at the path (the IPC loader then falls back to disk);
- ``UNREACHABLE``: the socket exists but the daemon could not be read (connection refused,
  timeout, reset, not a socket owned by this user).

Every socket operation has a timeout.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from layout_ledger import messages
from layout_ledger.layout import Map

logger = logging.getLogger(__name__)

# Seconds for each connect, send and receive. The daemon serves connections one at a time and
# bounds each exchange with 30 s itself, so a healthy daemon answers well within this.
DEFAULT_REQUEST_TIMEOUT = 30.0


class Outcome(enum.Enum):
    """What a request came to; see the module docstring."""

    OK = "ok"
    NO_RECORD = "no_record"
    BUSY = "busy"
    REFUSED = "refused"
    OLDER_DAEMON = "older_daemon"
    ERROR = "error"
    NO_DAEMON = "no_daemon"
    UNREACHABLE = "unreachable"


_STATUS_OUTCOMES = {
    messages.OK: Outcome.OK,
    messages.NO_RECORD: Outcome.NO_RECORD,
    messages.BUSY: Outcome.BUSY,
    messages.REFUSED: Outcome.REFUSED,
}


@dataclass(frozen=True)
class PendingMove:
    """Another (or this) engine's begun move, as the daemon reports it."""

    engine_id: str
    layers: tuple[int, ...]
    base_version: int


@dataclass(frozen=True)
class DaemonLayout:
    """The ``layout`` field of an ``ok`` reply (PROTOCOL.md "layout state")."""

    version: int
    digest: str
    physical_to_logical_map: Map
    dirty: bool
    dirty_reason: str | None
    pending: PendingMove | None
    attached: tuple[str, ...]
    non_following_fetch: bool


@dataclass(frozen=True)
class Reply:
    """One request's result. ``reason`` is the daemon's reason or the local failure."""

    outcome: Outcome
    reason: str | None = None
    body: Mapping[str, Any] = field(default_factory=dict)
    layout: DaemonLayout | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class ProtocolViolation(Exception):
    """A reply that does not have the shape PROTOCOL.md gives it."""


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
    socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT
) -> Attachment:
    """``expert_layout_attach``; on ``ok`` the returned ``Attachment`` holds the open connection."""
    conn, reply = _exchange(
        socket_path,
        {"type": messages.ATTACH, "engine_id": engine_id},
        timeout,
        keep_open=True,
    )
    if conn is not None and not reply.ok:
        conn.close()
        conn = None
    if conn is not None:
        # Nothing is read or written on the attach connection again; only its EOF matters.
        conn.settimeout(None)
    return Attachment(socket_path, engine_id, reply, conn)


def query(socket_path: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_query``: the daemon's layout state, or ``no_record``."""
    return _request(socket_path, {"type": messages.QUERY}, timeout)


def begin(
    socket_path: str,
    engine_id: str,
    base_version: int,
    layers: Sequence[int],
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> Reply:
    """``expert_layout_begin``: mark a move of ``layers`` from ``base_version`` pending."""
    return _request(
        socket_path,
        {
            "type": messages.BEGIN,
            "engine_id": engine_id,
            "base_version": int(base_version),
            "layers": [int(layer) for layer in layers],
        },
        timeout,
    )


def commit(
    socket_path: str,
    engine_id: str,
    rows: Mapping[int, Sequence[int]],
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
) -> Reply:
    """``expert_layout_commit``: store the rows; an ``ok`` body has ``version`` and ``digest``."""
    reply = _request(
        socket_path,
        {
            "type": messages.COMMIT,
            "engine_id": engine_id,
            "rows": {int(layer): [int(v) for v in row] for layer, row in rows.items()},
        },
        timeout,
    )
    if reply.ok:
        version, digest = reply.body.get("version"), reply.body.get("digest")
        if type(version) is not int or not _is_digest(digest):
            return Reply(
                Outcome.ERROR,
                f"the daemon at {socket_path} acknowledged the commit without a valid "
                f"version and digest: {dict(reply.body)!r}",
                reply.body,
            )
    return reply


def abort(socket_path: str, engine_id: str, timeout: float = DEFAULT_REQUEST_TIMEOUT) -> Reply:
    """``expert_layout_abort``: drop this engine's pending move without a change."""
    return _request(socket_path, {"type": messages.ABORT, "engine_id": engine_id}, timeout)


# --- internals -----------------------------------------------------------------------------


def _request(socket_path: str, request: dict[str, Any], timeout: float) -> Reply:
    _, reply = _exchange(socket_path, request, timeout, keep_open=False)
    return reply


def _exchange(
    socket_path: str, request: dict[str, Any], timeout: float, *, keep_open: bool
) -> tuple[socket.socket | None, Reply]:
    """Send one request and read one reply; return the connection too when ``keep_open``."""
    # sglang's framing; imported here so importing this module stays cheap.
    from sglang.srt.weight_cache.protocol import recv_msg, send_msg

    absent = _check_socket_node(socket_path)
    if absent is not None:
        return None, absent
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(socket_path)
        send_msg(conn, request)
        raw = recv_msg(conn)
    except FileNotFoundError:
        conn.close()
        return None, Reply(Outcome.NO_DAEMON, f"no daemon socket at {socket_path}")
    except (OSError, EOFError, ValueError) as exc:
        # OSError covers refused, reset, broken pipe and socket.timeout; recv_msg raises
        # ConnectionError (an OSError) on EOF and ValueError on an oversized frame.
        conn.close()
        return None, Reply(
            Outcome.UNREACHABLE,
            f"could not read the daemon at {socket_path} "
            f"({request['type']}): {type(exc).__name__}: {exc}",
        )
    except Exception as exc:  # unpickling a broken frame can raise anything
        conn.close()
        return None, Reply(
            Outcome.ERROR,
            f"the daemon at {socket_path} sent an unreadable reply to {request['type']}: "
            f"{type(exc).__name__}: {exc}",
        )
    reply = _classify(socket_path, request["type"], raw)
    if keep_open:
        return conn, reply
    conn.close()
    return None, reply


def _check_socket_node(socket_path: str) -> Reply | None:
    """The IPC loader's rule: connect only to a socket node owned by this user."""
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return Reply(Outcome.NO_DAEMON, f"no daemon socket at {socket_path}")
    except OSError as exc:
        return Reply(Outcome.UNREACHABLE, f"cannot stat the daemon socket {socket_path}: {exc}")
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return Reply(
            Outcome.UNREACHABLE,
            f"refusing to connect: {socket_path} is not a socket owned by this user",
        )
    return None


def _classify(socket_path: str, request_type: str, raw: Any) -> Reply:
    if not isinstance(raw, Mapping):
        return Reply(
            Outcome.ERROR,
            f"the daemon at {socket_path} answered {request_type} with a "
            f"{type(raw).__name__}, not a dict",
        )
    status = raw.get("status")
    # The older daemon puts its text in "message"; PROTOCOL.md replies use "reason".
    reason = raw.get("reason") or raw.get("message")
    reason = None if reason is None else str(reason)
    if status == messages.ERROR and (reason or "").startswith(messages.UNKNOWN_REQUEST_PREFIX):
        return Reply(Outcome.OLDER_DAEMON, reason, raw)
    outcome = _STATUS_OUTCOMES.get(status) if isinstance(status, str) else None
    if outcome is None:
        return Reply(
            Outcome.ERROR,
            f"the daemon at {socket_path} answered {request_type} with status {status!r}"
            + (f": {reason}" if reason else ""),
            raw,
        )
    layout = None
    if outcome is Outcome.OK and "layout" in raw:
        try:
            layout = parse_layout(raw["layout"])
        except ProtocolViolation as exc:
            return Reply(
                Outcome.ERROR,
                f"the daemon at {socket_path} sent a malformed layout in reply to "
                f"{request_type}: {exc}",
                raw,
            )
    elif outcome is Outcome.OK and request_type in (messages.ATTACH, messages.QUERY):
        return Reply(
            Outcome.ERROR,
            f"the daemon at {socket_path} answered {request_type} ok without a layout",
            raw,
        )
    return Reply(outcome, reason, raw, layout)


def parse_layout(raw: Any) -> DaemonLayout:
    """Validate a wire ``layout`` dict into a ``DaemonLayout``; raise ``ProtocolViolation``."""
    if not isinstance(raw, Mapping):
        raise ProtocolViolation(f"layout is a {type(raw).__name__}, not a dict")
    version = raw.get("version")
    if type(version) is not int or version < 0:
        raise ProtocolViolation(f"version {version!r} is not a non-negative int")
    digest = raw.get("digest")
    if not _is_digest(digest):
        raise ProtocolViolation(f"digest {digest!r} is not 64 lowercase hex characters")
    the_map = raw.get("physical_to_logical_map")
    if not isinstance(the_map, list) or not all(
        isinstance(row, list) and all(type(v) is int for v in row) for row in the_map
    ):
        raise ProtocolViolation("physical_to_logical_map is not a list of lists of ints")
    dirty = raw.get("dirty")
    if not isinstance(dirty, bool):
        raise ProtocolViolation(f"dirty {dirty!r} is not a bool")
    dirty_reason = raw.get("dirty_reason")
    if dirty_reason is not None and not isinstance(dirty_reason, str):
        raise ProtocolViolation(f"dirty_reason {dirty_reason!r} is not a string")
    pending = _parse_pending(raw.get("pending"))
    attached = raw.get("attached", [])
    if not isinstance(attached, list) or not all(isinstance(e, str) for e in attached):
        raise ProtocolViolation(f"attached {attached!r} is not a list of engine ids")
    non_following = raw.get("non_following_fetch", False)
    if not isinstance(non_following, bool):
        raise ProtocolViolation(f"non_following_fetch {non_following!r} is not a bool")
    return DaemonLayout(
        version=version,
        digest=digest,
        physical_to_logical_map=[list(row) for row in the_map],
        dirty=dirty,
        dirty_reason=dirty_reason,
        pending=pending,
        attached=tuple(attached),
        non_following_fetch=non_following,
    )


def _parse_pending(raw: Any) -> PendingMove | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolViolation(f"pending is a {type(raw).__name__}, not a dict or None")
    engine_id, layers, base = (
        raw.get("engine_id"),
        raw.get("layers"),
        raw.get("base_version"),
    )
    if not isinstance(engine_id, str):
        raise ProtocolViolation(f"pending engine_id {engine_id!r} is not a string")
    if not isinstance(layers, list) or not all(type(layer) is int for layer in layers):
        raise ProtocolViolation(f"pending layers {layers!r} is not a list of ints")
    if type(base) is not int:
        raise ProtocolViolation(f"pending base_version {base!r} is not an int")
    return PendingMove(engine_id, tuple(layers), base)


def _is_digest(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )
