"""The ledger file opened for writing by its one daemon process, and the journal it keeps.

``Ledger.open(path)`` takes the file through ``connections.open_writer`` (the one-writer lock,
WAL), upgrades an older schema and refuses a newer one. ``start_incarnation`` ends whatever
incarnation a killed predecessor left open (replaying its history through the record's rules to
know how it stood), records the new one at version 0, and returns its ``LayoutRecord``, whose
journal is a ``LedgerJournal``: every change is one SQLite transaction, written before the call
returns and, for a version or an end, on disk (``synchronous=FULL``), so a daemon replies ``ok``
only to what a crash cannot take back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from layout_ledger.core import events as ev
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import DamagedRow, LedgerError, LedgerFileError, LedgerStorageError
from layout_ledger.core.layout import Geometry, Map, layout_digest, validate_map
from layout_ledger.core.record import END_FOUND_UNENDED, LayoutRecord
from layout_ledger.core.state import RestoredFrom, utc_now
from layout_ledger.store import chain, maintenance
from layout_ledger.store.baseline import Baseline, newest_baseline
from layout_ledger.store.connections import open_reader_engine, open_writer
from layout_ledger.store.event_writer import EventWriter
from layout_ledger.store.maintenance import CheckpointResult, Maintenance
from layout_ledger.store.migrate import upgrade_to_head
from layout_ledger.store.origin import COLUMNS as ORIGIN_COLUMNS
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.replay import ReplayMismatch, replay_incarnation
from layout_ledger.store.restore_offer import NoOffer, RestoreOffer, newest_offer
from layout_ledger.store.retention import (
    PRUNE_STEP_VERSIONS,
    PruneReport,
    Retention,
    driver_of,
    prune_incarnation,
    unverified_below,
)
from layout_ledger.store.rows import (
    RESTORED_FROM_COLUMNS,
    Incarnation,
    incarnation,
    incarnation_rows,
    incarnations,
    reconstructible_from,
)

logger = logging.getLogger(__name__)


class Ledger:
    """One ledger file, owned for writing by this process."""

    def __init__(self, path: Path, retention: Retention | None) -> None:
        self.path = path
        self.retention = retention
        self._lock = threading.RLock()
        self._writer = open_writer(path)
        try:
            self._conn: Connection = self._writer.connection
            upgrade_to_head(self._conn, path)
            if self._conn.in_transaction():
                self._conn.commit()
        except DBAPIError as exc:
            self._writer.close()
            if "not a database" in str(exc.orig):
                raise LedgerFileError(f"{path} is not an SQLite database") from exc
            raise LedgerStorageError(f"opening ledger {path} failed: {exc.orig}") from exc
        except BaseException:
            self._writer.close()
            raise
        self._events = EventWriter(self._writer.driver())
        self.record: LayoutRecord | None = None
        self.maintenance: Maintenance | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], retention: Retention | None = None) -> Ledger:
        """Open ``path`` for writing; ``retention`` is what the ledger prunes by itself once an
        incarnation starts (None: nothing, it keeps every version until ``prune`` is called)."""
        return cls(Path(path), retention)

    # --- transactions -------------------------------------------------------------------

    @contextmanager
    def transaction(self, action: str) -> Iterator[Connection]:
        """One BEGIN IMMEDIATE ... COMMIT on the SQLAlchemy connection (start, prune, reads)."""
        with self._lock:
            try:
                with self._conn.begin():
                    yield self._conn
            except BaseException as exc:
                self._events.reload(self._writer.driver())
                if isinstance(exc, DBAPIError):
                    raise LedgerStorageError(
                        f"{action} ledger {self.path} failed: {exc.orig}"
                    ) from exc
                raise

    @contextmanager
    def _journal_transaction(self, *, synced: bool = True) -> Iterator[sqlite3.Connection]:
        """A journal append's transaction, on the driver connection (joins ``transaction``).

        Every record change runs here, on the driver: SQLAlchemy's per-statement execution
        context would be a large share of what the ledger adds to a commit. A failure rolls the
        whole transaction back and becomes a ``LedgerStorageError``. ``synced=False`` leaves out
        the WAL's fsync for this transaction (``synchronous=NORMAL``): it is written before the
        call returns, so no daemon crash can lose it, and the next synced one (or checkpoint)
        puts it on disk with itself.
        """
        with self._lock:
            driver = self._writer.driver()
            joined = self._conn.in_transaction()  # an incarnation's start: one transaction
            try:
                if not joined and not synced:
                    driver.execute("PRAGMA synchronous=NORMAL")
                if not joined:
                    driver.execute("BEGIN IMMEDIATE")
                try:
                    yield driver
                    if not joined:
                        driver.execute("COMMIT")
                except BaseException:
                    # SQLite has already rolled back after some errors (SQLITE_FULL, I/O): a
                    # second ROLLBACK would raise and hide the cause.
                    if not joined and driver.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            driver.execute("ROLLBACK")
                    if not joined:
                        self._events.reload(driver)
                    raise
            except sqlite3.Error as exc:
                raise LedgerStorageError(f"writing to ledger {self.path} failed: {exc}") from exc
            finally:
                if not joined and not synced:
                    with contextlib.suppress(sqlite3.Error):
                        driver.execute("PRAGMA synchronous=FULL")

    def journal(self, incarnation_id: int) -> LedgerJournal:
        """The journal of one incarnation's record on this ledger."""
        return LedgerJournal(self, incarnation_id)

    # --- incarnations -------------------------------------------------------------------

    def restore_offer(self, geometry: Geometry, checkpoint_digest: str) -> RestoreOffer | NoOffer:
        """The newest committed version this ledger offers a daemon about to load
        ``checkpoint_digest`` in ``geometry`` (``restore_offer.newest_offer``), read before any
        incarnation starts; ``LedgerInconsistent`` when its rows do not verify."""
        if self.record is not None:
            raise LedgerError(
                f"incarnation {self.record.incarnation_id} is live in this process; a restore "
                f"offer is read before an incarnation starts"
            )
        with self.transaction("reading the restore offer of") as conn:
            return newest_offer(conn, geometry, checkpoint_digest)

    def restore_baseline(self, geometry: Geometry, identities: Collection[str]) -> Baseline | None:
        """What a restored load of the checkpoint known by ``identities`` is checked against:
        the fingerprints of this ledger's newest clean load of it (``baseline.newest_baseline``),
        read before any incarnation starts."""
        with self.transaction("reading the restore baseline of") as conn:
            return newest_baseline(conn, identities, geometry)

    def start_incarnation(
        self,
        geometry: Geometry,
        initial_map: Map,
        *,
        config_fingerprint: str = "",
        daemon_label: str = "",
        origin: IncarnationOrigin | None = None,
        content: LocalFingerprints | None = None,
        checkpoint_digest: str | None = None,
        restored_from: RestoredFrom | None = None,
        heal: str | None = None,
        after_start: Callable[[LayoutRecord], None] | None = None,
    ) -> LayoutRecord:
        """Record a daemon start (with its slots' ``content``, if it records it) and return its
        record; ``origin`` says where the daemon runs (nothing recorded when None),
        ``checkpoint_digest`` what identifies the weights it loaded. It starts at version 0 with
        ``initial_map``, or, ``restored_from`` a committed version, at that version's number
        and digest, ``initial_map`` being that version's map (``restore_offer``). ``heal``:
        whether it can heal itself (``auto``, ``off``, ``unavailable: REASON``; None: unknown).
        ``after_start``: the load's verdict (a ``checkpoint_changed``, a ``content_dirty``),
        appended in the start's own transaction, so no kill separates a start from it
        (``baseline.load_was_dirty`` reads it)."""
        if self.record is not None:
            raise LedgerError(
                f"incarnation {self.record.incarnation_id} is still live in this process; "
                f"end it before starting another"
            )
        initial_map = validate_map(initial_map, geometry)
        at = utc_now()
        with self.transaction("starting an incarnation in") as conn:
            self._end_unended(conn, at)
            incarnation_id = _insert_incarnation(
                driver_of(conn),
                at,
                geometry,
                initial_map=initial_map,
                config_fingerprint=config_fingerprint,
                daemon_label=daemon_label,
                origin=origin or IncarnationOrigin(),
                checkpoint_digest=checkpoint_digest,
                restored_from=restored_from,
                heal=None if heal is None else heal[:1024],
            )
            record = LayoutRecord(
                self.journal(incarnation_id),
                incarnation_id,
                geometry,
                initial_map,
                content=content,
                restored_from=restored_from,
            )
            record.start(daemon_label, at)
            if after_start is not None:
                after_start(record)
        self.record = record
        self._prune_quietly()
        self._start_maintenance()
        logger.info(
            "expert layout ledger %s: incarnation %d started at version %d (digest %s)%s",
            self.path,
            record.incarnation_id,
            record.version,
            record.digest,
            "" if restored_from is None else f", {restored_from.describe()}",
        )
        return record

    def _end_unended(self, conn: Connection, at: str) -> None:
        """End incarnations a killed daemon left open; warn when the last one ended badly."""
        ends: dict[int, str | None] = {
            int(incarnation_id): end_state
            for incarnation_id, end_state in conn.exec_driver_sql(
                "SELECT incarnation_id, end_state FROM incarnations"
            )
        }
        unended = {
            incarnation_id
            for (incarnation_id,) in conn.exec_driver_sql(
                "SELECT incarnation_id FROM incarnations WHERE ended_at IS NULL"
            )
        }
        last_state, incarnation_id = None, 0
        for inc in incarnation_rows(conn):
            incarnation_id = inc.row_id if isinstance(inc, DamagedRow) else inc.incarnation_id
            last_state = ends[incarnation_id]
            if incarnation_id not in unended:
                continue
            if isinstance(inc, DamagedRow):
                last_state = self._end_unreadable(incarnation_id, str(inc), at)
            else:
                last_state = self._end_found_unended(conn, inc, at)
        if last_state in ("dirty", "unknown"):
            logger.warning(
                "expert layout ledger %s: the previous daemon incarnation %d ended %s; its "
                "history stays in the ledger (layout-ledger history %s --incarnation %d)",
                self.path,
                incarnation_id,
                last_state,
                self.path,
                incarnation_id,
            )

    def _end_found_unended(self, conn: Connection, inc: Incarnation, at: str) -> str:
        """End one incarnation a killed daemon left open, as its replayed history stands."""
        try:
            record = replay_incarnation(conn, inc, then=self.journal(inc.incarnation_id))
        except ReplayMismatch as exc:
            return self._end_unreadable(inc.incarnation_id, str(exc), at)
        return record.end_found_unended(at)

    def _end_unreadable(self, incarnation_id: int, problem: str, at: str) -> str:
        """End an incarnation whose rows cannot be interpreted as ``unknown``, naming why."""
        reason = ev.clip(f"unknown: {END_FOUND_UNENDED}; its rows cannot be interpreted: {problem}")
        self.journal(incarnation_id).append([ev.Event(at=at, kind=ev.END, reason=reason)])
        logger.error(
            "expert layout ledger %s: incarnation %d ended unknown, its rows cannot be "
            "interpreted (%s); run `layout-ledger verify %s`",
            self.path,
            incarnation_id,
            problem,
            self.path,
        )
        return "unknown"

    def _start_maintenance(self) -> None:
        if self.maintenance is not None:
            return
        with self._lock:
            self._writer.driver().execute("PRAGMA wal_autocheckpoint=0")
        prune_every = None if self.retention is None else self.retention.prune_every
        self.maintenance = Maintenance(
            self.path, self._prune_live_incarnation, prune_every, self._lock
        )

    def _prune_live_incarnation(self) -> None:
        """The daemon's retention (maintenance thread): check what it drops, then prune."""
        record, retention = self.record, self.retention
        if record is None or retention is None:
            return
        keep_from = record.version - retention.keep_versions + 1
        if keep_from <= 0:
            return
        # Read on a read-only connection of its own, outside the writer's lock: requests go on
        # meanwhile.
        reader = open_reader_engine(self.path)
        try:
            with self._snapshot(reader) as conn:
                floor = reconstructible_from(conn, record.incarnation_id)
            # In steps of PRUNE_STEP_VERSIONS, each its own transaction (and prune event): a step
            # holds the writer's lock briefly, whatever --expert-layout-prune-every.
            up_to = floor
            while up_to < keep_from and not (self.maintenance and self.maintenance.stopping):
                up_to = min(up_to + PRUNE_STEP_VERSIONS, keep_from)
                if not self._prune_step(reader, retention, record.incarnation_id, up_to):
                    return
        finally:
            reader.dispose()

    @contextmanager
    def _snapshot(self, reader: Engine) -> Iterator[Connection]:
        """One read transaction (one SQLite snapshot) on the retention's read-only engine."""
        try:
            with reader.connect() as conn, conn.begin():
                yield conn
        except DBAPIError as exc:
            raise LedgerStorageError(f"reading ledger {self.path} failed: {exc.orig}") from exc

    def _prune_step(
        self, reader: Engine, retention: Retention, incarnation_id: int, up_to: int
    ) -> bool:
        """Check the versions below ``up_to``, then prune them; False (logged) if they are wrong."""
        with self._snapshot(reader) as conn:
            problem = unverified_below(conn, incarnation_id, up_to)
        if problem is not None:
            logger.error(
                "expert layout ledger %s: retention skipped, the rows it would delete are not "
                "what the ledger recorded (%s); run `layout-ledger verify %s`",
                self.path,
                problem,
                self.path,
            )
            return False
        self.prune(retention.keep_versions, incarnation_id, refuse_pending=False, up_to=up_to)
        return True

    def _prune_quietly(self) -> None:
        if self.retention is None:
            return
        try:
            self.prune(self.retention.keep_versions, refuse_pending=False)
        except LedgerError as exc:
            logger.warning("expert layout ledger %s: prune failed: %s", self.path, exc)

    def end_incarnation(self) -> str | None:
        """Record a clean daemon shutdown; the end state is dirty if the layout was unknown."""
        record = self.record
        if record is None:
            return None
        end_state = record.shut_down()
        self.record = None
        return end_state

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
                self._writer.close()

    # --- retention and WAL ----------------------------------------------------------------

    def prune(
        self,
        keep_versions: int,
        incarnation_id: int | None = None,
        *,
        refuse_pending: bool = True,
        up_to: int | None = None,
    ) -> list[PruneReport]:
        """Keep, per incarnation, the rows of its last ``keep_versions`` versions.

        The current map and every event stay; each kept version's map stays reconstructible
        (each layer keeps the newest row at or before the oldest kept version). An operator's
        prune refuses while a move is pending on the incarnation it prunes; the daemon's own
        retention (``refuse_pending=False``) need not: a pending move writes no rows until it
        commits, and then only above the current version. ``up_to`` prunes no further than
        that version (the daemon's retention goes in steps).
        """
        if keep_versions < 1:
            raise LedgerError(
                f"--keep must be at least 1 (the current version), got {keep_versions}"
            )
        reports = []
        with self.transaction("pruning") as conn:
            targets = (
                [incarnation(conn, incarnation_id)]
                if incarnation_id is not None
                else incarnations(conn)
            )
            for inc in targets:
                report = prune_incarnation(
                    conn, self._events, inc, keep_versions, refuse_pending, up_to=up_to
                )
                if report is not None:
                    reports.append(report)
        return reports

    def vacuum(self) -> None:
        """Rebuild the file without its free pages (``VACUUM``), then empty the WAL, so a prune's
        space goes back to the filesystem. Only ``layout-ledger prune`` calls it, while it owns
        the ledger (no daemon runs): it rewrites the whole file, never on a daemon's path."""
        with self._lock:
            driver = self._writer.driver()
            driver.execute("VACUUM")
            maintenance.checkpoint(driver, self.path, "TRUNCATE")

    def checkpoint(self, *, truncate: bool = False) -> CheckpointResult:
        """Checkpoint on the writer connection, outside any transaction."""
        with self._lock:
            mode = "TRUNCATE" if truncate else "PASSIVE"
            return maintenance.checkpoint(self._writer.driver(), self.path, mode)


class LedgerJournal:
    """A record's journal on its ledger: each append is one SQLite transaction (``append``)."""

    def __init__(self, ledger: Ledger, incarnation_id: int) -> None:
        self.ledger = ledger
        self.incarnation_id = incarnation_id

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: LocalFingerprints | None = None,
    ) -> None:
        """Events (with a new version's rows and fingerprints) and an end's incarnation update.

        Versions (a start's, commit's or repair's rows) and an incarnation's end are fsynced
        before this returns: a reply of ``ok`` to a commit means it is on disk. Every other event
        is written (no crash of the daemon can lose it) and reaches the disk with the next
        version or checkpoint: only a machine crash, which also loses the weights in GPU memory
        and so ends the incarnation, could take the newest of them.
        """
        ledger = self.ledger
        synced = rows is not None or any(event.kind == ev.END for event in events)
        with ledger._journal_transaction(synced=synced) as driver:
            digest = None
            if rows is not None:
                versioned = events[0]  # a restored start's restore event follows it
                prints = [] if fingerprints is None else _fingerprint_rows(fingerprints)
                digest = chain.fingerprints_digest(prints) if prints else None
                _insert_version(driver, self.incarnation_id, versioned, rows, digest)
                _insert_fingerprints(driver, self.incarnation_id, versioned, prints)
            ledger._events.write(driver, self.incarnation_id, events, digest)
            for event in events:
                if event.kind == ev.END:
                    _mark_ended(driver, self.incarnation_id, event)
        committed = events[-1].kind == ev.COMMIT
        if committed and ledger._events.head is not None:
            # A copy of this log proves what the file held (layout_ledger.store.chain).
            logger.info(
                "expert layout ledger %s: version %s committed; event chain head %s (event #%d)",
                ledger.path,
                events[-1].new_version,
                ledger._events.head.value,
                ledger._events.head.event_id,
            )
        if ledger.maintenance is not None:
            ledger.maintenance.note_append(commit=committed)


# The hot path (every commit) inserts with prepared driver SQL and tuples; the statements name
# the same columns as ``schema``'s tables, which the schema drift test pins.
_INSERT_VERSION = (
    "INSERT INTO versions (incarnation_id, version, digest, committed_at, engine_id, layers, "
    "fingerprints_digest) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_ROW = "INSERT INTO layout_rows (incarnation_id, layer, version, slots) VALUES (?, ?, ?, ?)"
_INCARNATION_EXTRA = (*ORIGIN_COLUMNS, "checkpoint_digest", *RESTORED_FROM_COLUMNS, "heal")
_INSERT_INCARNATION = (
    "INSERT INTO incarnations (started_at, config_fingerprint, daemon_label, num_layers, "
    "num_physical_slots, num_logical_experts, initial_map, initial_digest, "
    f"{', '.join(_INCARNATION_EXTRA)}) VALUES ({', '.join('?' * (8 + len(_INCARNATION_EXTRA)))})"
)


def _insert_incarnation(
    driver: sqlite3.Connection,
    at: str,
    geometry: Geometry,
    *,
    initial_map: Map,
    config_fingerprint: str,
    daemon_label: str,
    origin: IncarnationOrigin,
    checkpoint_digest: str | None,
    restored_from: RestoredFrom | None,
    heal: str | None,
) -> int:
    restored = (None,) * 4 if restored_from is None else dataclasses.astuple(restored_from)
    cursor = driver.execute(
        _INSERT_INCARNATION,
        (
            at,
            config_fingerprint,
            daemon_label,
            geometry.num_layers,
            geometry.num_physical_slots,
            geometry.num_logical_experts,
            json.dumps(initial_map, separators=(",", ":")),
            layout_digest(initial_map),
            *origin.to_row(),
            checkpoint_digest,
            *restored,
            heal,
        ),
    )
    if cursor.lastrowid is None:
        raise LedgerStorageError("the new incarnation got no id")
    return int(cursor.lastrowid)


def _insert_version(
    driver: sqlite3.Connection,
    incarnation_id: int,
    event: ev.Event,
    rows: Mapping[int, str],
    fingerprints_digest: str | None,
) -> None:
    """A version's versions row and layout rows, in the caller's transaction."""
    version = event.new_version
    if version is None or event.digest_after is None or event.layers is None:
        raise LedgerError(f"a {event.kind} event needs new_version, digest_after and layers")
    driver.execute(
        _INSERT_VERSION,
        (
            incarnation_id,
            version,
            event.digest_after,
            event.at,
            event.engine_id,
            event.layers_json(),
            fingerprints_digest,
        ),
    )
    driver.executemany(
        _INSERT_ROW, [(incarnation_id, layer, version, slots) for layer, slots in rows.items()]
    )


_INSERT_FINGERPRINTS = (
    "INSERT INTO slot_fingerprints (incarnation_id, layer, version, first_slot, fingerprints) "
    "VALUES (?, ?, ?, ?, ?)"
)


def _fingerprint_rows(local: LocalFingerprints) -> list[tuple[int, int, str]]:
    """``(layer, first_slot, fingerprints JSON)`` of each layer, as ``slot_fingerprints`` holds
    them (and ``chain.fingerprints_digest`` covers them)."""
    return [(layer, local.first_slot, local.row_json(layer)) for layer in sorted(local.layers)]


def _insert_fingerprints(
    driver: sqlite3.Connection,
    incarnation_id: int,
    event: ev.Event,
    rows: Sequence[tuple[int, int, str]],
) -> None:
    """A new version's slot fingerprints (the layers it wrote), in the caller's transaction."""
    driver.executemany(
        _INSERT_FINGERPRINTS,
        [(incarnation_id, layer, event.new_version, first, text) for layer, first, text in rows],
    )


def _mark_ended(driver: sqlite3.Connection, incarnation_id: int, end: ev.Event) -> None:
    """An end event's reason starts with the end state (``record.LayoutRecord._end``)."""
    end_state = (end.reason or "").partition(":")[0]
    driver.execute(
        "UPDATE incarnations SET ended_at = ?, end_state = ? WHERE incarnation_id = ?",
        (end.at, end_state, incarnation_id),
    )
