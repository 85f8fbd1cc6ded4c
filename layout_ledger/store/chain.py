"""The events' hash chain: each event row carries SHA-256 over the previous row's chain value
and its own fields, so an edit, an insertion or a deletion anywhere in the history changes
every chain value after it.

A chain can be recomputed by whoever edits the file, so the daemon logs the chain head with each
commit (``layout_ledger.store.ledger``): a copy of the daemon's log proves what the file held then,
and ``layout-ledger verify`` recomputes the chain and prints its head to compare with the log.

The definition is part of the file format: it never changes in place (a new definition would be
a new schema revision that recomputes the chain). Revision 0003 computes it for the rows older
ledgers hold, with this module. Revision 0007 extends it for new rows only: the link of a start,
commit or repair event whose version recorded slot fingerprints also covers their digest
(``versions.fingerprints_digest``), so an edited, added or deleted fingerprint row breaks the
chain as an edited event does; a row without a digest (older code, or no fingerprints) links as
before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

# The chain value "before" the first event of a ledger.
GENESIS = "0" * 64

# The ``events`` columns a link covers, in this order (``event_id`` is not among them: a row's
# place is its predecessor's chain value, which every link includes).
FIELDS = (
    "incarnation_id",
    "at",
    "kind",
    "engine_id",
    "layers",
    "base_version",
    "new_version",
    "digest_after",
    "reason",
    "count",
    "last_at",
)


# The event kinds whose row writes a version (and, at a daemon that records content, its slot
# fingerprints): their link covers the version's ``fingerprints_digest`` when it has one.
VERSIONED_KINDS = ("start", "commit", "repair", "reload")


def link(previous: str, row: Sequence[Any], fingerprints_digest: str | None = None) -> str:
    """The chain value of a row whose ``FIELDS`` values are ``row``, after ``previous``.

    ``fingerprints_digest``: the ``versions.fingerprints_digest`` of the version a start, commit
    or repair event wrote (revision 0007); None (no fingerprints, or a row of older code) gives
    the link revision 0003 defined, so older rows verify as before.
    """
    values: list[Any] = [previous, *row]
    if fingerprints_digest is not None:
        values.append({"fingerprints": fingerprints_digest})
    encoded = json.dumps(values, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()


def fingerprints_digest(rows: Sequence[tuple[int, int, str]]) -> str:
    """SHA-256 over one version's slot fingerprint rows ``(layer, first_slot, fingerprints)``,
    the JSON text exactly as stored, in layer order: what ``versions.fingerprints_digest``
    holds and ``verify`` recomputes from the rows."""
    ordered = [[int(layer), int(first), str(text)] for layer, first, text in sorted(rows)]
    encoded = json.dumps(ordered, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(encoded.encode()).hexdigest()


_VERSIONED = ", ".join(f"'{kind}'" for kind in VERSIONED_KINDS)
# The kinds above as an SQL list (``kind IN (...)``).
VERSIONED_SQL = _VERSIONED
# An event's id, its chain fields, its stored chain value and its version's fingerprints digest.
_CHAIN_SELECT = (
    f"SELECT e.event_id, {', '.join('e.' + name for name in FIELDS)}, e.chain, "
    "v.fingerprints_digest FROM events e LEFT JOIN versions v "
    "ON v.incarnation_id = e.incarnation_id AND v.version = e.new_version "
    f"AND e.kind IN ({_VERSIONED}) "
)
_CHAIN_ROWS = _CHAIN_SELECT + "ORDER BY e.event_id"
_ONE_ROW = _CHAIN_SELECT + "WHERE e.event_id = ?"
_STORED_BEFORE = "SELECT chain FROM events WHERE event_id < ? ORDER BY event_id DESC LIMIT 1"


@dataclass(frozen=True)
class ChainWalk:
    """The events' chain recomputed: how many rows, the head reached, the first row whose
    stored value does not follow from the rows before it (None: none)."""

    count: int
    head: str
    broken_at: int | None


def walk(conn: Connection) -> ChainWalk:
    """Recompute every event's chain value from the one before it and its own fields (with its
    version's fingerprints digest for a start, commit or repair); stop at the first break.
    ``verify`` walks the whole chain; a restore checks only the links it rests on
    (``first_broken_link``)."""
    previous = GENESIS
    count = 0
    for event_id, *fields, stored, digest in conn.exec_driver_sql(_CHAIN_ROWS):
        expected = link(previous, fields, digest)
        if stored != expected:
            return ChainWalk(count, previous, int(event_id))
        previous, count = expected, count + 1
    return ChainWalk(count, previous, None)


def first_broken_link(conn: Connection, event_ids: Sequence[int]) -> int | None:
    """The first of ``event_ids`` whose stored chain value does not follow from the value
    stored before it and its own fields (None: every one holds).

    What a walk checks at each of these rows, without walking to them: a row edited, or a row
    inserted or deleted just before it, breaks its link. Two index seeks a row, whatever the
    history's length (``verify`` walks the whole chain)."""
    for event_id in sorted(set(event_ids)):
        row = conn.exec_driver_sql(_ONE_ROW, (event_id,)).first()
        if row is None:
            return event_id
        _, *fields, stored, digest = row
        stored_before = conn.exec_driver_sql(_STORED_BEFORE, (event_id,)).scalar()
        previous = GENESIS if stored_before is None else str(stored_before)
        if stored != link(previous, fields, digest):
            return event_id
    return None
