"""The layout record: the state machine of one daemon incarnation, persisted by a subclass.

``LayoutRecord`` applies ``rules`` under one lock, builds the ``Event`` a change appends, hands
it to ``_persist`` and only then changes its in-memory state. A failed ``_persist`` (the ledger
could not write) therefore leaves memory and file in the same state, and a refused request
reaches neither. ``MemoryRecord`` persists nothing (benchmarks compare against it);
``layout_ledger.ledger.LedgerRecord`` writes each change to SQLite before returning.

The daemon's serve loop and its attach watcher thread both call into one record; the lock makes
each call's check, write and state change one step, so no interleaving can produce a state the
rows do not show.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from typing import Any

from layout_ledger import events as ev
from layout_ledger import rules
from layout_ledger.errors import EngineNotAttached
from layout_ledger.layout import Geometry, Map, digest_of_row_jsons, row_json
from layout_ledger.protocol import PendingMove
from layout_ledger.state import DirtyMark, LayoutState, utc_now


def _move_event(kind: str, move: PendingMove, at: str | None = None, **fields: Any) -> ev.Event:
    """The event of one step of ``move`` (begin, commit, abort, dirty)."""
    return ev.Event(
        at=at or utc_now(),
        kind=kind,
        engine_id=move.engine_id,
        layers=move.layers,
        base_version=move.base_version,
        **fields,
    )


class LayoutRecord:
    """One incarnation's layout: version, map, digest, pending move, dirty mark, attachments."""

    def __init__(
        self,
        incarnation_id: int,
        geometry: Geometry,
        physical_to_logical_map: Map,
        version: int = 0,
    ) -> None:
        self._lock = threading.RLock()
        self.incarnation_id = incarnation_id
        self.geometry = geometry
        self._rows: Map = [list(row) for row in physical_to_logical_map]
        self._row_jsons = [row_json(row) for row in self._rows]
        self.version = version
        self.digest = digest_of_row_jsons(self._row_jsons)
        self.pending: PendingMove | None = None
        self.dirty: DirtyMark | None = None
        self._attached: dict[str, str] = {}
        self.non_following_fetch = False

    @property
    def lock(self) -> threading.RLock:
        """Held by every transition; hold it to read several fields consistently."""
        return self._lock

    # --- the StateView the rules read ---------------------------------------------------

    @property
    def attached(self) -> Collection[str]:
        return self._attached.keys()

    def snapshot(self) -> LayoutState:
        with self._lock:
            return LayoutState(
                incarnation_id=self.incarnation_id,
                geometry=self.geometry,
                version=self.version,
                digest=self.digest,
                physical_to_logical_map=[list(row) for row in self._rows],
                pending=self.pending,
                dirty=self.dirty,
                attached=tuple(self._attached),
                non_following_fetch=self.non_following_fetch,
            )

    # --- persistence hook ---------------------------------------------------------------

    def _persist(self, *events: ev.Event, rows: Mapping[int, str] | None = None) -> None:
        """Make ``events`` (and a commit's row JSON) durable, all or none, before any change."""
        raise NotImplementedError

    # --- transitions --------------------------------------------------------------------

    def attach(self, engine_id: Any) -> LayoutState:
        with self._lock:
            engine_id = rules.check_attach(self, engine_id)
            at = utc_now()
            self._persist(
                ev.Event(at=at, kind=ev.ATTACH, engine_id=engine_id, new_version=self.version)
            )
            self._attached[engine_id] = at
            return self.snapshot()

    def detach(
        self, engine_id: str, reason: str = "attach connection closed (EOF)"
    ) -> DirtyMark | None:
        """An engine's attach connection closed. Returns the dirty mark if its move was pending."""
        with self._lock:
            if engine_id not in self._attached:
                raise EngineNotAttached(f"engine {engine_id!r} is not attached; nothing to detach")
            at = utc_now()
            detached = ev.Event(at=at, kind=ev.DETACH, engine_id=engine_id, reason=reason)
            pending = self.pending
            if pending is None or pending.engine_id != engine_id:
                self._persist(detached)
                del self._attached[engine_id]
                return None
            mark = DirtyMark(move=pending, at=at)
            dirty = _move_event(ev.DIRTY, pending, at=at, reason=mark.reason)
            self._persist(detached, dirty)
            del self._attached[engine_id]
            self.pending = None
            self.dirty = mark
            return mark

    def begin(self, engine_id: Any, base_version: Any, layers: Any) -> PendingMove:
        with self._lock:
            valid_layers = rules.check_begin(self, engine_id, base_version, layers)
            move = PendingMove(
                engine_id=engine_id,
                layers=valid_layers,
                base_version=base_version,
                since=utc_now(),
            )
            self._persist(_move_event(ev.BEGIN, move, at=move.since))
            self.pending = move
            return move

    def commit(self, engine_id: Any, rows: Any) -> tuple[int, str]:
        """Store the pending layers' new rows; returns (new version, digest of the whole map)."""
        with self._lock:
            move, valid_rows = rules.check_commit(self, engine_id, rows)
            new_row_jsons = {layer: row_json(row) for layer, row in valid_rows.items()}
            row_jsons = list(self._row_jsons)
            for layer, text in new_row_jsons.items():
                row_jsons[layer] = text
            digest = digest_of_row_jsons(row_jsons)
            new_version = self.version + 1
            self._persist(
                _move_event(ev.COMMIT, move, new_version=new_version, digest_after=digest),
                rows=new_row_jsons,
            )
            for layer, row in valid_rows.items():
                self._rows[layer] = row
            self._row_jsons = row_jsons
            self.version = new_version
            self.digest = digest
            self.pending = None
            return new_version, digest

    def abort(self, engine_id: Any) -> None:
        with self._lock:
            move = rules.check_abort(self, engine_id)
            self._persist(_move_event(ev.ABORT, move))
            self.pending = None

    def fetch(self, field: Any) -> rules.FetchVerdict:
        """The fetch_state check; a served non-following fetch disables moves until restart."""
        with self._lock:
            verdict = rules.check_fetch(self, field)
            if not verdict.following:
                self._persist(
                    ev.Event(
                        at=utc_now(),
                        kind=ev.NON_FOLLOWING_FETCH,
                        engine_id=verdict.engine_id,
                        new_version=self.version,
                        digest_after=self.digest,
                        reason=verdict.reason,
                    )
                )
                self.non_following_fetch = True
            return verdict

    def record_refusal(self, verb: str, engine_id: Any, reason: str, *, busy: bool = False) -> None:
        """Append the one event a refused (or busy) request leaves; nothing else changes."""
        with self._lock:
            kind = ev.BEGIN_BUSY if busy else ev.refused_kind(verb)
            named = engine_id if isinstance(engine_id, str) else None
            self._persist(
                ev.Event(
                    at=utc_now(),
                    kind=kind,
                    engine_id=ev.clip(named),
                    base_version=None,
                    new_version=self.version,
                    reason=ev.clip(reason),
                )
            )


class MemoryRecord(LayoutRecord):
    """A record that keeps nothing on disk: the same rules, no persistence."""

    def _persist(self, *events: ev.Event, rows: Mapping[int, str] | None = None) -> None:
        return None
