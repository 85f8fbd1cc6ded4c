"""What a ledger offers a daemon about to load its weights: the newest committed version.

A daemon restoring its layout (``--expert-layout-restore last``) reads, before its weights
load, the newest committed version of its ledger's earlier incarnations: the newest version of
the latest incarnation. ``newest_offer`` offers it only when that incarnation was recorded for
the same geometry, with a checkpoint identity, and its rows verify (a new checkpoint of the same
geometry keeps the placement: the offer names the identity its incarnation loaded, and
``store.baseline`` says what the new load is checked against):

- the events' hash chain holds at the events the version rests on: that incarnation's start
  and the event that wrote the version (its last start, commit, repair or reload), each link
  recomputed from the value stored before it (``chain.first_broken_link``; ``verify`` walks
  the whole chain);
- that event wrote the version its ``versions`` row records last, and names its digest;
- the map rebuilt from the rows at that version gives that digest.

Its cost grows with the layers, never with the history (docs/design.md "Restoring the
layout"): the newest row of each layer, the fingerprints beside them, and a few index seeks.

Otherwise it says why there is nothing to restore (``NoOffer``), or raises
``LedgerInconsistent`` for rows that do not verify. The offer carries the daemon's own slot
fingerprints recorded at that version, which the load is checked against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, text

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import DamagedRow, LedgerError, LedgerInconsistent
from layout_ledger.core.layout import Geometry, Map, digest_of_row_jsons, validate_map
from layout_ledger.store import chain
from layout_ledger.store.rows import (
    Incarnation,
    current_version,
    fingerprints_at,
    incarnation_rows,
    row_jsons_at,
)


@dataclass(frozen=True)
class RestoreOffer:
    """The newest committed version of an earlier incarnation, its rows verified."""

    incarnation: int
    version: int
    digest: str
    physical_to_logical_map: Map
    recorded: LocalFingerprints | None  # the daemon's slot fingerprints at that version
    checkpoint_digest: str | None = None  # the identity of the checkpoint that incarnation loaded


@dataclass(frozen=True)
class NoOffer:
    """Nothing the daemon could restore, and why (no earlier version, another checkpoint...)."""

    reason: str


def newest_offer(
    conn: Connection, geometry: Geometry, checkpoint_digest: str
) -> RestoreOffer | NoOffer:
    """The newest committed version the ledger offers a daemon loading ``checkpoint_digest``
    in ``geometry`` (see the module docstring; the offer is the same whatever checkpoint it
    loads); ``LedgerInconsistent`` when rows do not verify."""
    rows = incarnation_rows(conn)
    if not rows:
        return NoOffer("no earlier version (the ledger holds no incarnation)")
    latest = rows[-1]
    if isinstance(latest, DamagedRow):
        raise LedgerInconsistent(f"its latest incarnation's row cannot be read: {latest}")
    i = latest.incarnation_id
    if latest.checkpoint_digest is None:
        return NoOffer(
            f"incarnation {i} recorded no checkpoint identity (written before restores, or by "
            f"a daemon that knows none)"
        )
    if latest.geometry != geometry:
        return NoOffer(
            f"incarnation {i} has another geometry ({latest.geometry.describe()}; this "
            f"daemon's {geometry.describe()})"
        )
    return _verified_offer(conn, latest)


def _verified_offer(conn: Connection, inc: Incarnation) -> RestoreOffer:
    i = inc.incarnation_id
    try:
        version, digest = current_version(conn, i)
        start, written = _resting_events(conn, i)
        broken = chain.first_broken_link(conn, [start, written.event_id])
        if broken is not None:
            raise LedgerInconsistent(
                f"the events' chain breaks at event #{broken} (a row was edited, inserted or "
                f"deleted)"
            )
        if written.new_version != version:
            raise LedgerInconsistent(
                f"incarnation {i}: its newest versions row is version {version}, but the last "
                f"event that wrote a version (event #{written.event_id}, {written.kind}) wrote "
                f"version {written.new_version}"
            )
        if written.digest_after != digest:
            raise LedgerInconsistent(
                f"incarnation {i} version {version}: its versions row records digest "
                f"{digest[:12]} but the event that wrote it names {str(written.digest_after)[:12]}"
            )
        row_jsons = row_jsons_at(conn, inc, version)
        if digest_of_row_jsons(row_jsons) != digest:
            raise LedgerInconsistent(
                f"incarnation {i} version {version}: its rows do not give the digest "
                f"{digest[:12]} its versions row records"
            )
        the_map = validate_map([_row(text_) for text_ in row_jsons], inc.geometry)
        recorded = fingerprints_at(conn, inc, version)
    except LedgerInconsistent:
        raise
    except LedgerError as exc:
        raise LedgerInconsistent(f"incarnation {i}: {exc}") from exc
    return RestoreOffer(i, version, digest, the_map, recorded, inc.checkpoint_digest)


# The newest event of one kind in an incarnation: one seek in ix_events_incarnation_kind.
_LAST_OF_KIND = text("SELECT max(event_id) FROM events WHERE incarnation_id = :i AND kind = :kind")
_FIRST_START = text("SELECT min(event_id) FROM events WHERE incarnation_id = :i AND kind = 'start'")
_EVENT = text("SELECT event_id, kind, new_version, digest_after FROM events WHERE event_id = :e")


def _resting_events(conn: Connection, i: int) -> tuple[int, Row[Any]]:
    """The incarnation's start event's id and the row of its last event that wrote a version
    (each found by index seeks: ``versions`` are written in order, so the newest is the last
    written); ``LedgerInconsistent`` when either is missing."""
    start = conn.execute(_FIRST_START, {"i": i}).scalar()
    last = [
        conn.execute(_LAST_OF_KIND, {"i": i, "kind": k}).scalar() for k in chain.VERSIONED_KINDS
    ]
    newest = max((int(e) for e in last if e is not None), default=None)
    if start is None or newest is None:
        raise LedgerInconsistent(f"incarnation {i} has no start event; run `layout-ledger verify`")
    return int(start), conn.execute(_EVENT, {"e": newest}).one()


def _row(text_: str) -> object:
    try:
        return json.loads(text_)
    except ValueError as exc:
        raise LedgerInconsistent(f"a layout row is not JSON ({exc})") from exc
