"""The expert layout wire protocol (docs/protocol.md), defined once for the daemon and the engine.

Every shape that crosses the daemon's control socket, with its ``to_wire`` (the dict sglang's
``send_msg`` pickles) and, where the other side reads it back, its ``from_wire``: the names
(request types, statuses, the ``fetch_state`` field), the layout and content views, the
requests an engine sends, and the replies, which the engine reads with ``Reply.from_wire`` into
one typed ``Outcome`` so that no caller matches status strings. No sglang, no torch, no I/O:
the framing and the sockets belong to the callers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from layout_ledger.core.content import is_fingerprint
from layout_ledger.core.layout import Map, is_digest
from layout_ledger.core.state import (
    ROLES,
    ContentState,
    Cordon,
    LayoutState,
    PendingMove,
    RestoredFrom,
)

# --- names ------------------------------------------------------------------------------------

ATTACH = "expert_layout_attach"
QUERY = "expert_layout_query"
BEGIN = "expert_layout_begin"
COMMIT = "expert_layout_commit"
ABORT = "expert_layout_abort"
CONTENT_CHECK = "expert_layout_content_check"
REPAIR = "expert_layout_repair"
CORDON = "expert_layout_cordon"
UNCORDON = "expert_layout_uncordon"
LEASE = "expert_layout_lease"
RELEASE = "expert_layout_release"
# Extensions: an engine alone on the daemon has it reload slots from its checkpoint into a new
# map; an operator (or the daemon itself) heals a dirty daemon from its checkpoint.
RELOAD = "expert_layout_reload"
HEAL = "expert_layout_heal"
FETCH_STATE = "fetch_state"

LAYOUT_REQUEST_TYPES = frozenset(
    {
        ATTACH,
        QUERY,
        BEGIN,
        COMMIT,
        ABORT,
        CONTENT_CHECK,
        REPAIR,
        CORDON,
        UNCORDON,
        LEASE,
        RELEASE,
        RELOAD,
        HEAL,
    }
)

# The role field of an attach request and of its ok reply (``core.state.ROLES``). A daemon from
# before roles answers the attach without it: the engine is active there.
ROLE_FIELD = "role"

OK = "ok"
BUSY = "busy"
REFUSED = "refused"
NO_RECORD = "no_record"
LAYOUT_REFUSED = "layout_refused"
ERROR = "error"

# Every status a daemon with this plugin answers other than ``ok``; each such reply has a reason.
NOT_OK_STATUSES = frozenset({BUSY, REFUSED, NO_RECORD, LAYOUT_REFUSED, ERROR})

# The optional field an engine adds to ``fetch_state``.
FETCH_LAYOUT_FIELD = "expert_layout"
# The optional field of ``expert_layout_repair``: fingerprints of experts a daemon never held.
EXPECTED_FINGERPRINTS = "expected_fingerprints"

# sglang 0.5.23's daemon answers a request type it does not know with
# {"status": "error", "message": "Unknown request type: ..."}; an engine reads that reply to an
# attach as "older daemon, keeps no record".
UNKNOWN_REQUEST_PREFIX = "Unknown request type"


class ProtocolViolation(Exception):
    """A reply that does not have the shape docs/protocol.md gives it."""


# --- the layout state -------------------------------------------------------------------------


def pending_to_wire(move: PendingMove) -> dict[str, Any]:
    """A pending move as the ``pending`` (and ``dirty_move``) field holds it."""
    return {
        "engine_id": move.engine_id,
        "layers": list(move.layers),
        "base_version": move.base_version,
    }


def pending_from_wire(raw: Any) -> PendingMove | None:
    """The ``pending`` field (None or a dict); raise ``ProtocolViolation``. A move read from the
    wire has ``since`` None: the daemon and its ledger know when it began, the wire does not."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolViolation(f"pending is a {type(raw).__name__}, not a dict or None")
    engine_id, layers, base = raw.get("engine_id"), raw.get("layers"), raw.get("base_version")
    if not isinstance(engine_id, str):
        raise ProtocolViolation(f"pending engine_id {engine_id!r} is not a string")
    if not isinstance(layers, list) or not all(type(layer) is int for layer in layers):
        raise ProtocolViolation(f"pending layers {layers!r} is not a list of ints")
    if type(base) is not int:
        raise ProtocolViolation(f"pending base_version {base!r} is not an int")
    return PendingMove(engine_id, tuple(layers), base)


def _pending_or_none(move: PendingMove | None) -> dict[str, Any] | None:
    return None if move is None else pending_to_wire(move)


@dataclass(frozen=True)
class LayoutView:
    """The ``layout`` field of an ``ok`` reply to attach and query (the layout state)."""

    version: int
    digest: str
    physical_to_logical_map: Map
    dirty: bool
    dirty_reason: str | None
    pending: PendingMove | None
    attached: tuple[str, ...]
    non_following_fetch: bool
    # The attached engines whose role is standby, and those of them holding a lease (a daemon
    # from before roles sends neither: read as none).
    standbys: tuple[str, ...] = ()
    leases: tuple[str, ...] = ()
    # The committed version the daemon's incarnation restored at its start (None: it started at
    # version 0; a daemon from before restores sends none). Its source is in the ledger only.
    restored_from: RestoredFrom | None = None

    @classmethod
    def of(cls, state: LayoutState) -> LayoutView:
        """What ``attach`` and ``query`` answer for a record in ``state``."""
        return cls(
            version=state.version,
            digest=state.digest,
            physical_to_logical_map=state.physical_to_logical_map,
            dirty=state.dirty is not None,
            dirty_reason=state.dirty.reason if state.dirty else None,
            pending=state.pending,
            attached=tuple(state.attached),
            non_following_fetch=state.non_following_fetch,
            standbys=tuple(state.standbys),
            leases=tuple(state.leases),
            restored_from=state.restored_from,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "physical_to_logical_map": [list(row) for row in self.physical_to_logical_map],
            "dirty": self.dirty,
            "dirty_reason": self.dirty_reason,
            "pending": _pending_or_none(self.pending),
            "attached": list(self.attached),
            "non_following_fetch": self.non_following_fetch,
            "standbys": list(self.standbys),
            "leases": list(self.leases),
            "restored_from": None if self.restored_from is None else self.restored_from.to_wire(),
        }

    @classmethod
    def from_wire(cls, raw: Any) -> LayoutView:
        """Validate a wire ``layout`` dict; raise ``ProtocolViolation`` naming the bad field."""
        if not isinstance(raw, Mapping):
            raise ProtocolViolation(f"layout is a {type(raw).__name__}, not a dict")
        version = raw.get("version")
        if type(version) is not int or version < 0:
            raise ProtocolViolation(f"version {version!r} is not a non-negative int")
        digest = raw.get("digest")
        if not is_digest(digest):
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
        pending = pending_from_wire(raw.get("pending"))
        attached = raw.get("attached", [])
        if not isinstance(attached, list) or not all(isinstance(e, str) for e in attached):
            raise ProtocolViolation(f"attached {attached!r} is not a list of engine ids")
        non_following = raw.get("non_following_fetch", False)
        if not isinstance(non_following, bool):
            raise ProtocolViolation(f"non_following_fetch {non_following!r} is not a bool")
        standbys, leases = raw.get("standbys", []), raw.get("leases", [])
        for name, ids in (("standbys", standbys), ("leases", leases)):
            if not isinstance(ids, list) or not all(isinstance(e, str) for e in ids):
                raise ProtocolViolation(f"{name} {ids!r} is not a list of engine ids")
        return cls(
            version=version,
            digest=str(digest),
            physical_to_logical_map=[list(row) for row in the_map],
            dirty=dirty,
            dirty_reason=dirty_reason,
            pending=pending,
            attached=tuple(attached),
            non_following_fetch=non_following,
            standbys=tuple(standbys),
            leases=tuple(leases),
            restored_from=restored_from_wire(raw.get("restored_from")),
        )


def restored_from_wire(raw: Any) -> RestoredFrom | None:
    """The ``restored_from`` field (None, absent: nothing restored); ``ProtocolViolation``
    naming what is wrong otherwise."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolViolation(f"restored_from is a {type(raw).__name__}, not a dict or null")
    incarnation, version, digest = (raw.get(k) for k in ("incarnation", "version", "digest"))
    if type(incarnation) is not int or incarnation < 1:
        raise ProtocolViolation(f"restored_from.incarnation {incarnation!r} is not an id")
    if type(version) is not int or version < 0:
        raise ProtocolViolation(f"restored_from.version {version!r} is not a non-negative int")
    if not is_digest(digest):
        raise ProtocolViolation(f"restored_from.digest {digest!r} is not a digest")
    return RestoredFrom(incarnation, version, str(digest))


def _fingerprint_layers(raw: Any, what: str) -> dict[int, tuple[str, ...]]:
    """``{layer: [fingerprint, ...]}`` from the wire; raise ``ProtocolViolation``."""
    if not isinstance(raw, Mapping):
        raise ProtocolViolation(f"{what} is a {type(raw).__name__}, not a dict")
    layers: dict[int, tuple[str, ...]] = {}
    for layer, values in raw.items():
        if type(layer) is not int or not isinstance(values, list):
            raise ProtocolViolation(f"{what} maps {layer!r} to {type(values).__name__}")
        if not all(is_fingerprint(value) for value in values):
            raise ProtocolViolation(f"{what} of layer {layer} holds a value that is no fingerprint")
        layers[layer] = tuple(values)
    return layers


@dataclass(frozen=True)
class ContentView:
    """The ``content`` field of an ``ok`` reply to ``expert_layout_content_check``.

    The daemon's local slots (``first_slot`` on) per layer with routed-expert tensors: the
    fingerprints it ``recorded`` at ``version`` and the ones it computed for this request
    (``current``), the map of that version, and whether it is dirty: ``dirty_move`` is the
    unfinished move of an engine that left mid-move (the one cause a repair clears).
    """

    version: int
    digest: str
    physical_to_logical_map: Map
    first_slot: int
    recorded: Mapping[int, tuple[str, ...]]
    current: Mapping[int, tuple[str, ...]]
    dirty: bool
    dirty_reason: str | None
    dirty_move: PendingMove | None
    pending: PendingMove | None

    @classmethod
    def of(cls, found: ContentState) -> ContentView:
        """What a content check answers for what ``LayoutRecord.content_check`` found."""
        state = found.state
        return cls(
            version=state.version,
            digest=state.digest,
            physical_to_logical_map=state.physical_to_logical_map,
            first_slot=found.recorded.first_slot,
            recorded=dict(found.recorded.layers),
            current=dict(found.current.layers),
            dirty=found.dirty,
            dirty_reason=found.dirty_reason,
            dirty_move=found.dirty_move,
            pending=state.pending,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "digest": self.digest,
            "physical_to_logical_map": [list(row) for row in self.physical_to_logical_map],
            "first_slot": self.first_slot,
            "recorded": {layer: list(v) for layer, v in self.recorded.items()},
            "current": {layer: list(v) for layer, v in self.current.items()},
            "dirty": self.dirty,
            "dirty_reason": self.dirty_reason,
            "dirty_move": _pending_or_none(self.dirty_move),
            "pending": _pending_or_none(self.pending),
        }

    @classmethod
    def from_wire(cls, raw: Any) -> ContentView:
        """Validate a wire ``content`` dict; raise ``ProtocolViolation`` naming the bad field."""
        if not isinstance(raw, Mapping):
            raise ProtocolViolation(f"content is a {type(raw).__name__}, not a dict")
        layout = LayoutView.from_wire(
            {**raw, "attached": [], "non_following_fetch": False, "pending": None}
        )
        first_slot = raw.get("first_slot")
        if type(first_slot) is not int or first_slot < 0:
            raise ProtocolViolation(f"first_slot {first_slot!r} is not a non-negative int")
        recorded = _fingerprint_layers(raw.get("recorded"), "recorded")
        current = _fingerprint_layers(raw.get("current"), "current")
        if set(recorded) != set(current):
            raise ProtocolViolation("recorded and current fingerprints cover different layers")
        return cls(
            version=layout.version,
            digest=layout.digest,
            physical_to_logical_map=layout.physical_to_logical_map,
            first_slot=first_slot,
            recorded=recorded,
            current=current,
            dirty=layout.dirty,
            dirty_reason=layout.dirty_reason,
            dirty_move=pending_from_wire(raw.get("dirty_move")),
            pending=pending_from_wire(raw.get("pending")),
        )


# --- requests (engine -> daemon) ----------------------------------------------------------------


@dataclass(frozen=True)
class AttachRequest:
    engine_id: str
    role: str | None = None  # None: no role field (an engine from before roles: active)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": ATTACH, "engine_id": self.engine_id}
        if self.role is not None:
            wire[ROLE_FIELD] = self.role
        return wire


@dataclass(frozen=True)
class LeaseRequest:
    """A standby's lease, asked for before it serves."""

    engine_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": LEASE, "engine_id": self.engine_id}


@dataclass(frozen=True)
class ReleaseRequest:
    """A standby ends its lease (it has not served for its idle time)."""

    engine_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": RELEASE, "engine_id": self.engine_id}


@dataclass(frozen=True)
class ReloadRequest:
    """An engine alone on the daemon has it reload from its checkpoint the local slots whose
    expert changes between its map and ``physical_to_logical_map``, recorded as ``version``
    (a jump from ``base_version``) with ``digest`` (the engine's converging, docs/design.md)."""

    engine_id: str
    base_version: int
    version: int
    digest: str
    physical_to_logical_map: Sequence[Sequence[int]]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": RELOAD,
            "engine_id": self.engine_id,
            "base_version": int(self.base_version),
            "version": int(self.version),
            "digest": str(self.digest),
            "physical_to_logical_map": [
                [int(v) for v in row] for row in self.physical_to_logical_map
            ],
        }


@dataclass(frozen=True)
class QueryRequest:
    def to_wire(self) -> dict[str, Any]:
        return {"type": QUERY}


@dataclass(frozen=True)
class BeginRequest:
    engine_id: str
    base_version: int
    layers: Sequence[int]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": BEGIN,
            "engine_id": self.engine_id,
            "base_version": int(self.base_version),
            "layers": [int(layer) for layer in self.layers],
        }


@dataclass(frozen=True)
class CommitRequest:
    """``rows``: the new row of exactly the pending layers, ``{layer: row}``."""

    engine_id: str
    rows: Mapping[int, Sequence[int]]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": COMMIT,
            "engine_id": self.engine_id,
            # Plain lists of the values given: the daemon checks every one (a value that is
            # not an int expert id is refused there, never converted here).
            "rows": {int(layer): list(row) for layer, row in self.rows.items()},
        }


@dataclass(frozen=True)
class AbortRequest:
    engine_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": ABORT, "engine_id": self.engine_id}


@dataclass(frozen=True)
class ContentCheckRequest:
    """Make the daemon fingerprint its slots now and compare them with its record."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": CONTENT_CHECK}


@dataclass(frozen=True)
class RepairRequest:
    """Record the layout a dirty daemon's pending layers hold: ``rows`` (``{layer: row}``, the
    whole row of exactly the dirty move's layers), ``fingerprints`` (``{layer: [...]}``, the
    daemon's local slots of those layers, as the engine read them) and, optional,
    ``expected_fingerprints`` (``{layer: {expert: fingerprint}}``: the fingerprint of each expert
    the rows name in the daemon's local slots, as the daemon that holds it recorded it; a daemon
    accepts a slot named as an expert it never held only with it)."""

    engine_id: str
    rows: Mapping[int, Sequence[int]]
    fingerprints: Mapping[int, Sequence[str]]
    expected_fingerprints: Mapping[int, Mapping[int, str]] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "type": REPAIR,
            "engine_id": self.engine_id,
            "rows": {int(layer): [int(v) for v in row] for layer, row in self.rows.items()},
            "fingerprints": {int(layer): list(v) for layer, v in self.fingerprints.items()},
        }
        if self.expected_fingerprints is not None:
            wire[EXPECTED_FINGERPRINTS] = {
                int(layer): {int(expert): str(value) for expert, value in experts.items()}
                for layer, experts in self.expected_fingerprints.items()
            }
        return wire


@dataclass(frozen=True)
class CordonRequest:
    """An operator's cordon (``layout-ledger cordon``): every begin answered ``busy`` until an
    uncordon or a daemon restart; ``reason`` (printable, at most 256 characters) says why."""

    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": CORDON, "reason": self.reason}


@dataclass(frozen=True)
class UncordonRequest:
    """Lift the operator's cordon (``layout-ledger uncordon``)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": UNCORDON}


@dataclass(frozen=True)
class HealRequest:
    """Heal a dirty daemon from its checkpoint now (``layout-ledger heal``; no field)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": HEAL}


@dataclass(frozen=True)
class CordonView:
    """The ``cordon`` field of an ``ok`` reply to cordon and uncordon: whether the daemon is
    cordoned now, since when and why (``since`` and ``reason`` None when it is not)."""

    cordoned: bool
    since: str | None
    reason: str | None

    @classmethod
    def of(cls, cordon: Cordon | None) -> CordonView:
        if cordon is None:
            return cls(False, None, None)
        return cls(True, cordon.since, cordon.reason)

    def to_wire(self) -> dict[str, Any]:
        return {"cordoned": self.cordoned, "since": self.since, "reason": self.reason}

    @classmethod
    def from_wire(cls, raw: Any) -> CordonView:
        """Validate a wire ``cordon`` dict; raise ``ProtocolViolation`` naming the bad field."""
        if not isinstance(raw, Mapping):
            raise ProtocolViolation(f"cordon is a {type(raw).__name__}, not a dict")
        cordoned, since, reason = raw.get("cordoned"), raw.get("since"), raw.get("reason")
        if not isinstance(cordoned, bool):
            raise ProtocolViolation(f"cordoned {cordoned!r} is not a bool")
        for name, value in (("since", since), ("reason", reason)):
            fits = isinstance(value, str) if cordoned else value is None
            if not fits:
                raise ProtocolViolation(f"{name} {value!r} does not fit cordoned={cordoned}")
        return cls(cordoned, since, reason)


def cordon_reply(cordon: CordonView) -> dict[str, Any]:
    """``ok`` + ``cordon`` (cordon, uncordon)."""
    return {"status": OK, "cordon": cordon.to_wire()}


LayoutRequest = (
    AttachRequest
    | QueryRequest
    | BeginRequest
    | CommitRequest
    | AbortRequest
    | ContentCheckRequest
    | RepairRequest
    | CordonRequest
    | UncordonRequest
    | LeaseRequest
    | ReleaseRequest
    | ReloadRequest
)


@dataclass(frozen=True)
class FetchLayout:
    """The ``expert_layout`` field of ``fetch_state``: the layout the engine routes with.

    ``engine_id`` only when the engine is attached (None otherwise); the daemon compares the
    digest, the version appears in messages only.
    """

    engine_id: str | None
    version: int
    digest: str

    def to_wire(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "version": self.version, "digest": self.digest}


# --- replies (daemon -> engine) -----------------------------------------------------------------


def ok_reply() -> dict[str, Any]:
    """``ok`` with no fields (begin, abort)."""
    return {"status": OK}


def layout_reply(layout: LayoutView) -> dict[str, Any]:
    """``ok`` + ``layout`` (attach, query)."""
    return {"status": OK, "layout": layout.to_wire()}


def attach_reply(layout: LayoutView, role: str) -> dict[str, Any]:
    """``ok`` + ``layout`` + ``role`` (the role the daemon recorded for the attach)."""
    return {"status": OK, "layout": layout.to_wire(), ROLE_FIELD: role}


def lease_reply(version: int, digest: str) -> dict[str, Any]:
    """``ok`` to a lease: the version and digest the daemon holds (no move can change them while
    the lease lasts)."""
    return {"status": OK, "version": version, "digest": digest}


def reply_role(raw: Mapping[str, Any]) -> str | None:
    """The role an ok attach reply names; None when it names none (a daemon from before roles)
    or something that is not a role."""
    role = raw.get(ROLE_FIELD)
    return role if isinstance(role, str) and role in ROLES else None


def content_reply(content: ContentView) -> dict[str, Any]:
    """``ok`` + ``content`` (content check)."""
    return {"status": OK, "content": content.to_wire()}


def refusal_reply(status: str, reason: str) -> dict[str, Any]:
    """Any non-``ok`` reply: a status of ``NOT_OK_STATUSES`` and the reason that says what to do."""
    if status not in NOT_OK_STATUSES:
        raise ValueError(f"{status!r} is not a non-ok status of the expert layout protocol")
    return {"status": status, "reason": reason}


@dataclass(frozen=True)
class Committed:
    """The ``ok`` reply to commit and repair: the new version and the digest of the new map."""

    version: int
    digest: str

    def to_wire(self) -> dict[str, Any]:
        return {"status": OK, "version": self.version, "digest": self.digest}

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> Committed:
        """Raise ``ProtocolViolation`` unless ``version`` is an int and ``digest`` a digest."""
        version, digest = raw.get("version"), raw.get("digest")
        if type(version) is not int or not is_digest(digest):
            raise ProtocolViolation(f"no valid version and digest in {dict(raw)!r}")
        return cls(version, str(digest))


class Outcome(enum.Enum):
    """What one request came to, as the engine reads it.

    The daemon's own statuses (``OK``, ``NO_RECORD``, ``BUSY``, ``REFUSED``); ``OLDER_DAEMON``:
    the daemon answered ``error`` with "Unknown request type" (sglang without the plugin: no
    record); ``ERROR``: any other ``error``, or a reply that breaks the protocol; and two the
    engine's socket layer finds without a reply: ``NO_DAEMON`` (no socket file) and
    ``UNREACHABLE`` (the daemon could not be read).
    """

    OK = "ok"
    NO_RECORD = "no_record"
    BUSY = "busy"
    REFUSED = "refused"
    OLDER_DAEMON = "older_daemon"
    ERROR = "error"
    NO_DAEMON = "no_daemon"
    UNREACHABLE = "unreachable"


_STATUS_OUTCOMES = {
    OK: Outcome.OK,
    NO_RECORD: Outcome.NO_RECORD,
    BUSY: Outcome.BUSY,
    REFUSED: Outcome.REFUSED,
}

# What of an ok reply's body the ranks all-gather (``Reply.trimmed``).
_KEPT_BODY_FIELDS = ("version", "digest")


@dataclass(frozen=True)
class Reply:
    """One request's result. ``reason`` is the daemon's reason or the local failure.

    ``body`` is the reply dict as received; ``layout`` and ``content`` its typed ``layout`` and
    ``content`` fields, if any.
    """

    outcome: Outcome
    reason: str | None = None
    body: Mapping[str, Any] = field(default_factory=dict)
    layout: LayoutView | None = None
    content: ContentView | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    def trimmed(self) -> Reply:
        """The outcome and reason, and of an ``ok`` body only ``version`` and ``digest``.

        Small and plain enough to all-gather between ranks.
        """
        body = (
            {key: self.body[key] for key in _KEPT_BODY_FIELDS if key in self.body}
            if self.ok
            else {}
        )
        return Reply(self.outcome, self.reason, body)

    @classmethod
    def from_wire(cls, raw: Any, *, request_type: str, peer: str) -> Reply:
        """Read the daemon's reply to ``request_type``; ``peer`` names the daemon in reasons.

        Never raises: a reply that breaks the protocol is an ``ERROR`` outcome with the reason.
        """
        if not isinstance(raw, Mapping):
            return cls(
                Outcome.ERROR,
                f"the daemon at {peer} answered {request_type} with a "
                f"{type(raw).__name__}, not a dict",
            )
        status = raw.get("status")
        # The older daemon puts its text in "message"; this protocol's replies use "reason".
        text = raw.get("reason") or raw.get("message")
        reason = None if text is None else str(text)
        if status == ERROR and (reason or "").startswith(UNKNOWN_REQUEST_PREFIX):
            return cls(Outcome.OLDER_DAEMON, reason, raw)
        outcome = _STATUS_OUTCOMES.get(status) if isinstance(status, str) else None
        if outcome is None:
            return cls(
                Outcome.ERROR,
                f"the daemon at {peer} answered {request_type} with status {status!r}"
                + (f": {reason}" if reason else ""),
                raw,
            )
        if outcome is not Outcome.OK:
            return cls(outcome, reason, raw)
        return cls._read_ok(raw, reason, request_type=request_type, peer=peer)

    @classmethod
    def _read_ok(
        cls, raw: Mapping[str, Any], reason: str | None, *, request_type: str, peer: str
    ) -> Reply:
        """An ``ok`` reply: attach, query, reload and heal carry a valid layout, commit and
        repair a version and digest, a content check a valid content."""
        layout = None
        if "layout" in raw:
            try:
                layout = LayoutView.from_wire(raw["layout"])
            except ProtocolViolation as exc:
                return cls(
                    Outcome.ERROR,
                    f"the daemon at {peer} sent a malformed layout in reply to "
                    f"{request_type}: {exc}",
                    raw,
                )
        elif request_type in (ATTACH, QUERY, RELOAD, HEAL):
            return cls(
                Outcome.ERROR,
                f"the daemon at {peer} answered {request_type} ok without a layout",
                raw,
            )
        if request_type in (COMMIT, REPAIR, LEASE):
            try:
                Committed.from_wire(raw)
            except ProtocolViolation:
                return cls(
                    Outcome.ERROR,
                    f"the daemon at {peer} acknowledged the {request_type} without a valid "
                    f"version and digest: {dict(raw)!r}",
                    raw,
                )
        if request_type in (CORDON, UNCORDON):
            try:
                CordonView.from_wire(raw.get("cordon"))
            except ProtocolViolation as exc:
                return cls(
                    Outcome.ERROR,
                    f"the daemon at {peer} sent a malformed cordon in reply to "
                    f"{request_type}: {exc}",
                    raw,
                )
        content = None
        if request_type == CONTENT_CHECK:
            try:
                content = ContentView.from_wire(raw.get("content"))
            except ProtocolViolation as exc:
                return cls(
                    Outcome.ERROR,
                    f"the daemon at {peer} sent a malformed content check: {exc}",
                    raw,
                )
        return cls(Outcome.OK, reason, raw, layout, content)
