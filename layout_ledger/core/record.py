"""The layout record: the state machine of one daemon incarnation, and the journal it writes to.

``LayoutRecord`` is the one rulebook. Every transition (start, attach, detach, begin, commit,
abort, fetch, content dirty mark, content check, repair, end) runs under one lock: it checks the
request with ``rules`` (the engine id first), hands the events of the change to its ``Journal``
and only then changes its state in memory; a refused request appends its one refusal event
(``<verb>_refused`` or ``begin_busy``) and raises. A journal that cannot append changes nothing
in memory either, so memory and file agree, and the lock lets the daemon's serve loop and its
attach watcher thread share one record. A heal and a reload leave the lock while they read the
checkpoint and write slots (``reloading``), so a file that blocks holds no request.
A repair records the layout an engine's unfinished move left, only when every fingerprint it
names is what the daemon's own slots show now (``rules.check_repair``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from layout_ledger.core import events as ev
from layout_ledger.core import rules
from layout_ledger.core.content import (
    ExpertContents,
    LocalFingerprints,
    changed_slots,
    describe_changes,
)
from layout_ledger.core.errors import (
    EngineNotAttached,
    HealFailed,
    LedgerError,
    MoveBusy,
    NoContentRecord,
    RequestRefused,
)
from layout_ledger.core.layout import Geometry, Map, digest_of_row_jsons, row_json
from layout_ledger.core.reloads import (
    ReloadFailed,
    ReloadReport,
    SlotReloader,
    all_local_slots,
    changed_local_slots,
)
from layout_ledger.core.state import (
    ROLE_STANDBY,
    ContentFinding,
    ContentState,
    Cordon,
    DirtyMark,
    LayoutState,
    PendingMove,
    Reloading,
    RestoredFrom,
    utc_now,
)

logger = logging.getLogger(__name__)

# The reasons an incarnation's end event gives after its end state ("clean: daemon shut down").
END_SHUTDOWN = "daemon shut down"
END_FOUND_UNENDED = "the daemon did not shut down cleanly (found unended at the next start)"
EOF_DETACH = "attach connection closed (EOF)"
# How often a content check reads the slots outside the lock before it reads them under it
# (each read lost a race with a begin, commit, abort or repair).
CONTENT_CHECK_TRIES = 3


class Fingerprinter(Protocol):
    """Fingerprints the daemon's local slots now: of ``layers``, or of every layer with
    routed-expert tensors when None (``wire.service.ContentSource.fingerprints``)."""

    def __call__(self, layers: Sequence[int] | None = None) -> LocalFingerprints: ...


class Journal(Protocol):
    """Where a record's changes go, all or nothing, before they take effect.

    ``store.ledger.LedgerJournal`` writes each append as one SQLite transaction, a version's on
    disk before the daemon replies; ``MemoryJournal`` keeps nothing (benchmarks, ``--in-memory``);
    ``store.replay.StoredEvents`` compares each event with the next row a ledger holds, so the
    reader and ``verify`` derive an incarnation's state by running these same rules again.
    """

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: LocalFingerprints | None = None,
    ) -> None:
        """Append ``events`` atomically, with a new version's ``rows`` (layer -> row JSON) and
        its layers' slot ``fingerprints`` (a start's, commit's or repair's)."""


class MemoryJournal:
    """A journal that keeps nothing: the same rules, no persistence."""

    def append(
        self,
        events: Sequence[ev.Event],
        rows: Mapping[int, str] | None = None,
        fingerprints: LocalFingerprints | None = None,
    ) -> None:
        return None


def _now() -> str:
    return utc_now()  # looked up at call time, so a test may replace state.utc_now's import here


class LayoutRecord:
    """One incarnation's layout: version, map, digest, pending move, dirty mark, attachments,
    and (a daemon that records content) its local slots' fingerprints."""

    @classmethod
    def in_memory(
        cls,
        geometry: Geometry,
        physical_to_logical_map: Map,
        incarnation_id: int = 1,
        content: LocalFingerprints | None = None,
    ) -> LayoutRecord:
        """A record that persists nothing (``MemoryJournal``)."""
        return cls(
            MemoryJournal(), incarnation_id, geometry, physical_to_logical_map, content=content
        )

    def __init__(
        self,
        journal: Journal,
        incarnation_id: int,
        geometry: Geometry,
        physical_to_logical_map: Map,
        *,
        clock: Callable[[], str] | None = None,
        content: LocalFingerprints | None = None,
        engine_ids: Callable[[Any], str] = rules.check_request_engine_id,
        restored_from: RestoredFrom | None = None,
    ) -> None:
        """``engine_ids`` checks the engine id each transition names, first: a request's rule
        (a daemon's record), or ``rules.check_engine_id`` for a replay of stored events.
        ``restored_from``: the incarnation starts at that version and digest, whose map
        ``physical_to_logical_map`` must be (``restored_start``); None: at version 0."""
        self._lock = threading.RLock()
        self.journal = journal
        self._clock = clock or _now
        self._engine_ids = engine_ids
        self.incarnation_id = incarnation_id
        self.geometry = geometry
        # None once a replayed commit was known by its digest only (its rows were pruned).
        self._row_jsons: list[str] | None = [row_json(row) for row in physical_to_logical_map]
        self.digest = digest_of_row_jsons(self._row_jsons)
        self.restored_from = restored_from
        self.version = restored_start(restored_from, self.digest)
        self.pending: PendingMove | None = None
        self.dirty: DirtyMark | None = None
        self._attached: dict[str, str] = {}
        self._standbys: set[str] = set()  # attached engines whose role is standby
        self._leases: set[str] = set()  # standbys that hold a lease now
        self.non_following_fetch = False
        self.cordon: Cordon | None = None  # an operator's: begins are busy while it lasts
        # A heal or reload writing slots from the checkpoint now, outside the lock (its read may
        # take as long as --expert-layout-heal-timeout): the rules refuse what could race it.
        self.reloading: Reloading | None = None
        self.end_state: str | None = None
        # Counts every change of the version or the pending move (begin, commit, abort, a
        # mover's detach, repair): a content check compares fingerprints read while it stood
        # still (``content_check``).
        self._moves_seen = 0
        # The local slots' fingerprints at the current version (None: this daemon records none)
        # and every expert's content learned from them this incarnation.
        self.content = content
        self.known = ExpertContents()
        if content is not None:
            self._learn(physical_to_logical_map, content)

    @property
    def lock(self) -> threading.RLock:
        """Held by every transition; hold it to read several fields consistently."""
        return self._lock

    # --- the StateView the rules read ---------------------------------------------------

    @property
    def attached(self) -> Collection[str]:
        return self._attached.keys()

    @property
    def standbys(self) -> Collection[str]:
        return self._standbys

    @property
    def leases(self) -> Collection[str]:
        return self._leases

    def row_jsons(self) -> list[str]:
        """Each layer's row JSON (the map's digest is computed over exactly these texts)."""
        with self._lock:
            return list(self._known_rows())

    def state(self) -> LayoutState:
        """The record's state now, map included."""
        with self._lock:
            return self.state_with(self.physical_to_logical_map())

    def state_with(self, physical_to_logical_map: Map) -> LayoutState:
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
                cordon=self.cordon,
                standbys=tuple(e for e in self._attached if e in self._standbys),
                leases=tuple(e for e in self._attached if e in self._leases),
                restored_from=self.restored_from,
                reloading=self.reloading,
            )

    def physical_to_logical_map(self) -> Map:
        """The current map (raises ``LedgerError`` while it is known by its digest only)."""
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
        """Append the incarnation's start: its first version (0, or the restored one), every
        layer's row and fingerprints; a restored start is followed by its ``restore`` event."""
        with self._lock:
            rows = dict(enumerate(self._known_rows()))
            at = at or self._clock()
            started = ev.Event(
                at=at,
                kind=ev.START,
                layers=tuple(rows),
                new_version=self.version,
                digest_after=self.digest,
                reason=label or None,
            )
            self.journal.append(
                [started, *_restore_events(self.restored_from, at)], rows, self.content
            )

    def note_checkpoint_changed(self, reason: str) -> None:
        """Right after a restored start: its weights come from another checkpoint than the
        ledger's latest incarnation loaded (``checkpoint_changed``, ``CheckpointChange.describe``
        as the reason); nothing else changes."""
        with self._lock:
            if self.restored_from is None:
                raise LedgerError("a checkpoint change is recorded only by a restored start")
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.CHECKPOINT_CHANGED,
                        new_version=self.version,
                        digest_after=self.digest,
                        reason=ev.clip(reason),
                    )
                ]
            )

    def attach(self, engine_id: Any, role: Any = None) -> str:
        """Attach an engine as ``role`` (None: ``active``); returns the role. Hold ``lock``
        around this and ``state`` for the attach reply. A standby holds no lease yet."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                valid_role = rules.check_role(role)
                rules.check_attach(self, valid_id)
            except RequestRefused as exc:
                self._refuse("attach", engine_id, exc)
            at = self._clock()
            standby = valid_role == ROLE_STANDBY
            self.journal.append(
                [
                    ev.Event(
                        at=at,
                        kind=ev.ATTACH,
                        engine_id=valid_id,
                        new_version=self.version,
                        reason=ev.STANDBY_ATTACH_REASON if standby else None,
                    )
                ]
            )
            self._attached[valid_id] = at
            if standby:
                self._standbys.add(valid_id)
            return valid_role

    def lease(self, engine_id: Any) -> bool:
        """A standby's lease (refused, or busy while a move is pending: ``MoveBusy``). Returns
        False when the engine already held it (nothing appended)."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                granted = rules.check_lease(self, valid_id)
            except (RequestRefused, MoveBusy) as exc:
                self._refuse("lease", engine_id, exc)
            if not granted:
                return False
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.LEASE,
                        engine_id=valid_id,
                        new_version=self.version,
                        digest_after=self.digest,
                    )
                ]
            )
            self._leases.add(valid_id)
            return True

    def release(self, engine_id: Any) -> bool:
        """End a standby's lease. Returns False when it held none (nothing appended)."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                held = rules.check_release(self, valid_id)
            except RequestRefused as exc:
                self._refuse("release", engine_id, exc)
            if not held:
                return False
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.RELEASE,
                        engine_id=valid_id,
                        new_version=self.version,
                    )
                ]
            )
            self._leases.discard(valid_id)
            return True

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
                self._forget(engine_id)
                return None
            mark = DirtyMark(move=pending, at=at)
            self.journal.append([detached, _move_event(ev.DIRTY, pending, at, reason=mark.reason)])
            self._forget(engine_id)
            self.pending = None
            self.dirty = mark
            self._moves_seen += 1
            return mark

    def _forget(self, engine_id: str) -> None:
        """A detached engine: its attachment, role and lease end together."""
        del self._attached[engine_id]
        self._standbys.discard(engine_id)
        self._leases.discard(engine_id)

    def begin(self, engine_id: Any, base_version: Any, layers: Any) -> PendingMove:
        """Begin a move of ``layers`` from ``base_version`` (refused, or busy: ``MoveBusy``)."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                valid_layers = rules.check_begin(self, valid_id, base_version, layers)
            except (RequestRefused, MoveBusy) as exc:
                self._refuse("begin", engine_id, exc)
            at = self._clock()
            move = PendingMove(
                engine_id=valid_id, layers=valid_layers, base_version=base_version, since=at
            )
            self.journal.append([_move_event(ev.BEGIN, move, at)])
            self.pending = move
            self._moves_seen += 1
            return move

    def commit(
        self, engine_id: Any, rows: Any, fingerprints_of: Fingerprinter | None = None
    ) -> tuple[int, str]:
        """Store the pending layers' new rows; returns (new version, digest of the whole map).

        With ``fingerprints_of`` (a daemon that records content) the moved layers' slots are
        fingerprinted once the commit is accepted (the engine synchronized before sending it) and
        recorded with the rows; a slot that holds another expert than its new row names marks the
        daemon dirty after the commit (``committed_content_problems``).
        """
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                move, new_row_jsons = rules.check_commit(self, valid_id, rows)
            except RequestRefused as exc:
                self._refuse("commit", engine_id, exc)
            row_jsons = list(self._known_rows())
            for layer, text in new_row_jsons.items():
                row_jsons[layer] = text
            found = None
            if fingerprints_of is not None and self.content is not None:
                found = self._fingerprints_now(fingerprints_of, move.layers)
            version, digest = self._committed(
                move, digest_of_row_jsons(row_jsons), new_row_jsons, row_jsons, fingerprints=found
            )
            if found is not None:
                self._check_committed_content(found)
            return version, digest

    def commit_recorded(
        self, engine_id: Any, layers: Sequence[int], digest: str
    ) -> tuple[int, str]:
        """Replay a commit known by its layers and recorded digest (its rows need not be held).

        The same rules as ``commit`` except the rows' own validation and digest, which
        ``verify`` checks against the rows wherever they are held. From here on the record
        knows its map by the digest only (``state_with`` takes the map read from the rows).
        """
        with self._lock:
            try:
                move = rules.check_recorded_commit(self, self._engine_ids(engine_id), layers)
            except RequestRefused as exc:
                self._refuse("commit", engine_id, exc)
            return self._committed(move, digest, None, None)

    def _committed(
        self,
        move: PendingMove,
        digest: str,
        new_row_jsons: dict[int, str] | None,
        row_jsons: list[str] | None,
        *,
        fingerprints: LocalFingerprints | None = None,
        kind: str = ev.COMMIT,
        new_version: int | None = None,
        reason: str | None = None,
    ) -> tuple[int, str]:
        """A new version (a commit's or repair's: the next one; a reload's: ``new_version``):
        append, then take it on."""
        new_version = self.version + 1 if new_version is None else new_version
        event = _move_event(
            kind,
            move,
            self._clock(),
            new_version=new_version,
            digest_after=digest,
            reason=reason,
        )
        rows = new_row_jsons if new_row_jsons is not None else {}
        self.journal.append([event], rows, fingerprints)
        self._row_jsons = row_jsons
        self.version = new_version
        self.digest = digest
        self.pending = None
        self._moves_seen += 1
        if fingerprints is not None and self.content is not None:
            self.content = self.content.updated(fingerprints)
        return new_version, digest

    def abort(self, engine_id: Any) -> None:
        """End the engine's pending move without a new version."""
        with self._lock:
            try:
                move = rules.check_abort(self, self._engine_ids(engine_id))
            except RequestRefused as exc:
                self._refuse("abort", engine_id, exc)
            self.journal.append([_move_event(ev.ABORT, move, self._clock())])
            self.pending = None
            self._moves_seen += 1

    def fetch(self, field: Any) -> rules.FetchVerdict:
        """The fetch_state check; a served non-following fetch disables moves until restart."""
        with self._lock:
            named = field.get("engine_id") if isinstance(field, dict) else None
            try:
                valid_id = None if named is None else self._engine_ids(named)
                verdict = rules.check_fetch(self, field, valid_id)
            except RequestRefused as exc:
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

    def cordon_moves(self, reason: Any) -> Cordon:
        """An operator's cordon: every begin from now on is answered busy, naming it, until
        ``uncordon`` or the incarnation's end. Cordoning a cordoned daemon changes nothing (the
        first cordon, its time and reason, stays)."""
        with self._lock:
            try:
                text = rules.check_cordon_reason(reason)
            except RequestRefused as exc:
                self._refuse("cordon", None, exc)
            if self.cordon is not None:
                return self.cordon
            at = self._clock()
            self.journal.append(
                [ev.Event(at=at, kind=ev.CORDON, new_version=self.version, reason=text)]
            )
            self.cordon = Cordon(since=at, reason=text)
            return self.cordon

    def uncordon(self) -> Cordon | None:
        """Lift the cordon; returns the one lifted (None: there was none, nothing changes)."""
        with self._lock:
            lifted = self.cordon
            if lifted is None:
                return None
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.UNCORDON,
                        new_version=self.version,
                        reason=lifted.reason,
                    )
                ]
            )
            self.cordon = None
            return lifted

    # --- content: the load check, the content check, repairs ------------------------------------

    def check_loaded_content(self, enforce: bool = True) -> str | None:
        """After the start: slots the map gives one expert must hold the same bytes. Returns
        the problem in words (None: none); with ``enforce`` the daemon is marked dirty for it."""
        with self._lock:
            if self.content is None:
                return None
            problems = rules.loaded_content_problems(self.physical_to_logical_map(), self.content)
            if not problems:
                return None
            problem = "the weights this daemon loaded do not match its layout: " + "; ".join(
                problems.values()
            )
            if enforce:
                self.mark_content_dirty(
                    sorted(problems),
                    problem + "; restart the daemon (its loader left slots it should have filled)",
                )
            return problem

    def mark_content_dirty(self, layers: Sequence[int], reason: str) -> DirtyMark:
        """The slots' content is not what the record says: the layout is unknown (refused like
        a daemon an engine left mid-move)."""
        with self._lock:
            try:
                rules.check_content_mark(self)
            except RequestRefused as exc:
                raise LedgerError(f"cannot mark the content dirty: {exc}") from exc
            at = self._clock()
            finding = ContentFinding(tuple(sorted(layers)), self.version, ev.clip(reason) or "")
            self.journal.append(
                [
                    ev.Event(
                        at=at,
                        kind=ev.CONTENT_DIRTY,
                        layers=finding.layers,
                        base_version=self.version,
                        reason=finding.reason,
                    )
                ]
            )
            self.dirty = DirtyMark(move=None, at=at, content=finding)
            return self.dirty

    def content_check(self, fingerprints_of: Fingerprinter) -> ContentState:
        """Compare the slots' fingerprints now with the record (but the layers of a pending
        move, or of the unfinished move a daemon is dirty for); content that moved without a
        commit marks a clean daemon dirty.

        The fingerprints are compared with the record they were read at: they are read outside
        the lock (a begin or fetch need not wait for them), and compared only if no begin,
        commit, abort or repair happened meanwhile (``_moves_seen``); else read again, and after
        ``CONTENT_CHECK_TRIES`` lost races read under the lock, where no move can begin or end.
        A move pending all along is skipped by its layers, whose bytes are changing.
        """
        if self.content is None:
            raise NoContentRecord(rules.NO_CONTENT_RECORD)
        for _ in range(CONTENT_CHECK_TRIES):
            with self._lock:
                seen = self._moves_seen
            current = self._fingerprints_now(fingerprints_of)
            with self._lock:
                if self._moves_seen == seen:
                    return self._compare_content(current)
        with self._lock:
            return self._compare_content(self._fingerprints_now(fingerprints_of))

    def _compare_content(self, current: LocalFingerprints) -> ContentState:
        """The content check's comparison, under the lock, of fingerprints read at this
        version and pending move."""
        recorded = self.content
        if recorded is None:
            raise NoContentRecord(rules.NO_CONTENT_RECORD)
        skip = set() if self.pending is None else set(self.pending.layers)
        if self.dirty is not None and self.dirty.move is not None:
            skip |= set(self.dirty.move.layers)
        changed = changed_slots(recorded, current, skip)
        # During a reload its slots are being written; the reload checks them itself.
        if changed and self.dirty is None and self.reloading is None:
            the_map = self.physical_to_logical_map()
            self.mark_content_dirty(
                sorted(changed),
                "slot content moved without a commit: "
                + describe_changes(changed, current, self.known, the_map)
                + "; restart the daemon",
            )
        return ContentState(self.state(), recorded, current)

    def repair(
        self,
        engine_id: Any,
        rows: Any,
        fingerprints: Any,
        fingerprints_of: Fingerprinter | None,
        *,
        expected_fingerprints: Any = None,
    ) -> tuple[int, str]:
        """Record the layout the dirty move's layers hold (checked against this daemon's own
        fingerprints now, ``fingerprints_of``) as a new version, and clear the dirty mark.

        ``expected_fingerprints`` (the request's, optional): ``{layer: {expert: fingerprint}}``
        of the experts the rows name that this daemon never held (``rules.check_repair``)."""
        with self._lock:  # the engine id first: an id refused alone costs no fingerprinting
            try:
                valid_id = self._engine_ids(engine_id)
            except RequestRefused as exc:
                self._refuse("repair", engine_id, exc)
        current = None
        if self.content is not None and fingerprints_of is not None:
            current = self._fingerprints_now(fingerprints_of)
        with self._lock:
            content = None
            if self.content is not None and current is not None:
                content = rules.DaemonContent(self.content, current, self.known)
            try:
                move, valid_rows, claimed = rules.check_repair(
                    self,
                    valid_id,
                    rows,
                    fingerprints,
                    content,
                    expected_fingerprints=expected_fingerprints,
                )
            except RequestRefused as exc:
                self._refuse("repair", engine_id, exc)
            new_row_jsons = {layer: row_json(row) for layer, row in valid_rows.items()}
            row_jsons = list(self._known_rows())
            for layer, text in new_row_jsons.items():
                row_jsons[layer] = text
            digest = digest_of_row_jsons(row_jsons)
            repairer = dataclasses.replace(move, engine_id=valid_id)
            result = self._committed(
                repairer, digest, new_row_jsons, row_jsons, fingerprints=claimed, kind=ev.REPAIR
            )
            self.dirty = None
            self._learn(self.physical_to_logical_map(), claimed)
            return result

    def repair_recorded(
        self, engine_id: Any, layers: Sequence[int], digest: str
    ) -> tuple[int, str]:
        """Replay a repair known by its layers and recorded digest (as ``commit_recorded``)."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                move = rules.check_recorded_repair(self, valid_id, layers)
            except RequestRefused as exc:
                self._refuse("repair", engine_id, exc)
            repairer = dataclasses.replace(move, engine_id=valid_id)
            result = self._committed(repairer, digest, None, None, kind=ev.REPAIR)
            self.dirty = None
            return result

    # --- reloads from the checkpoint: expert_layout_reload, heal --------------------------

    def reload(
        self,
        engine_id: Any,
        *,
        base_version: Any,
        version: Any,
        digest: Any,
        physical_to_logical_map: Any,
        reloader: SlotReloader | None,
        cannot_reload: str | None = None,
    ) -> tuple[int, str, ReloadReport | None]:
        """``expert_layout_reload``: rewrite from the checkpoint the local slots whose expert
        differs between the current map and ``physical_to_logical_map``, then record it as
        ``version`` (a jump from ``base_version``). Returns (version, digest, the reload's
        report; None when no local slot changed).

        The intent is recorded first (a ``begin`` of the changed layers), so a kill mid-reload
        leaves a move pending: never clean by mistake. A reload that fails after it began marks
        the daemon dirty (its slots may be half-written; a heal or a restart fixes them) and
        raises ``LedgerError``. Reloaded slots that do not hold what the ledger knows of their
        experts mark it dirty after the reload, as a commit's do.
        """
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                if cannot_reload is None and (reloader is None or self.content is None):
                    cannot_reload = "it has no checkpoint reloader or records no fingerprints"
                new_map = rules.check_reload(
                    self,
                    valid_id,
                    base_version=base_version,
                    version=version,
                    digest=digest,
                    physical_to_logical_map=physical_to_logical_map,
                    cannot_reload=cannot_reload,
                )
            except RequestRefused as exc:
                self._refuse("reload", engine_id, exc)
            recorded = self.content
            if reloader is None or recorded is None:  # checked above; for the type checker
                raise LedgerError("no reloader")
            old_map = self.physical_to_logical_map()
            layers = tuple(
                i for i, (a, b) in enumerate(zip(old_map, new_map, strict=True)) if a != b
            )
            slots = {  # only layers with routed-expert tensors (a dense layer has none)
                layer: changed
                for layer, changed in changed_local_slots(
                    old_map, new_map, recorded.first_slot, rules.local_slot_count(recorded)
                ).items()
                if layer in recorded.layers
            }
            move = PendingMove(valid_id, layers, base_version, self._clock())
            if layers:
                self.journal.append([_move_event(ev.BEGIN, move, str(move.since))])
                self.pending = move
                self._moves_seen += 1
            self.reloading = Reloading(ev.RELOAD, tuple(sorted(slots)), valid_id)
        # The read and the writes run outside the lock: queries, fetches (refused: a move is
        # pending) and the attach watcher go on while a file blocks, up to the read deadline.
        # A kill during the read leaves the move pending, so the daemon ends dirty.
        report, failure = self._read_unlocked(reloader, new_map, slots) if slots else (None, None)
        with self._lock:
            self.reloading = None
            self._after_reload(move, layers, version)
            if failure is not None:
                self._reload_failed(move, sorted(slots), version, failure)
            found = None
            if layers:
                fresh = {} if report is None else dict(report.fingerprints.layers)
                found = LocalFingerprints(
                    recorded.first_slot,
                    {
                        layer: fresh.get(layer, recorded.layers[layer])
                        for layer in layers
                        if layer in recorded.layers
                    },
                )
            row_jsons = [row_json(row) for row in new_map]
            reason = "no local slot changed" if report is None else report.describe()
            result = self._committed(
                move,
                digest,
                {layer: row_jsons[layer] for layer in layers},
                row_jsons,
                fingerprints=found,
                kind=ev.RELOAD,
                new_version=version,
                reason=reason,
            )
            if found is not None:
                self._check_committed_content(found, verb="reload")
            return result[0], result[1], report

    def _read_unlocked(
        self, reloader: SlotReloader, the_map: Map, slots: Mapping[int, Sequence[int]]
    ) -> tuple[ReloadReport | None, Exception | None]:
        """Run a heal's or reload's ``reloader`` outside the lock (``reloading`` set by the
        caller): its report, or the exception it failed with. Anything else raised (a kill, an
        interrupt) clears ``reloading`` and goes on up."""
        try:
            return reloader(the_map, slots), None
        except Exception as exc:
            return None, exc
        except BaseException:
            with self._lock:
                self.reloading = None
            raise

    def _after_reload(self, move: PendingMove, layers: Sequence[int], version: Any) -> None:
        """Back under the lock after a reload's writes: the incarnation must still be live and
        the move still the reload's (its engine may have detached meanwhile: dirty then)."""
        if self.end_state is not None:
            raise ReloadFailed("the daemon ended during the reload; it was not recorded")
        if layers and self.pending is not move:
            raise ReloadFailed(
                f"engine {move.engine_id!r} detached during its reload to version {version}, "
                f"which was not recorded: "
                + (self.dirty.reason if self.dirty is not None else "the move ended")
            )

    def _reload_failed(
        self, move: PendingMove, layers: Sequence[int], version: Any, exc: Exception
    ) -> NoReturn:
        """A reload that began and failed: its pending move ends (``abort``) and, where slots
        were being rewritten, the daemon is dirty for them."""
        if self.pending is move:
            self.journal.append([_move_event(ev.ABORT, move, self._clock())])
            self.pending = None
            self._moves_seen += 1
        if layers:
            self.mark_content_dirty(
                layers,
                f"a reload to version {version} failed ({exc}); its slots may be half-written: "
                f"fix the cause, then `layout-ledger heal`, or restart the daemon",
            )
        raise ReloadFailed(f"the reload failed: {exc}") from exc

    def reload_recorded(
        self, engine_id: Any, layers: Sequence[int], new_version: Any, digest: str, reason: Any
    ) -> tuple[int, str]:
        """Replay a reload known by its layers, version and digest (as ``commit_recorded``)."""
        with self._lock:
            try:
                valid_id = self._engine_ids(engine_id)
                if layers:
                    move = rules.check_recorded_commit(self, valid_id, layers)
                elif self.pending is not None:
                    raise RequestRefused("a reload of no layer while a move was pending")
                else:
                    move = PendingMove(valid_id, (), self.version, self._clock())
                if not isinstance(new_version, int) or new_version <= self.version:
                    raise RequestRefused(
                        f"a reload to version {new_version} from version {self.version}"
                    )
            except RequestRefused as exc:
                self._refuse("reload", engine_id, exc)
            return self._committed(
                move,
                digest,
                None,
                None,
                kind=ev.RELOAD,
                new_version=new_version,
                reason=reason,
            )

    def heal(self, reloader: SlotReloader | None, cannot_heal: str | None = None) -> ReloadReport:
        """Reload the dirty layers' local slots from the checkpoint into the committed map; clean
        again (``heal`` event, same version and digest) only when every reloaded slot holds
        what the record names. Otherwise a ``heal_failed`` event names why and ``HealFailed``
        is raised; a heal that cannot run now is refused (``heal_refused``).

        The checkpoint is read and the slots written outside the lock (``reloading`` says so,
        and the rules refuse a repair, a second heal, or a reload meanwhile), so a file that
        blocks holds no request of the daemon. A kill during it leaves the daemon dirty (the
        mark is cleared only with the event)."""
        with self._lock:
            recorded = self.content
            try:
                if cannot_heal is None and (reloader is None or recorded is None):
                    cannot_heal = "it has no checkpoint reloader or records no fingerprints"
                layers = rules.check_heal(self, cannot_heal)
            except RequestRefused as exc:
                self._refuse("heal", None, exc)
            if reloader is None or recorded is None:  # checked above; for the type checker
                raise LedgerError("no reloader")
            layers = tuple(layer for layer in layers if layer in recorded.layers)
            the_map = self.physical_to_logical_map()
            slots = all_local_slots(layers, recorded.first_slot, rules.local_slot_count(recorded))
            mark = self.dirty
            self.reloading = Reloading(ev.HEAL, layers)
        # A kill during the read leaves the mark, so the daemon ends dirty.
        report, failure = self._read_unlocked(reloader, the_map, slots)
        with self._lock:
            self.reloading = None
            if self.end_state is not None:
                raise HealFailed(
                    "the daemon ended during the heal; it stays dirty in the ledger (restart it)"
                )
            if self.dirty is not mark:  # the rules refuse every change of it meanwhile
                raise LedgerError("the dirty mark changed during the heal; it was not recorded")
            if failure is not None or report is None:
                self._heal_failed(layers, f"the checkpoint could not be reloaded: {failure}")
            found = report.fingerprints.only(layers)
            differ = changed_slots(recorded.only(layers), found)
            problems = rules.committed_content_problems(the_map, found, self.known)
            if differ or problems or set(found.layers) != set(layers):
                what = describe_changes(differ, found, self.known, the_map) or "; ".join(
                    problems.values()
                )
                self._heal_failed(
                    layers,
                    f"after the reload, slots still differ from the record: {what or 'missing'} "
                    f"(has the checkpoint changed?)",
                )
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.HEAL,
                        layers=layers,
                        base_version=self.version,
                        new_version=self.version,
                        digest_after=self.digest,
                        reason=ev.clip(report.describe()),
                    )
                ]
            )
            self.dirty = None
            self._moves_seen += 1
            return report

    def _heal_failed(self, layers: tuple[int, ...], reason: str) -> NoReturn:
        self._append_heal_failed(layers, reason)
        raise HealFailed(
            f"the heal failed, the daemon stays dirty: {reason}; fix the cause, then "
            f"`layout-ledger heal`, or restart the daemon"
        )

    def _append_heal_failed(self, layers: Sequence[int], reason: str) -> None:
        self.journal.append(
            [
                ev.Event(
                    at=self._clock(),
                    kind=ev.HEAL_FAILED,
                    layers=tuple(layers),
                    base_version=self.version,
                    new_version=self.version,
                    reason=ev.clip(reason),
                )
            ]
        )

    def heal_recorded(self, layers: Sequence[int], reason: Any, failed: bool) -> None:
        """Replay a ``heal`` (or, ``failed``, a ``heal_failed``) event."""
        with self._lock:
            try:
                expected = rules.check_heal(self, None)
                if not failed and self.content is not None:
                    expected = tuple(x for x in expected if x in self.content.layers)
                if tuple(layers) != tuple(expected) and not failed:
                    raise RequestRefused(f"a heal of layers {list(layers)}, not {list(expected)}")
            except RequestRefused as exc:
                self._refuse("heal", None, exc)
            if failed:
                self._append_heal_failed(layers, str(reason or ""))
                return
            self.journal.append(
                [
                    ev.Event(
                        at=self._clock(),
                        kind=ev.HEAL,
                        layers=tuple(layers),
                        base_version=self.version,
                        new_version=self.version,
                        digest_after=self.digest,
                        reason=reason,
                    )
                ]
            )
            self.dirty = None
            self._moves_seen += 1

    def _fingerprints_now(
        self, fingerprints_of: Fingerprinter, layers: Sequence[int] | None = None
    ) -> LocalFingerprints:
        """The slots' fingerprints now (of ``layers``, or every layer); a device error is a
        ``LedgerError``: the daemon answers ``error``, never a verdict it did not reach."""
        try:
            found = fingerprints_of(layers)
        except Exception as exc:
            what = "this daemon's slots" if layers is None else f"the moved layers {list(layers)}"
            raise LedgerError(f"fingerprinting {what} failed: {exc}") from exc
        return found if layers is None else found.only(layers)

    def _check_committed_content(self, found: LocalFingerprints, verb: str = "commit") -> None:
        the_map = self.physical_to_logical_map()
        problems = rules.committed_content_problems(the_map, found, self.known)
        self._learn(the_map, found)
        if problems and self.dirty is None:
            self.mark_content_dirty(
                sorted(problems),
                f"after the {verb} of version {self.version}, slots do not hold the experts the "
                f"map names: " + "; ".join(problems.values()) + "; restart the daemon",
            )

    def _learn(self, the_map: Map, local: LocalFingerprints) -> None:
        for layer in local.layers:
            self.known.learn_slots(layer, the_map[layer], local)

    def shut_down(self) -> str:
        """The daemon stops: end the incarnation, dirty if the layout is unknown or in flux."""
        with self._lock:
            end_state = "dirty" if (self.dirty or self.pending) else "clean"
            reason = END_SHUTDOWN
            if self.pending is not None:
                reason += f" while a move of engine {self.pending.engine_id!r} was pending"
            return self._end(end_state, reason)

    def end_found_unended(self, at: str | None = None) -> str:
        """A later daemon start found this incarnation unended: its process died."""
        with self._lock:
            end_state = "dirty" if self.dirty is not None else "unknown"
            reason = END_FOUND_UNENDED
            if self.pending is not None:
                pending = self.pending
                reason += (
                    f"; a move was pending (engine {pending.engine_id!r}, layers "
                    f"{list(pending.layers)}, from version {pending.base_version})"
                )
            return self._end(end_state, reason, at)

    def _end(self, end_state: str, reason: str, at: str | None = None) -> str:
        """Append the end event (its reason starts with the end state) and stop."""
        if self.end_state is not None:
            raise LedgerError(f"incarnation {self.incarnation_id} has already ended")
        event = ev.Event(at=at or self._clock(), kind=ev.END, reason=f"{end_state}: {reason}")
        self.journal.append([event])
        self.end_state = end_state
        self._attached.clear()
        self._standbys.clear()
        self._leases.clear()
        return end_state

    # --- refusals -------------------------------------------------------------------------

    def record_refusal(self, verb: str, engine_id: Any, reason: str, *, busy: bool = False) -> None:
        """Append the one event a refused (or busy) request leaves; nothing else changes."""
        with self._lock:
            kind = ev.busy_kind(verb) if busy else ev.refused_kind(verb)
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

    def _refuse(self, verb: str, engine_id: Any, exc: LedgerError) -> NoReturn:
        """Append the refusal's one event, then raise it (an append that fails is only logged).

        The event names the engine only by an id a request may name (``rules``).
        """
        kind = ev.busy_kind(verb) if isinstance(exc, MoveBusy) else ev.refused_kind(verb)
        named = rules.recordable_engine_id(engine_id)
        try:
            self._append_refusal(kind, named, str(exc), self._clock())
        except LedgerError as failure:
            logger.error("could not record a refused %s in the ledger: %s", verb, failure)
        raise exc


def restored_start(restored_from: RestoredFrom | None, digest: str) -> int:
    """The version an incarnation starts at: 0, or the restored one, whose digest its map
    must give (a restore never names a map by another version's digest)."""
    if restored_from is None:
        return 0
    if restored_from.digest != digest:
        raise LedgerError(
            f"the restored version {restored_from.version} has digest "
            f"{restored_from.digest[:12]}... but the map to start with gives {digest[:12]}...; "
            f"the restore cannot start from it"
        )
    return restored_from.version


def _restore_events(restored_from: RestoredFrom | None, at: str) -> list[ev.Event]:
    """The ``restore`` event that follows a restored incarnation's start (none otherwise)."""
    if restored_from is None:
        return []
    return [
        ev.Event(
            at=at,
            kind=ev.RESTORE,
            base_version=restored_from.version,
            new_version=restored_from.version,
            digest_after=restored_from.digest,
            reason=restored_from.describe(),
        )
    ]


def _move_event(kind: str, move: PendingMove, at: str, **fields: Any) -> ev.Event:
    """The event of one step of ``move`` (begin, commit, abort, dirty, repair)."""
    return ev.Event(
        at=at,
        kind=kind,
        engine_id=move.engine_id,
        layers=move.layers,
        base_version=move.base_version,
        **fields,
    )
