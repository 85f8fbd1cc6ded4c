"""An incarnation's state, derived by replaying its stored events through the record's own rules.

``replay_incarnation`` builds a ``LayoutRecord`` from the incarnation's initial map whose journal
is ``StoredEvents``, turns each stored event back into the request that produced it and runs
that transition; the journal compares what the record appends with the next stored row, and a
history the rules would not have written stops with a ``ReplayMismatch`` naming the first event
that differs. One loop (like etcd's ``ReadAll``) thus answers "what state is this incarnation
in?" (the reader, the daemon's next start) and "did the rules write this history?" (``verify``).
A commit is replayed by its layers and recorded digest, so pruned rows never stop a replay.
``IncarnationReplay`` keeps a replay going: each ``advance`` replays only the events appended
since the last one (an exporter's scrape costs the new events, not the whole history).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from layout_ledger.core import errors, rules
from layout_ledger.core import events as ev
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.layout import Map
from layout_ledger.core.record import END_FOUND_UNENDED, Journal, LayoutRecord
from layout_ledger.core.state import ROLE_STANDBY, LayoutState, utc_now
from layout_ledger.store.rows import Incarnation, current_version, incarnation, map_at


class ReplayMismatch(Exception):
    """A stored history the rules would not have written (the message names the first event)."""


@dataclass(frozen=True)
class StoredEvent:
    event_id: int
    event: ev.Event

    @property
    def where(self) -> str:
        engine = self.event.engine_id
        return f"event #{self.event_id} ({self.event.kind}" + (
            f" by {engine!r})" if engine else ")"
        )


class StoredEvents:
    """A replay's journal: each appended event must be the next stored one.

    ``exact`` compares every field (``verify``, a daemon's next start); otherwise only what
    decides the state (kind, engine, layers, base version), so that a reader can still show
    the state of a ledger whose texts, times or digests were edited (``verify`` names those).
    Once every stored event is consumed, appends go to ``then`` (a writer journal, so that a
    daemon can end an incarnation its killed predecessor left open) or fail.
    """

    def __init__(
        self, stored: Sequence[StoredEvent], then: Journal | None = None, *, exact: bool = True
    ) -> None:
        self._stored = stored
        self._next = 0
        self._then = then
        self._same = _same_event if exact else _same_transition
        self.record: LayoutRecord | None = None  # set by replay_incarnation, for messages

    def peek(self) -> StoredEvent | None:
        return self._stored[self._next] if self._next < len(self._stored) else None

    def skip(self) -> None:
        self._next += 1

    def extend(self, more: Sequence[StoredEvent]) -> None:
        """Stored events appended since (the consumed ones are let go)."""
        self._stored = [*self._stored[self._next :], *more]
        self._next = 0

    @property
    def count(self) -> int:
        return len(self._stored)

    def clock(self) -> str:
        """The time of the event the record is about to append (now, past the history)."""
        upcoming = self.peek()
        return utc_now() if upcoming is None else upcoming.event.at

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: LocalFingerprints | None = None,
    ) -> None:
        if self.peek() is None and self._then is not None:
            self._then.append(events, rows, fingerprints)
            return
        same = self._same
        for event in events:
            stored = self.peek()
            if stored is not None and same(stored.event, event):
                self._next += 1  # the common case first: what the history holds
                continue
            if ev.is_refusal(event.kind) and (stored is None or stored.event.kind != event.kind):
                return  # the rules refuse what the history accepted: the record raises why
            if stored is None:
                raise ReplayMismatch(_missing(event))
            if not self._same(stored.event, event):
                raise ReplayMismatch(_differs(stored, event, self.record))
            self._next += 1


def replay_incarnation(
    conn: Connection, inc: Incarnation, *, then: Journal | None = None, exact: bool = True
) -> LayoutRecord:
    """The record of ``inc`` after its whole stored history (see the module docstring)."""
    replay = IncarnationReplay(conn, inc, then=then, exact=exact)
    replay.advance(conn)
    if not replay.started:
        raise ReplayMismatch("the incarnation has no start event")
    return replay.record


class IncarnationReplay:
    """The record of ``inc`` replayed so far; ``advance`` replays the events stored since.

    A ``ReplayMismatch`` leaves the record where the history stopped making sense: start a new
    replay then (or report the ledger damaged).
    """

    def __init__(
        self, conn: Connection, inc: Incarnation, *, then: Journal | None = None, exact: bool = True
    ) -> None:
        self.incarnation_id = inc.incarnation_id
        self.journal = StoredEvents([], then, exact=exact)
        try:
            self.record = LayoutRecord(
                self.journal,
                inc.incarnation_id,
                inc.geometry,
                _initial_map(conn, inc),
                clock=self.journal.clock,
                engine_ids=rules.check_engine_id,  # stored ids as they are: their text is verify's
                restored_from=inc.restored_from,
            )
        except errors.LedgerError as exc:  # the initial map does not give the restored digest
            raise ReplayMismatch(f"incarnations row {inc.incarnation_id}: {exc}") from exc
        self.journal.record = self.record
        self.started = False
        self.last_event_id = 0  # the newest event replayed (0: none yet)
        self._previous: str | None = None  # the kind of the last event replayed
        self._versions: dict[int, tuple[str, list[int]]] = {}

    def advance(self, conn: Connection) -> list[StoredEvent]:
        """Replay the incarnation's events stored after ``last_event_id``; returns them."""
        with _collector_paused():
            return self._advance(conn)

    def _advance(self, conn: Connection) -> list[StoredEvent]:
        new = _stored_events(conn, self.incarnation_id, after=self.last_event_id)
        if not new:
            return new
        newest_version = max(self._versions, default=-1)
        self._versions.update(_versions(conn, self.incarnation_id, after=newest_version))
        self.journal.extend(new)
        while (stored := self.journal.peek()) is not None:
            kind = stored.event.kind
            if kind == ev.PRUNE:
                self.journal.skip()  # bookkeeping of which rows are held, not a transition
                continue
            _check_order(stored, self.started, self.record)
            if kind == ev.CHECKPOINT_CHANGED and (
                self._previous != ev.START or self.record.restored_from is None
            ):
                raise ReplayMismatch(
                    f"{stored.where} does not follow the start of a restored incarnation"
                )
            self.started = True
            self._previous = kind
            _replay_one(self.record, stored, self._versions)
        self.last_event_id = new[-1].event_id
        return new


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a replay allocates its events (none of
    them in a cycle): its passes over every object of a long history cost a sixth of a
    10,000-version replay (scripts/bench_cli.py). Reference counting still frees them."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _check_order(stored: StoredEvent, started: bool, record: LayoutRecord) -> None:
    kind = stored.event.kind
    if not started and kind != ev.START:
        raise ReplayMismatch(f"{stored.where} comes before the incarnation's start event")
    if started and kind == ev.START:
        raise ReplayMismatch(f"{stored.where} is a second start in one incarnation")
    if record.end_state is not None:
        raise ReplayMismatch(f"{stored.where} comes after the incarnation's end event")
    if kind not in ev.ALL_KINDS:
        raise ReplayMismatch(f"{stored.where} has an unknown kind")


def _replay_one(
    record: LayoutRecord, stored: StoredEvent, versions: Mapping[int, tuple[str, list[int]]]
) -> None:
    """Run the transition that wrote ``stored``; the journal compares what it appends."""
    event = stored.event
    kind, engine = event.kind, event.engine_id
    try:
        if kind == ev.START:
            record.start(event.reason)
        elif kind == ev.ATTACH:
            record.attach(engine, _attach_role(event))
        elif kind == ev.LEASE:
            _replay_lease(record, stored)
        elif kind == ev.RELEASE:
            _replay_release(record, stored)
        elif kind == ev.DETACH:
            record.detach(str(engine), event.reason or "")
        elif kind == ev.BEGIN:
            record.begin(engine, event.base_version, list(event.layers or ()))
        elif kind == ev.COMMIT:
            digest, layers = _recorded_version(stored, versions)
            record.commit_recorded(engine, layers, digest)
        elif kind == ev.REPAIR:
            digest, layers = _recorded_version(stored, versions)
            record.repair_recorded(engine, layers, digest)
        elif kind == ev.RELOAD:
            digest, layers = _recorded_version(stored, versions)
            record.reload_recorded(engine, layers, event.new_version, digest, event.reason)
        elif kind in (ev.HEAL, ev.HEAL_FAILED):
            record.heal_recorded(list(event.layers or ()), event.reason, kind == ev.HEAL_FAILED)
        elif kind == ev.CONTENT_DIRTY:
            _replay_content_dirty(record, stored)
        elif kind == ev.CHECKPOINT_CHANGED:
            record.note_checkpoint_changed(event.reason or "")
        elif kind == ev.ABORT:
            record.abort(engine)
        elif kind == ev.NON_FOLLOWING_FETCH:
            record.fetch(_fetch_field(event))
        elif kind == ev.END:
            _replay_end(record, event)
        elif kind in (ev.CORDON, ev.UNCORDON):
            _replay_cordon(record, stored)
        elif kind == ev.DIRTY:
            raise ReplayMismatch(
                f"{stored.where} does not follow a detach of that engine during its pending move"
            )
        elif kind == ev.RESTORE:
            raise ReplayMismatch(
                f"{stored.where} does not follow the start of an incarnation whose row records "
                f"the version it restored"
            )
        else:
            busy = {busy_kind: verb for verb, busy_kind in ev.BUSY_KINDS.items()}
            verb = busy.get(kind) or kind.removesuffix(ev.REFUSED_SUFFIX)
            record.record_refusal(verb, engine, event.reason or "", busy=kind in busy)
    except (errors.RequestRefused, errors.MoveBusy) as exc:
        raise ReplayMismatch(_refused(stored, exc, record)) from exc


def _attach_role(event: ev.Event) -> str | None:
    """The role an attach event recorded (``ev.STANDBY_ATTACH_REASON``; else active)."""
    return ROLE_STANDBY if event.reason == ev.STANDBY_ATTACH_REASON else None


def _replay_lease(record: LayoutRecord, stored: StoredEvent) -> None:
    """A lease the history granted: the rules must grant it again (not find it held)."""
    if not record.lease(stored.event.engine_id):
        raise ReplayMismatch(f"{stored.where} grants a lease the engine already held")


def _replay_release(record: LayoutRecord, stored: StoredEvent) -> None:
    """A release the history recorded: the engine must have held its lease."""
    if not record.release(stored.event.engine_id):
        raise ReplayMismatch(f"{stored.where} releases a lease the engine did not hold")


def _replay_content_dirty(record: LayoutRecord, stored: StoredEvent) -> None:
    event = stored.event
    if record.dirty is not None:
        raise ReplayMismatch(f"{stored.where} marks a daemon that was already dirty")
    if event.base_version != record.version:
        raise ReplayMismatch(
            f"{stored.where} names version {event.base_version} but the version was "
            f"{record.version}"
        )
    record.mark_content_dirty(list(event.layers or ()), event.reason or "")


def _replay_cordon(record: LayoutRecord, stored: StoredEvent) -> None:
    """A cordon of an uncordoned daemon, or an uncordon of a cordoned one (neither otherwise
    appends an event)."""
    if stored.event.kind == ev.CORDON:
        if record.cordon is not None:
            raise ReplayMismatch(f"{stored.where} cordons a daemon that was already cordoned")
        record.cordon_moves(stored.event.reason)
    else:
        if record.cordon is None:
            raise ReplayMismatch(f"{stored.where} uncordons a daemon that was not cordoned")
        record.uncordon()


def _recorded_version(
    stored: StoredEvent, versions: Mapping[int, tuple[str, list[int]]]
) -> tuple[str, list[int]]:
    version = stored.event.new_version
    recorded = versions.get(version) if isinstance(version, int) else None
    if recorded is None:
        raise ReplayMismatch(f"{stored.where}: the ledger has no version {version}")
    return recorded


def _fetch_field(event: ev.Event) -> dict[str, Any] | None:
    """The ``expert_layout`` field a served non-following fetch carried (None: no field)."""
    if event.reason == rules.FETCH_WITHOUT_FIELD:
        return None
    return {
        "engine_id": event.engine_id,
        "version": event.new_version,
        "digest": event.digest_after,
    }


def _replay_end(record: LayoutRecord, event: ev.Event) -> None:
    reason = (event.reason or "").partition(": ")[2]
    if reason.startswith(END_FOUND_UNENDED):
        record.end_found_unended()
    else:
        record.shut_down()


def replayed(conn: Connection, inc: Incarnation) -> LayoutRecord:
    """``inc``'s record after its whole history, replayed through the daemon's own rules.

    Pending move, dirty mark, attachments and the non-following flag are derived this way and
    nowhere else (``replay_incarnation``). A history whose transitions the rules would not
    have made is a damaged ledger; edited texts, times or digests are ``verify``'s to report.
    """
    try:
        return replay_incarnation(conn, inc, exact=False)
    except ReplayMismatch as exc:
        raise errors.LedgerStorageError(
            f"the history of incarnation {inc.incarnation_id} is not one the daemon's rules "
            f"write ({exc}); the ledger is damaged, run `layout-ledger verify`"
        ) from exc


def read_state(conn: Connection, incarnation_id: int | None = None) -> LayoutState:
    """The whole state of an incarnation (the latest when None), from the rows alone."""
    inc = incarnation(conn, incarnation_id)
    current_version(conn, inc.incarnation_id)  # a missing version 0 is named first
    record = replayed(conn, inc)
    return record.state_with(map_at(conn, inc, record.version))


# --- what the rows hold ---------------------------------------------------------------------

_EVENT_COLUMNS = (
    "event_id, at, kind, engine_id, layers, base_version, new_version, digest_after, reason"
)


def _stored_events(conn: Connection, incarnation_id: int, after: int = 0) -> list[StoredEvent]:
    """The incarnation's events after event ``after``, oldest first (the primary key's order).

    The primary key's range is searched, from the incarnation's first event when ``after`` is
    0 (``+incarnation_id`` keeps SQLite off the (incarnation, kind) index, whose rows it would
    look up one by one and then sort: 45 ms against 27 ms for a 10,000-version history)."""
    if not after:
        first = _driver_rows(
            conn, "SELECT min(event_id) FROM events WHERE incarnation_id = ?", (incarnation_id,)
        )[0][0]
        if first is None:
            return []
        after = int(first) - 1
    rows = _driver_rows(
        conn,
        f"SELECT {_EVENT_COLUMNS} FROM events WHERE event_id > ? AND +incarnation_id = ? "
        f"ORDER BY event_id",
        (after, incarnation_id),
    )
    return [_stored_event(*row) for row in rows]


def _driver_rows(conn: Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """``sql``'s rows straight from the sqlite3 connection under ``conn`` (the same
    transaction, so the same snapshot): a whole history's rows, without SQLAlchemy's cost per
    row (a third of a 10,000-version ``status``, scripts/bench_cli.py)."""
    driver = conn.connection.dbapi_connection
    if driver is None:
        return list(conn.exec_driver_sql(sql, params))
    cursor = driver.cursor()
    try:
        return list(cursor.execute(sql, params))
    finally:
        cursor.close()


def _stored_event(
    event_id: int, at: str, kind: str, engine_id: str | None, layers: Any, *fields: Any
) -> StoredEvent:
    """One ``events`` row (in ``_EVENT_COLUMNS`` order) as the event the record appends."""
    base_version, new_version, digest_after, reason = fields
    parsed = None if layers is None else _int_tuple(layers, event_id, "layers")
    return StoredEvent(
        int(event_id),
        ev.Event(at, kind, engine_id, parsed, base_version, new_version, digest_after, reason),
    )


def _int_tuple(text_value: Any, event_id: int, column: str) -> tuple[int, ...]:
    parsed = _int_list(text_value) if isinstance(text_value, str) else None
    if parsed is None:
        raise ReplayMismatch(f"events row {event_id}, column {column}: not a JSON list of ints")
    return parsed


@functools.lru_cache(maxsize=4096)
def _int_list(text_value: str) -> tuple[int, ...] | None:
    """A JSON list of ints as a tuple, None when ``text_value`` is not one. Cached: a history
    names the same few layer lists over and over (a rebalance's chunks)."""
    try:
        value = json.loads(text_value)
    except ValueError:
        return None
    if isinstance(value, list) and all(type(item) is int for item in value):
        return tuple(value)
    return None


def _versions(
    conn: Connection, incarnation_id: int, after: int = -1
) -> dict[int, tuple[str, list[int]]]:
    """The incarnation's versions above ``after``: digest and the layers each wrote."""
    rows = _driver_rows(
        conn,
        "SELECT version, digest, layers FROM versions WHERE incarnation_id = ? AND version > ?",
        (incarnation_id, after),
    )
    versions: dict[int, tuple[str, list[int]]] = {}
    for version, digest, layers in rows:
        parsed = _int_list(layers) if isinstance(layers, str) else None
        if parsed is None:
            raise ReplayMismatch(
                f"versions row ({incarnation_id}, {version}), column layers: not a JSON list of "
                f"ints"
            )
        versions[int(version)] = (str(digest), list(parsed))
    return versions


def _initial_map(conn: Connection, inc: Incarnation) -> Map:
    raw = conn.execute(
        text("SELECT initial_map FROM incarnations WHERE incarnation_id = :i"),
        {"i": inc.incarnation_id},
    ).scalar()
    try:
        value: Map = json.loads(str(raw))
    except (TypeError, ValueError) as exc:
        raise ReplayMismatch(
            f"incarnations row {inc.incarnation_id}, column initial_map: not JSON"
        ) from exc
    return value


# --- naming the first difference ------------------------------------------------------------


def _same_event(stored: ev.Event, appended: ev.Event) -> bool:
    return stored == appended


def _same_transition(stored: ev.Event, appended: ev.Event) -> bool:
    return (
        stored.kind == appended.kind
        and stored.engine_id == appended.engine_id
        and stored.layers == appended.layers
        and stored.base_version == appended.base_version
    )  # the kind and ``_move_of``, field by field (once per replayed event)


def _missing(event: ev.Event) -> str:
    if event.kind == ev.DIRTY:
        return (
            f"engine {event.engine_id!r} detached during its pending move but no dirty mark follows"
        )
    return f"the history ends where the rules write a {event.kind} event"


def _differs(stored: StoredEvent, expected: ev.Event, record: LayoutRecord | None) -> str:
    got = stored.event
    if expected.kind == ev.DIRTY and got.kind != ev.DIRTY:
        return (
            f"{stored.where} follows engine {expected.engine_id!r}'s detach during its pending "
            f"move, where a dirty mark must be"
        )
    if got.kind == ev.START and got.new_version != expected.new_version:
        restored = " (the version its row says it restored)" if expected.new_version else ""
        return f"{stored.where} starts at version {got.new_version}, not {expected.new_version}" + (
            restored
        )
    if expected.kind == ev.RESTORE and got.kind != ev.RESTORE:
        return (
            f"{stored.where} follows the start of an incarnation whose row records a restore, "
            f"where the restore event must be"
        )
    if got.kind in (ev.COMMIT, ev.ABORT) and _move_of(got) != _move_of(expected):
        return _not_the_pending_move(stored, expected)
    fields = [
        f"{name} {getattr(got, name)!r} where the rules give {getattr(expected, name)!r}"
        for name in _EVENT_FIELDS
        if getattr(got, name) != getattr(expected, name)
    ]
    return f"{stored.where} differs from what the rules write: " + "; ".join(fields)


_EVENT_FIELDS = (
    "kind",
    "engine_id",
    "layers",
    "base_version",
    "new_version",
    "digest_after",
    "reason",
    "at",
)


def _move_of(event: ev.Event) -> tuple[Any, ...]:
    return (event.engine_id, event.layers, event.base_version)


def _not_the_pending_move(stored: StoredEvent, pending: ev.Event) -> str:
    got = stored.event
    return (
        f"{stored.where} of layers {list(got.layers or ())} from version {got.base_version} "
        f"does not match the pending begin by {pending.engine_id!r} of layers "
        f"{list(pending.layers or ())} from version {pending.base_version}"
    )


def _refused(stored: StoredEvent, exc: Exception, record: LayoutRecord) -> str:
    """Why the rules refuse the transition that wrote ``stored`` (verify's wording)."""
    where, event = stored.where, stored.event
    if isinstance(exc, errors.EngineNotAttached):
        return f"{where}: the engine was not attached"
    if isinstance(exc, errors.NoPendingMove) or (
        event.kind == ev.COMMIT and isinstance(exc, errors.InvalidRequest)
    ):
        pending = record.pending
        if pending is None:
            return f"{where} has no begin before it"
        recorded = ev.Event(
            at="",
            kind=ev.BEGIN,
            engine_id=pending.engine_id,
            layers=pending.layers,
            base_version=pending.base_version,
        )
        return _not_the_pending_move(stored, recorded)
    if isinstance(exc, errors.EngineAlreadyAttached):
        return f"{where}: the engine was already attached"
    if event.kind == ev.NON_FOLLOWING_FETCH:
        return f"{where} was served while the layout was dirty or in flux"
    if event.kind != ev.BEGIN:
        return f"{where} was accepted although the rules refuse it: {exc}"
    return _refused_begin(where, event, exc, record)


def _refused_begin(where: str, event: ev.Event, exc: Exception, record: LayoutRecord) -> str:
    if isinstance(exc, errors.LayoutDirty):
        return f"{where} was accepted although the layout was dirty"
    if isinstance(exc, errors.MovesDisabled):
        return f"{where} was accepted after a non-following fetch"
    if isinstance(exc, errors.StaleBaseVersion):
        return (
            f"{where} names base version {event.base_version} but the version was {record.version}"
        )
    if isinstance(exc, errors.Cordoned):
        return f"{where} was accepted while the daemon was cordoned"
    if isinstance(exc, errors.MoveAlreadyPending | errors.MoveBusy):
        if record.pending is not None:
            owner = record.pending.engine_id
            return f"{where} was accepted while engine {owner!r}'s move was pending"
        if event.engine_id is not None and not rules.holds_lease(record, event.engine_id):
            return f"{where} was accepted from a standby that held no lease"
        others = [e for e in rules.lease_holders(record) if e != event.engine_id]
        return f"{where} was accepted while {others} were attached too"
    return f"{where} was accepted although the rules refuse it: {exc}"
