"""The layout record: the state machine of one daemon incarnation, and the journal it writes to.

``LayoutRecord`` is the one rulebook. Every transition (start, attach, detach, begin, commit,
abort, fetch, end) runs under one lock: it checks the request with ``rules``, builds the events
the change appends, hands them to its ``Journal`` and only then changes its in-memory state. A
refused request appends its one refusal event (``<verb>_refused`` or ``begin_busy``) inside the
same locked step and raises; nothing else changes. A journal that fails to append (the ledger
could not write) therefore leaves memory and file in the same state.

Journals (composition, one method: ``append(events, rows=None)``):

- ``layout_ledger.ledger.LedgerJournal`` writes each append as one durable SQLite transaction;
- ``MemoryJournal`` keeps nothing (benchmarks, the model-less daemon's ``--in-memory``);
- ``layout_ledger.replay.StoredEvents`` compares each event with the next row a ledger holds, so
  ``verify`` and the reader derive an incarnation's state by running these same rules over its
  history.

The daemon's serve loop and its attach watcher thread both call into one record; the lock makes
each call's check, append and state change one step, so no interleaving can produce a state the
rows do not show.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from layout_ledger import events as ev
from layout_ledger import rules
from layout_ledger.errors import (
    EngineNotAttached,
    LedgerError,
    MoveBusy,
    RequestRefused,
)
from layout_ledger.layout import Geometry, Map, digest_of_row_jsons, row_json
from layout_ledger.protocol import PendingMove
from layout_ledger.state import DirtyMark, LayoutState, utc_now

logger = logging.getLogger(__name__)

# The reasons an incarnation's end event gives after its state ("clean: daemon shut down").
END_SHUTDOWN = "daemon shut down"
END_FOUND_UNENDED = "the daemon did not shut down cleanly (found unended at the next start)"
EOF_DETACH = "attach connection closed (EOF)"


class Journal(Protocol):
    """Where a record's changes go, all or nothing, before they take effect."""

    def append(self, events: Sequence[ev.Event], rows: Mapping[int, str] | None = None) -> None:
        """Append ``events`` (a start's or commit's ``rows``: layer -> row JSON) atomically."""


class MemoryJournal:
    """A journal that keeps nothing: the same rules, no persistence."""

    def append(self, events: Sequence[ev.Event], rows: Mapping[int, str] | None = None) -> None:
        return None


def _now() -> str:
    return utc_now()  # looked up at call time, so a test may replace state.utc_now's import here


class LayoutRecord:
    """One incarnation's layout: version, map, digest, pending move, dirty mark, attachments."""

    @classmethod
    def in_memory(
        cls, geometry: Geometry, physical_to_logical_map: Map, incarnation_id: int = 1
    ) -> LayoutRecord:
        """A record that persists nothing (``MemoryJournal``)."""
        return cls(MemoryJournal(), incarnation_id, geometry, physical_to_logical_map)

    def __init__(
        self,
        journal: Journal,
        incarnation_id: int,
        geometry: Geometry,
        physical_to_logical_map: Map,
        *,
        clock: Callable[[], str] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self.journal = journal
        self._clock = clock or _now
        self.incarnation_id = incarnation_id
        self.geometry = geometry
        # None once a replayed commit was known by its digest only (its rows were pruned).
        self._row_jsons: list[str] | None = [row_json(row) for row in physical_to_logical_map]
        self.version = 0
        self.digest = digest_of_row_jsons(self._row_jsons)
        self.pending: PendingMove | None = None
        self.dirty: DirtyMark | None = None
        self._attached: dict[str, str] = {}
        self.non_following_fetch = False
        self.end_state: str | None = None

    @property
    def lock(self) -> threading.RLock:
        """Held by every transition; hold it to read several fields consistently."""
        return self._lock

    # --- the StateView the rules read ---------------------------------------------------

    @property
    def attached(self) -> Collection[str]:
        return self._attached.keys()

    @property
    def map_known(self) -> bool:
        return self._row_jsons is not None

    def row_jsons(self) -> list[str]:
        """Each layer's row JSON (the map's digest is computed over exactly these texts)."""
        with self._lock:
            return list(self._known_rows())

    def snapshot(self) -> LayoutState:
        with self._lock:
            return self.snapshot_with(self.physical_to_logical_map())

    def snapshot_with(self, physical_to_logical_map: Map) -> LayoutState:
        """This state with a map read elsewhere (a replay that knows the map by its digest)."""
        with self._lock:
            return LayoutState(
                incarnation_id=self.incarnation_id,
                geometry=self.geometry,
                version=self.version,
                digest=self.digest,
                physical_to_logical_map=physical_to_logical_map,
                pending=self.pending,
                dirty=self.dirty,
                attached=tuple(self._attached),
                non_following_fetch=self.non_following_fetch,
            )

    def physical_to_logical_map(self) -> Map:
        import json

        with self._lock:
            return [json.loads(text) for text in self._known_rows()]

    def _known_rows(self) -> list[str]:
        if self._row_jsons is None:
            raise LedgerError(
                f"incarnation {self.incarnation_id}'s map at version {self.version} is known by "
                f"its digest only (its rows were pruned)"
            )
        return self._row_jsons

    # --- transitions --------------------------------------------------------------------

    def start(self, label: str | None = None, at: str | None = None) -> None:
        """Append the incarnation's start: version 0, every layer's row."""
        with self._lock:
            rows = dict(enumerate(self._known_rows()))
            self.journal.append(
                [
                    ev.Event(
                        at=at or self._clock(),
                        kind=ev.START,
                        layers=tuple(rows),
                        new_version=0,
                        digest_after=self.digest,
                        reason=label or None,
                    )
                ],
                rows,
            )

    def attach(self, engine_id: Any) -> None:
        """Attach an engine (hold ``lock`` around this and ``snapshot`` for the attach reply)."""
        with self._lock:
            try:
                engine_id = rules.check_attach(self, engine_id)
            except RequestRefused as exc:
                self._refuse("attach", engine_id, exc)
            at = self._clock()
            self.journal.append(
                [ev.Event(at=at, kind=ev.ATTACH, engine_id=engine_id, new_version=self.version)]
            )
            self._attached[engine_id] = at

    def detach(self, engine_id: str, reason: str = EOF_DETACH) -> DirtyMark | None:
        """An engine's attach connection closed. Returns the dirty mark if its move was pending."""
        with self._lock:
            if engine_id not in self._attached:
                raise EngineNotAttached(f"engine {engine_id!r} is not attached; nothing to detach")
            at = self._clock()
            detached = ev.Event(at=at, kind=ev.DETACH, engine_id=engine_id, reason=reason)
            pending = self.pending
            if pending is None or pending.engine_id != engine_id:
                self.journal.append([detached])
                del self._attached[engine_id]
                return None
            mark = DirtyMark(move=pending, at=at)
            self.journal.append([detached, _move_event(ev.DIRTY, pending, at, reason=mark.reason)])
            del self._attached[engine_id]
            self.pending = None
            self.dirty = mark
            return mark

    def begin(self, engine_id: Any, base_version: Any, layers: Any) -> PendingMove:
        with self._lock:
            try:
                valid_layers = rules.check_begin(self, engine_id, base_version, layers)
            except (RequestRefused, MoveBusy) as exc:
                self._refuse("begin", engine_id, exc)
            at = self._clock()
            move = PendingMove(
                engine_id=engine_id, layers=valid_layers, base_version=base_version, since=at
            )
            self.journal.append([_move_event(ev.BEGIN, move, at)])
            self.pending = move
            return move

    def commit(self, engine_id: Any, rows: Any) -> tuple[int, str]:
        """Store the pending layers' new rows; returns (new version, digest of the whole map)."""
        with self._lock:
            try:
                move, new_row_jsons = rules.check_commit(self, engine_id, rows)
            except RequestRefused as exc:
                self._refuse("commit", engine_id, exc)
            row_jsons = list(self._known_rows())
            for layer, text in new_row_jsons.items():
                row_jsons[layer] = text
            return self._committed(move, digest_of_row_jsons(row_jsons), new_row_jsons, row_jsons)

    def commit_recorded(
        self, engine_id: Any, layers: Sequence[int], digest: str
    ) -> tuple[int, str]:
        """Replay a commit known by its layers and recorded digest (its rows need not be held).

        The same rules as ``commit`` except the rows' own validation and digest, which
        ``verify`` checks against the rows wherever they are held. The map becomes unknown
        until ``restore_map``.
        """
        with self._lock:
            try:
                move = rules.check_recorded_commit(self, engine_id, layers)
            except RequestRefused as exc:
                self._refuse("commit", engine_id, exc)
            return self._committed(move, digest, None, None)

    def _committed(
        self,
        move: PendingMove,
        digest: str,
        new_row_jsons: dict[int, str] | None,
        row_jsons: list[str] | None,
    ) -> tuple[int, str]:
        new_version = self.version + 1
        event = _move_event(
            ev.COMMIT, move, self._clock(), new_version=new_version, digest_after=digest
        )
        self.journal.append([event], new_row_jsons if new_row_jsons is not None else {})
        self._row_jsons = row_jsons
        self.version = new_version
        self.digest = digest
        self.pending = None
        return new_version, digest

    def restore_map(self, row_jsons: Sequence[str]) -> None:
        """Know the map again (a replay past pruned rows); it must give the current digest."""
        with self._lock:
            digest = digest_of_row_jsons(row_jsons)
            if digest != self.digest:
                raise LedgerError(
                    f"the rows of version {self.version} give digest {digest[:12]}, not the "
                    f"recorded {self.digest[:12]}"
                )
            self._row_jsons = list(row_jsons)

    def abort(self, engine_id: Any) -> None:
        with self._lock:
            try:
                move = rules.check_abort(self, engine_id)
            except RequestRefused as exc:
                self._refuse("abort", engine_id, exc)
            self.journal.append([_move_event(ev.ABORT, move, self._clock())])
            self.pending = None

    def fetch(self, field: Any) -> rules.FetchVerdict:
        """The fetch_state check; a served non-following fetch disables moves until restart."""
        with self._lock:
            try:
                verdict = rules.check_fetch(self, field)
            except RequestRefused as exc:
                named = field.get("engine_id") if isinstance(field, dict) else None
                self._refuse("fetch", named, exc)
            if not verdict.following:
                self.journal.append(
                    [
                        ev.Event(
                            at=self._clock(),
                            kind=ev.NON_FOLLOWING_FETCH,
                            engine_id=verdict.engine_id,
                            new_version=self.version,
                            digest_after=self.digest,
                            reason=verdict.reason,
                        )
                    ]
                )
                self.non_following_fetch = True
            return verdict

    def shut_down(self) -> str:
        """The daemon stops: end the incarnation, dirty if the layout is unknown or in flux."""
        with self._lock:
            state = "dirty" if (self.dirty or self.pending) else "clean"
            reason = END_SHUTDOWN
            if self.pending is not None:
                reason += f" while a move of engine {self.pending.engine_id!r} was pending"
            return self._end(state, reason)

    def end_found_unended(self, at: str | None = None) -> str:
        """A later daemon start found this incarnation unended: its process died."""
        with self._lock:
            state = "dirty" if self.dirty is not None else "unknown"
            reason = END_FOUND_UNENDED
            if self.pending is not None:
                pending = self.pending
                reason += (
                    f"; a move was pending (engine {pending.engine_id!r}, layers "
                    f"{list(pending.layers)}, from version {pending.base_version})"
                )
            return self._end(state, reason, at)

    def _end(self, state: str, reason: str, at: str | None = None) -> str:
        if self.end_state is not None:
            raise LedgerError(f"incarnation {self.incarnation_id} has already ended")
        event = ev.Event(at=at or self._clock(), kind=ev.END, reason=f"{state}: {reason}")
        self.journal.append([event])
        self.end_state = state
        self._attached.clear()
        return state

    # --- refusals -------------------------------------------------------------------------

    def record_refusal(self, verb: str, engine_id: Any, reason: str, *, busy: bool = False) -> None:
        """Append the one event a refused (or busy) request leaves; nothing else changes."""
        with self._lock:
            kind = ev.BEGIN_BUSY if busy else ev.refused_kind(verb)
            self._append_refusal(kind, engine_id, reason, self._clock())

    def _append_refusal(self, kind: str, engine_id: Any, reason: str, at: str) -> None:
        named = engine_id if isinstance(engine_id, str) else None
        self.journal.append(
            [
                ev.Event(
                    at=at,
                    kind=kind,
                    engine_id=ev.clip(named),
                    new_version=self.version,
                    reason=ev.clip(reason),
                )
            ]
        )

    def check_request_engine_id(self, verb: str, engine_id: Any) -> None:
        """Refuse a request whose engine id ``rules.check_request_engine_id`` refuses."""
        with self._lock:
            try:
                rules.check_request_engine_id(engine_id)
            except RequestRefused as exc:
                self._refuse(verb, engine_id, exc)

    def _refuse(self, verb: str, engine_id: Any, exc: LedgerError) -> NoReturn:
        """Record the refusal's one event, then raise it (a failed record is only logged).

        The event names the engine only by an id a request may name (``rules``).
        """
        kind = ev.BEGIN_BUSY if isinstance(exc, MoveBusy) else ev.refused_kind(verb)
        named = rules.recordable_engine_id(engine_id)
        try:
            self._append_refusal(kind, named, str(exc), self._clock())
        except LedgerError as failure:
            logger.error("could not record a refused %s in the ledger: %s", verb, failure)
        raise exc


def _move_event(kind: str, move: PendingMove, at: str, **fields: Any) -> ev.Event:
    """The event of one step of ``move`` (begin, commit, abort, dirty)."""
    return ev.Event(
        at=at,
        kind=kind,
        engine_id=move.engine_id,
        layers=move.layers,
        base_version=move.base_version,
        **fields,
    )
