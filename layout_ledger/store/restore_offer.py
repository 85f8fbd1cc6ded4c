"""What a ledger offers a daemon about to load its weights: the newest committed version.

A daemon restoring its layout (``--expert-layout-restore last``) reads, before its weights
load, the newest committed version of its ledger's earlier incarnations: the newest version of
the latest incarnation. ``newest_offer`` offers it only when that incarnation was recorded for
the same geometry, with a checkpoint identity, and its rows verify (a new checkpoint of the same
geometry keeps the placement: the offer names the identity its incarnation loaded, and
``store.baseline`` says what the new load is checked against):

- the events' hash chain, recomputed over that incarnation's events (``chain.walk`` from its
  first event, on the value stored before it: ``verify`` walks the whole chain), does not
  break;
- the event that wrote the version (its start, commit or repair) names the digest its
  ``versions`` row records;
- the map rebuilt from the rows at that version gives that digest.

Otherwise it says why there is nothing to restore (``NoOffer``), or raises
``LedgerInconsistent`` for rows that do not verify. The offer carries the daemon's own slot
fingerprints recorded at that version, which the load is checked against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import Connection, text

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
        first_event = conn.execute(
            text("SELECT min(event_id) FROM events WHERE incarnation_id = :i"), {"i": i}
        ).scalar()
        walked = chain.walk(conn, int(first_event or 0))
        if walked.broken_at is not None:
            raise LedgerInconsistent(
                f"the events' chain breaks at event #{walked.broken_at} (a row was edited, "
                f"inserted or deleted)"
            )
        written = conn.execute(
            text(
                "SELECT digest_after FROM events WHERE incarnation_id = :i AND new_version = :v "
                f"AND kind IN ({chain.VERSIONED_SQL}) ORDER BY event_id DESC LIMIT 1"
            ),
            {"i": i, "v": version},
        ).scalar()
        if written != digest:
            raise LedgerInconsistent(
                f"incarnation {i} version {version}: its versions row records digest "
                f"{digest[:12]} but the event that wrote it names {str(written)[:12]}"
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


def _row(text_: str) -> object:
    try:
        return json.loads(text_)
    except ValueError as exc:
        raise LedgerInconsistent(f"a layout row is not JSON ({exc})") from exc
