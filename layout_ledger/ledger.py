"""The ledger file opened for writing by its one daemon process.

``Ledger.open(path)`` takes the writer lock, opens (or creates) the file, upgrades an older
schema and refuses a newer one. ``start_incarnation`` ends whatever incarnation a crashed
predecessor left open, records the new one at version 0, and returns its ``LedgerRecord``:
the record's every change is one SQLite transaction, durable (``synchronous=FULL``) before the
call returns, so a daemon replies ``ok`` only to what a crash cannot take back.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from layout_ledger import events as ev
from layout_ledger import maintenance, reader, schema
from layout_ledger.errors import LedgerError, LedgerFileError, LedgerStorageError
from layout_ledger.layout import Geometry, Map, layout_digest, validate_map
from layout_ledger.maintenance import CheckpointResult, Maintenance
from layout_ledger.migrate import check_ledger_or_empty, upgrade_to_head
from layout_ledger.record import LayoutRecord
from layout_ledger.state import utc_now
from layout_ledger.storage import WriterLock, open_writer_engine

logger = logging.getLogger(__name__)

# Retention the daemon applies by itself (see README "Retention"): every PRUNE_EVERY commits it
# keeps the rows of the last KEEP_VERSIONS versions of each incarnation (always the current map
# and every event). At one all-layer rebalance a minute on a 58-layer model that is ~17 hours of
# full history and a ledger of a few tens of MiB.
DEFAULT_KEEP_VERSIONS = 1000
DEFAULT_PRUNE_EVERY = 100


@dataclass(frozen=True)
class Retention:
    keep_versions: int = DEFAULT_KEEP_VERSIONS
    prune_every: int = DEFAULT_PRUNE_EVERY

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


def _storage_error(action: str, path: Path, exc: DBAPIError) -> LedgerStorageError:
    return LedgerStorageError(f"{action} ledger {path} failed: {exc.orig}")


class Ledger:
    """One ledger file, owned for writing by this process."""

    def __init__(self, path: Path, retention: Retention) -> None:
        self.path = path
        self.retention = retention
        self._lock = threading.RLock()
        check_ledger_or_empty(path)
        self._writer_lock = WriterLock(path)
        try:
            self._engine = open_writer_engine(path)
            self._conn: Connection = self._engine.connect()
            upgrade_to_head(self._conn, path)
            if self._conn.in_transaction():
                self._conn.commit()
        except DBAPIError as exc:
            self._abandon()
            if "not a database" in str(exc.orig):
                raise LedgerFileError(f"{path} is not an SQLite database") from exc
            raise _storage_error("opening", path, exc) from exc
        except BaseException:
            self._abandon()
            raise
        self.record: LedgerRecord | None = None
        self.maintenance: Maintenance | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], retention: Retention | None = None) -> Ledger:
        return cls(Path(path), retention or Retention())

    def _abandon(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.dispose()
        self._writer_lock.release()

    # --- transactions -------------------------------------------------------------------

    @contextmanager
    def transaction(self, action: str) -> Iterator[Connection]:
        """One BEGIN IMMEDIATE ... COMMIT; rolled back (and a LedgerStorageError) on failure."""
        with self._lock:
            try:
                with self._conn.begin():
                    yield self._conn
            except DBAPIError as exc:
                raise _storage_error(action, self.path, exc) from exc

    @contextmanager
    def driver_transaction(self, action: str) -> Iterator[sqlite3.Connection]:
        """The same transaction on the driver connection, for the per-request hot path.

        Every record change runs here; skipping SQLAlchemy's per-statement execution context
        is a third of what the ledger adds to a commit over an in-memory record.
        """
        with self._lock:
            driver = self._driver()
            try:
                driver.execute("BEGIN IMMEDIATE")
                try:
                    yield driver
                except BaseException:
                    driver.execute("ROLLBACK")
                    raise
                driver.execute("COMMIT")
            except sqlite3.Error as exc:
                if driver.in_transaction:
                    driver.execute("ROLLBACK")
                raise LedgerStorageError(f"{action} ledger {self.path} failed: {exc}") from exc

    def _driver(self) -> sqlite3.Connection:
        driver = self._conn.connection.dbapi_connection
        if driver is None:
            raise LedgerError(f"ledger {self.path} is closed")
        return driver  # type: ignore[return-value]

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        with self._lock:
            try:
                with self._conn.begin():
                    yield self._conn
            except DBAPIError as exc:
                raise _storage_error("reading", self.path, exc) from exc

    # --- incarnations -------------------------------------------------------------------

    def start_incarnation(
        self,
        geometry: Geometry,
        initial_map: Map,
        *,
        config_fingerprint: str = "",
        daemon_label: str = "",
    ) -> LedgerRecord:
        """Record a daemon start at version 0 and return its record."""
        if self.record is not None:
            raise LedgerError(
                f"incarnation {self.record.incarnation_id} is still live in this process; "
                f"end it before starting another"
            )
        initial_map = validate_map(initial_map, geometry)
        digest = layout_digest(initial_map)
        at = utc_now()
        with self.transaction("starting an incarnation in") as conn:
            self._end_unended(conn, at)
            inserted = conn.execute(
                schema.incarnations.insert().values(
                    started_at=at,
                    config_fingerprint=config_fingerprint,
                    daemon_label=daemon_label,
                    num_layers=geometry.num_layers,
                    num_physical_slots=geometry.num_physical_slots,
                    num_logical_experts=geometry.num_logical_experts,
                    initial_map=json.dumps(initial_map, separators=(",", ":")),
                    initial_digest=digest,
                )
            )
            incarnation_id = int(inserted.inserted_primary_key[0])  # type: ignore[index]
            all_layers = tuple(range(geometry.num_layers))
            record = LedgerRecord(self, int(incarnation_id), geometry, initial_map)
            _insert_version(
                conn,
                record.incarnation_id,
                ev.Event(
                    at=at,
                    kind=ev.START,
                    layers=all_layers,
                    new_version=0,
                    digest_after=digest,
                    reason=daemon_label or None,
                ),
                {layer: text_ for layer, text_ in enumerate(record.row_jsons())},
            )
        self.record = record
        self._prune_quietly()
        self._start_maintenance()
        logger.info(
            "expert layout ledger %s: incarnation %d started at version 0 (digest %s)",
            self.path,
            record.incarnation_id,
            digest,
        )
        return record

    def _end_unended(self, conn: Connection, at: str) -> None:
        """End incarnations a killed daemon left open; warn when the last one ended badly."""
        previous: tuple[int, str | None] | None = None
        for inc in reader.incarnations(conn):
            end_state = inc.end_state
            if inc.ended_at is None:
                dirty = reader.dirty_mark(conn, inc.incarnation_id)
                pending = reader.pending_move(conn, inc.incarnation_id)
                end_state = "dirty" if dirty is not None else "unknown"
                reason = "the daemon did not shut down cleanly (found unended at the next start)"
                if pending is not None:
                    reason += (
                        f"; a move was pending (engine {pending.engine_id!r}, layers "
                        f"{list(pending.layers)}, from version {pending.base_version})"
                    )
                _end(conn, inc.incarnation_id, at, end_state, reason)
            previous = (inc.incarnation_id, end_state)
        if previous is not None and previous[1] in ("dirty", "unknown"):
            incarnation_id, end_state = previous
            logger.warning(
                "expert layout ledger %s: the previous daemon incarnation %d ended %s; its "
                "history stays in the ledger (layout-ledger history %s --incarnation %d)",
                self.path,
                incarnation_id,
                end_state,
                self.path,
                incarnation_id,
            )

    def _start_maintenance(self) -> None:
        if self.maintenance is not None:
            return
        with self._lock:
            self._driver().execute("PRAGMA wal_autocheckpoint=0")
        self.maintenance = Maintenance(
            self.path, self._prune_live_incarnation, self.retention.prune_every, self._lock
        )

    def _prune_live_incarnation(self) -> None:
        record = self.record
        if record is not None:
            self.prune(self.retention.keep_versions, record.incarnation_id, refuse_pending=False)

    def _prune_quietly(self) -> None:
        try:
            self.prune(self.retention.keep_versions, refuse_pending=False)
        except LedgerError as exc:
            logger.warning("expert layout ledger %s: prune failed: %s", self.path, exc)

    def end_incarnation(self) -> str | None:
        """Record a clean daemon shutdown; the end state is dirty if the layout was unknown."""
        record = self.record
        if record is None:
            return None
        with record.lock:
            state = "dirty" if (record.dirty or record.pending) else "clean"
            reason = "daemon shut down"
            if record.pending is not None:
                reason += f" while a move of engine {record.pending.engine_id!r} was pending"
            with self.transaction("ending the incarnation in") as conn:
                _end(conn, record.incarnation_id, utc_now(), state, reason)
            self.record = None
            return state

    def close(self) -> None:
        """End the live incarnation cleanly (if any), checkpoint, release the file."""
        try:
            if self.maintenance is not None:
                self.maintenance.stop()
                self.maintenance = None
            if self.record is not None:
                self.end_incarnation()
            self.checkpoint(truncate=True)
        finally:
            with self._lock:
                self._conn.close()
                self._engine.dispose()
                self._writer_lock.release()

    # --- retention and WAL ----------------------------------------------------------------

    def prune(
        self,
        keep_versions: int,
        incarnation_id: int | None = None,
        *,
        refuse_pending: bool = True,
    ) -> list[PruneReport]:
        """Keep, per incarnation, the rows of its last ``keep_versions`` versions.

        The current map and every event stay; each kept version's map stays reconstructible
        (each layer keeps the newest row at or before the oldest kept version). An operator's
        prune refuses while a move is pending on the incarnation it prunes; the daemon's own
        retention (``refuse_pending=False``) need not: a pending move writes no rows until it
        commits, and then only above the current version.
        """
        if keep_versions < 1:
            raise LedgerError(
                f"--keep must be at least 1 (the current version), got {keep_versions}"
            )
        reports = []
        with self.transaction("pruning") as conn:
            targets = (
                [reader.incarnation(conn, incarnation_id)]
                if incarnation_id is not None
                else reader.incarnations(conn)
            )
            for inc in targets:
                report = _prune_one(conn, inc, keep_versions, refuse_pending)
                if report is not None:
                    reports.append(report)
        return reports

    def checkpoint(self, *, truncate: bool = False) -> CheckpointResult:
        """Checkpoint on the writer connection, outside any transaction."""
        with self._lock:
            return maintenance.checkpoint(self._driver(), self.path, truncate=truncate)


def _end(conn: Connection, incarnation_id: int, at: str, state: str, reason: str) -> None:
    conn.execute(
        schema.incarnations.update()
        .where(schema.incarnations.c.incarnation_id == incarnation_id)
        .values(ended_at=at, end_state=state)
    )
    _insert_events(
        conn,
        incarnation_id,
        [ev.Event(at=at, kind=ev.END, reason=f"{state}: {reason}")],
    )


# The hot path (every commit) inserts with prepared driver SQL and tuples; the statements name
# the same columns as ``schema``'s tables, which the schema drift test pins.
_INSERT_EVENT = (
    "INSERT INTO events (incarnation_id, at, kind, engine_id, layers, base_version, "
    "new_version, digest_after, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_VERSION = (
    "INSERT INTO versions (incarnation_id, version, digest, committed_at, engine_id, layers) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
_INSERT_ROW = "INSERT INTO layout_rows (incarnation_id, layer, version, slots) VALUES (?, ?, ?, ?)"


Driver = sqlite3.Connection


def _driver_of(conn: Connection | Driver) -> Driver:
    """The sqlite3 connection under a SQLAlchemy one (same transaction), or itself."""
    if isinstance(conn, sqlite3.Connection):
        return conn
    return conn.connection.dbapi_connection  # type: ignore[return-value]


def _insert_events(conn: Connection | Driver, incarnation_id: int, events: list[ev.Event]) -> None:
    _driver_of(conn).executemany(
        _INSERT_EVENT,
        [
            (
                incarnation_id,
                event.at,
                event.kind,
                event.engine_id,
                event.layers_json(),
                event.base_version,
                event.new_version,
                event.digest_after,
                event.reason,
            )
            for event in events
        ],
    )


def _insert_version(
    conn: Connection | Driver, incarnation_id: int, event: ev.Event, rows: Mapping[int, str]
) -> None:
    """A version's versions row, layout rows and event, in the caller's transaction."""
    version = event.new_version
    if version is None or event.digest_after is None or event.layers is None:
        raise LedgerError(f"a {event.kind} event needs new_version, digest_after and layers")
    driver = _driver_of(conn)
    driver.execute(
        _INSERT_VERSION,
        (
            incarnation_id,
            version,
            event.digest_after,
            event.at,
            event.engine_id,
            event.layers_json(),
        ),
    )
    driver.executemany(
        _INSERT_ROW, [(incarnation_id, layer, version, slots) for layer, slots in rows.items()]
    )
    _insert_events(conn, incarnation_id, [event])


def _prune_one(
    conn: Connection, inc: reader.Incarnation, keep_versions: int, refuse_pending: bool
) -> PruneReport | None:
    live = inc.ended_at is None and refuse_pending
    pending = reader.pending_move(conn, inc.incarnation_id) if live else None
    if pending is not None:
        raise LedgerError(
            f"incarnation {inc.incarnation_id} has a move pending (engine {pending.engine_id!r}, "
            f"layers {list(pending.layers)}); prune after it commits or aborts"
        )
    current, _ = reader.current_version(conn, inc.incarnation_id)
    keep_from = max(0, current - keep_versions + 1)
    if keep_from <= reader.reconstructible_from(conn, inc.incarnation_id):
        return None
    # Per layer, the newest row at or before keep_from is the base every kept version builds on.
    removed = conn.execute(
        text(
            "DELETE FROM layout_rows WHERE incarnation_id = :i AND version < ("
            "  SELECT max(r.version) FROM layout_rows r"
            "  WHERE r.incarnation_id = layout_rows.incarnation_id"
            "    AND r.layer = layout_rows.layer AND r.version <= :keep)"
        ),
        {"i": inc.incarnation_id, "keep": keep_from},
    ).rowcount
    _insert_events(
        conn,
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


class LedgerRecord(LayoutRecord):
    """A layout record whose every change is written to the ledger before it takes effect."""

    def __init__(
        self, ledger: Ledger, incarnation_id: int, geometry: Geometry, initial_map: Map
    ) -> None:
        super().__init__(incarnation_id, geometry, initial_map)
        self.ledger = ledger

    def row_jsons(self) -> list[str]:
        return list(self._row_jsons)

    def _persist(self, *events: ev.Event, rows: Mapping[int, str] | None = None) -> None:
        with self.ledger.driver_transaction("writing to") as conn:
            if rows is not None:
                (commit,) = events
                _insert_version(conn, self.incarnation_id, commit, rows)
            else:
                _insert_events(conn, self.incarnation_id, list(events))

    def commit(self, engine_id: Any, rows: Any) -> tuple[int, str]:
        result = super().commit(engine_id, rows)
        if self.ledger.maintenance is not None:
            self.ledger.maintenance.note_commit()
        return result
