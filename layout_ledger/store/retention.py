"""Retention: how much row history a ledger keeps, and pruning it without losing evidence.

Per incarnation the rows of the last ``keep_versions`` versions stay: for each layer, the newest
row at or before the oldest kept version, so every kept version's map can still be rebuilt; the
rows below it go, with the slot fingerprints written beside them. Events and ``versions`` rows
are never pruned, so a replay and ``verify`` still cover the whole history. A ``prune`` event
records the new floor. Before the daemon drops rows it rebuilds the versions they belong to and
checks their digests (``unverified_below``); ``layout-ledger prune`` runs all of ``verify``.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from sqlalchemy import Connection

from layout_ledger.core import events as ev
from layout_ledger.core.errors import LedgerError
from layout_ledger.core.state import utc_now
from layout_ledger.store.event_writer import EventWriter
from layout_ledger.store.replay import replayed
from layout_ledger.store.rows import Incarnation, current_version, incarnation, reconstructible_from
from layout_ledger.store.version_walk import WalkInconsistency, check_version_digests

# The daemon's retention prunes at most this many versions per transaction, so that each step
# holds the writer's lock briefly whatever --expert-layout-prune-every says.
PRUNE_STEP_VERSIONS = 20


@dataclass(frozen=True)
class Retention:
    """The automatic retention of a writer: every ``prune_every`` commits, keep the rows of the
    last ``keep_versions`` versions of each incarnation (always the current map and every event).

    No defaults here: the daemon passes the retention its settings say; a ledger opened without
    one prunes only when asked (``Ledger.prune``, ``layout-ledger prune``).
    """

    keep_versions: int
    prune_every: int

    def __post_init__(self) -> None:
        if self.keep_versions < 1 or self.prune_every < 1:
            raise LedgerError(
                f"retention needs keep_versions >= 1 and prune_every >= 1, got "
                f"{self.keep_versions} and {self.prune_every}"
            )


@dataclass(frozen=True)
class PruneReport:
    incarnation_id: int
    keep_from_version: int
    rows_removed: int


def unverified_below(conn: Connection, incarnation_id: int, version: int) -> str | None:
    """Why the versions below ``version`` are not what the ledger recorded (None: their rows give
    their digests). What a prune is about to delete must be right first."""
    inc = incarnation(conn, incarnation_id)
    if version <= reconstructible_from(conn, incarnation_id):
        return None  # nothing held below it
    try:
        check_version_digests(conn, inc, before=version)
    except WalkInconsistency as exc:
        return f"incarnation {incarnation_id} digests: {exc}"
    return None


def prune_incarnation(
    conn: Connection,
    events: EventWriter,
    inc: Incarnation,
    keep_versions: int,
    refuse_pending: bool,
    *,
    up_to: int | None = None,
) -> PruneReport | None:
    live = inc.ended_at is None and refuse_pending
    pending = replayed(conn, inc).pending if live else None
    if pending is not None:
        raise LedgerError(
            f"incarnation {inc.incarnation_id} has a move pending (engine {pending.engine_id!r}, "
            f"layers {list(pending.layers)}); prune after it commits or aborts"
        )
    current, _ = current_version(conn, inc.incarnation_id)
    keep_from = max(0, current - keep_versions + 1)
    if up_to is not None:
        keep_from = min(keep_from, up_to)
    if keep_from <= reconstructible_from(conn, inc.incarnation_id):
        return None
    # Per layer, the newest row at or before keep_from is the base every kept version builds on;
    # the slot fingerprints, written beside the rows, are kept the same way.
    # One index seek and one index range per layer (uq_*_layer_version) on the driver: the work
    # is the rows deleted, not the history (a correlated DELETE over every row of the
    # incarnation grows with the history, and SQLAlchemy's execution context per statement
    # would add to the time the writer's lock is held).
    driver = driver_of(conn)
    removed = 0
    for table in ("layout_rows", "slot_fingerprints"):
        newest_kept = (
            f"SELECT max(version) FROM {table} "
            "WHERE incarnation_id = ? AND layer = ? AND version <= ?"
        )
        older = f"DELETE FROM {table} WHERE incarnation_id = ? AND layer = ? AND version < ?"
        for layer in range(inc.geometry.num_layers):
            key = (inc.incarnation_id, layer)
            (base,) = driver.execute(newest_kept, (*key, keep_from)).fetchone()
            if base is None:
                continue
            deleted = driver.execute(older, (*key, base)).rowcount
            if table == "layout_rows":
                removed += deleted
    events.write(
        driver,
        inc.incarnation_id,
        [
            ev.Event(
                at=utc_now(),
                kind=ev.PRUNE,
                base_version=keep_from,
                new_version=current,
                reason=f"removed {removed} layout rows older than version {keep_from}",
            )
        ],
    )
    return PruneReport(inc.incarnation_id, keep_from, int(removed))


def prunable_rows(conn: Connection, inc: Incarnation, keep_versions: int) -> tuple[int, int] | None:
    """What ``prune_incarnation`` would remove, read only (``layout-ledger prune --dry-run``):
    (the oldest version it would keep whole, the layout rows it would delete), None when it
    would remove nothing. It raises as a prune would, while a move is pending."""
    if inc.ended_at is None:
        pending = replayed(conn, inc).pending
        if pending is not None:
            raise LedgerError(
                f"incarnation {inc.incarnation_id} has a move pending (engine "
                f"{pending.engine_id!r}, layers {list(pending.layers)}); prune after it commits "
                f"or aborts"
            )
    current, _ = current_version(conn, inc.incarnation_id)
    keep_from = max(0, current - keep_versions + 1)
    if keep_from <= reconstructible_from(conn, inc.incarnation_id):
        return None
    driver = driver_of(conn)
    rows = 0
    for layer in range(inc.geometry.num_layers):
        key = (inc.incarnation_id, layer)
        (base,) = driver.execute(
            "SELECT max(version) FROM layout_rows "
            "WHERE incarnation_id = ? AND layer = ? AND version <= ?",
            (*key, keep_from),
        ).fetchone()
        if base is not None:
            (count,) = driver.execute(
                "SELECT count(*) FROM layout_rows "
                "WHERE incarnation_id = ? AND layer = ? AND version < ?",
                (*key, base),
            ).fetchone()
            rows += int(count)
    return keep_from, rows


def driver_of(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLAlchemy one (same transaction)."""
    return conn.connection.dbapi_connection  # type: ignore[return-value]
