"""One ledger's latest incarnation as the whole-engine commands see it (``fleet``, ``metrics``).

``read_overview`` reads, in one read transaction of a ``LedgerReader`` (read-only, never
blocking the daemon), the latest incarnation with its origin, its state as a restarted daemon
would derive it, the counters a monitor wants (commits, refusals by kind, the last commit's
time), and probes whether its daemon runs (``liveness``). ``read_overviews`` reads many and
turns a ledger that cannot be read into an ``UnreadableLedger`` saying why, so one bad file
never hides the others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from layout_ledger.core import events as ev
from layout_ledger.core.errors import LedgerError, LedgerFileError, LedgerStorageError
from layout_ledger.core.rules import BEGIN_CAUSE_OTHER, BEGIN_CAUSES, begin_cause
from layout_ledger.core.state import LayoutState
from layout_ledger.history.liveness import Liveness, daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.history.retirement import RetirementStep, current_retirement
from layout_ledger.store.replay import IncarnationReplay, ReplayMismatch, read_state
from layout_ledger.store.rows import (
    Incarnation,
    current_version,
    in_list,
    incarnation,
    reconstructible_from,
)

# The refusal event kinds an overview counts (each ``*_refused``, and the busy begin).
REFUSAL_KINDS: tuple[str, ...] = (
    *(ev.refused_kind(verb) for verb in ev.REFUSABLE_VERBS),
    ev.BEGIN_BUSY,
    ev.LEASE_BUSY,
)
# The causes refused and busy begins are counted by (``rules.begin_cause``): a bounded set.
# A busy begin whose reason names no busy cause (an older daemon's wording).
BUSY_CAUSE_OTHER = "busy_other"
BEGIN_CAUSE_NAMES: tuple[str, ...] = (
    *(cause for _, cause in BEGIN_CAUSES),
    BEGIN_CAUSE_OTHER,
    BUSY_CAUSE_OTHER,
)
# Of those, the causes of a begin answered busy (``busy_*``, and an operator's cordon): no
# refusal, the engine tries again later. Every other cause is a refusal (``begin_refused``).
BUSY_BEGIN_CAUSES: tuple[str, ...] = tuple(
    cause for cause in BEGIN_CAUSE_NAMES if cause.startswith("busy_") or cause == "cordoned"
)


def counted_begin_cause(kind: str, reason: str | None) -> str:
    """The cause a refused or busy begin is counted under: a busy one always under a busy
    cause, so that busy and refused begins never mix."""
    cause = begin_cause(reason)
    if kind == ev.BEGIN_BUSY and cause not in BUSY_BEGIN_CAUSES:
        return BUSY_CAUSE_OTHER
    return cause


@dataclass(frozen=True)
class LedgerOverview:
    """A ledger's latest incarnation: who wrote it, its state, counters, and liveness."""

    path: str
    incarnation: Incarnation
    state: LayoutState
    liveness: Liveness
    commits: int  # commit events in this incarnation
    refusals: Mapping[str, int]  # REFUSAL_KINDS -> how many (coalesced rows counted in full)
    last_commit_at: str  # when the current version was recorded (version 0: the start)
    retired: RetirementStep | None = None  # the retirement in force (``history.retirement``)
    # Refused and busy begins by cause (``BEGIN_CAUSE_NAMES``), counted in full.
    begin_causes: Mapping[str, int] = field(default_factory=dict)
    reconstructible_from: int = 0  # the oldest version whose whole map the rows still hold


@dataclass(frozen=True)
class UnreadableLedger:
    """A path whose ledger cannot be read, and why (the reader's message)."""

    path: str
    problem: str


def read_overview(path: str | os.PathLike[str]) -> LedgerOverview:
    """The latest incarnation of the ledger at ``path``; raises what the reader raises."""
    with LedgerReader(Path(path)) as ledger, ledger.connect() as conn:
        inc = incarnation(conn)
        state = read_state(conn, inc.incarnation_id)
        return LedgerOverview(
            path=os.fspath(path),
            incarnation=inc,
            state=state,
            liveness=daemon_liveness(path, inc, latest=True),
            commits=_commits(conn, inc.incarnation_id),
            refusals=_refusals(conn, inc.incarnation_id),
            last_commit_at=_last_commit_at(conn, inc.incarnation_id),
            retired=current_retirement(path, inc.incarnation_id),
            begin_causes=_begin_causes(conn, inc.incarnation_id),
            reconstructible_from=reconstructible_from(conn, inc.incarnation_id),
        )


def read_overviews(paths: Sequence[Path]) -> list[LedgerOverview | UnreadableLedger]:
    """Each ledger's overview, or why it cannot be read; in the order given."""
    read: list[LedgerOverview | UnreadableLedger] = []
    for path in paths:
        try:
            read.append(read_overview(path))
        except LedgerError as exc:
            read.append(UnreadableLedger(os.fspath(path), str(exc)))
        except (SQLAlchemyError, json.JSONDecodeError) as exc:
            problem = (
                f"the ledger {path} looks damaged ({type(exc).__name__}: {exc}); run "
                f"`layout-ledger verify {path}`"
            )
            read.append(UnreadableLedger(os.fspath(path), problem))
    return read


def require_one_readable(read: Sequence[LedgerOverview | UnreadableLedger]) -> None:
    """With no ledger readable there is nothing to show: raise why the first one is not."""
    unreadable = [item for item in read if isinstance(item, UnreadableLedger)]
    if unreadable and len(unreadable) == len(read):
        more = f" (and {len(unreadable) - 1} more unreadable)" if len(unreadable) > 1 else ""
        raise LedgerFileError(unreadable[0].problem + more)


def _commits(conn: Connection, incarnation_id: int) -> int:
    count = conn.execute(
        text("SELECT count(*) FROM events WHERE incarnation_id = :i AND kind = :k"),
        {"i": incarnation_id, "k": ev.COMMIT},
    ).scalar()
    return int(count or 0)


def _refusals(conn: Connection, incarnation_id: int) -> dict[str, int]:
    counted = {kind: 0 for kind in REFUSAL_KINDS}
    marks, kinds = in_list("kind", REFUSAL_KINDS)
    rows = conn.execute(
        text(
            "SELECT kind, sum(count) FROM events WHERE incarnation_id = :i "
            f"AND kind IN {marks} GROUP BY kind"
        ),
        {"i": incarnation_id, **kinds},
    )
    for kind, count in rows:
        counted[str(kind)] = int(count or 0)
    return counted


def _begin_causes(conn: Connection, incarnation_id: int) -> dict[str, int]:
    counted = dict.fromkeys(BEGIN_CAUSE_NAMES, 0)
    rows = conn.execute(
        text(
            "SELECT kind, reason, sum(count) FROM events WHERE incarnation_id = :i "
            "AND kind IN (:busy, :refused) GROUP BY kind, reason"
        ),
        {"i": incarnation_id, "busy": ev.BEGIN_BUSY, "refused": ev.refused_kind("begin")},
    )
    for kind, reason, count in rows:
        cause = counted_begin_cause(str(kind), None if reason is None else str(reason))
        counted[cause] += int(count or 0)
    return counted


def _last_commit_at(conn: Connection, incarnation_id: int) -> str:
    at = conn.execute(
        text(
            "SELECT committed_at FROM versions WHERE incarnation_id = :i "
            "ORDER BY version DESC LIMIT 1"
        ),
        {"i": incarnation_id},
    ).scalar()
    return str(at)


# --- incremental overviews (the exporter's scrapes) --------------------------------------------


@dataclass
class _Tracked:
    """What a cache keeps of one ledger between collections."""

    identity: tuple[int, int]  # the file's (st_dev, st_ino): a replaced file starts over
    replay: IncarnationReplay
    newest: tuple[int, str, str] | None  # (event_id, at, kind) of the newest event replayed
    newest_count: int  # its count (identical refusals are counted on that row)
    commits: int
    refusals: dict[str, int]
    begin_causes: dict[str, int]
    reconstructible_from: int


class OverviewCache:
    """Ledger overviews kept between collections, each advanced by the events stored since.

    ``read(path)`` costs O(new events) once a ledger was read: its latest incarnation's record
    is replayed on from the newest event seen (``store.replay.IncarnationReplay``), the counters
    grow by the new rows (and by the newest row's count, which identical refusals raise in
    place). A ledger starts over when its file is another (its inode), its latest incarnation
    changed, or the newest event seen is no longer the one stored (the file was rewritten). The
    overview's state has no map (``physical_to_logical_map`` empty): the exporter needs none.
    Not thread-safe: one collection at a time (``metrics.SharedCollection``).
    """

    def __init__(self) -> None:
        self._tracked: dict[str, _Tracked] = {}

    def forget_except(self, paths: Sequence[str]) -> None:
        """Drop what is kept of ledgers no PATH names any more."""
        keep = set(paths)
        for path in list(self._tracked):
            if path not in keep:
                del self._tracked[path]

    def read(self, path: str | os.PathLike[str]) -> LedgerOverview:
        key = os.fspath(path)
        try:
            return self._read(key)
        except BaseException:
            self._tracked.pop(key, None)
            raise

    def _read(self, key: str) -> LedgerOverview:
        with LedgerReader(Path(key)) as ledger, ledger.connect() as conn:
            info = os.stat(key)
            identity = (info.st_dev, info.st_ino)
            inc = incarnation(conn)
            tracked = self._tracked.get(key)
            if tracked is None or not _continues(conn, tracked, identity, inc.incarnation_id):
                current_version(conn, inc.incarnation_id)  # a missing version 0 is named first
                tracked = _Tracked(
                    identity,
                    IncarnationReplay(conn, inc, exact=False),
                    None,
                    0,
                    0,
                    {kind: 0 for kind in REFUSAL_KINDS},
                    {cause: 0 for cause in BEGIN_CAUSE_NAMES},
                    0,
                )
                self._tracked[key] = tracked
            _advance(conn, tracked)
            record = tracked.replay.record
            return LedgerOverview(
                path=key,
                incarnation=inc,
                state=record.state_with([]),
                liveness=daemon_liveness(key, inc, latest=True),
                commits=tracked.commits,
                refusals=dict(tracked.refusals),
                last_commit_at=_last_commit_at(conn, inc.incarnation_id),
                retired=current_retirement(key, inc.incarnation_id),
                begin_causes=dict(tracked.begin_causes),
                reconstructible_from=tracked.reconstructible_from,
            )


def _continues(
    conn: Connection, tracked: _Tracked, identity: tuple[int, int], incarnation_id: int
) -> bool:
    if tracked.identity != identity or tracked.replay.incarnation_id != incarnation_id:
        return False
    if tracked.newest is None:
        return True
    event_id, at, kind = tracked.newest
    row = conn.execute(
        text("SELECT at, kind FROM events WHERE event_id = :e AND incarnation_id = :i"),
        {"e": event_id, "i": incarnation_id},
    ).first()
    return row is not None and (str(row[0]), str(row[1])) == (at, kind)


def _advance(conn: Connection, tracked: _Tracked) -> None:
    """Replay the new events and grow the counters by them."""
    after = tracked.replay.last_event_id
    if tracked.newest is not None:  # identical refusals counted on the newest row meanwhile
        count = conn.execute(
            text("SELECT count FROM events WHERE event_id = :e"), {"e": tracked.newest[0]}
        ).scalar()
        grown = int(count or 0) - tracked.newest_count
        if grown > 0:
            _count_refusal(conn, tracked, tracked.newest[0], tracked.newest[2], grown)
            tracked.newest_count += grown
    try:
        new = tracked.replay.advance(conn)
    except ReplayMismatch as exc:
        raise LedgerStorageError(
            f"the history of incarnation {tracked.replay.incarnation_id} is not one the "
            f"daemon's rules write ({exc}); the ledger is damaged, run `layout-ledger verify`"
        ) from exc
    if not new:
        return
    rows = conn.execute(
        text(
            "SELECT event_id, kind, count, reason, base_version FROM events "
            "WHERE event_id > :after AND +incarnation_id = :i ORDER BY event_id"
        ),
        {"after": after, "i": tracked.replay.incarnation_id},
    ).all()
    for event_id, kind, count, reason, base_version in rows:
        if event_id > new[-1].event_id:
            break  # appended after the replay's read: the next collection's
        counted = int(count or 1)
        if kind == ev.COMMIT:
            tracked.commits += 1
        elif kind == ev.PRUNE:
            tracked.reconstructible_from = max(tracked.reconstructible_from, int(base_version or 0))
        elif kind in tracked.refusals:
            tracked.refusals[kind] += counted
            if kind in (ev.BEGIN_BUSY, ev.refused_kind("begin")):
                cause = counted_begin_cause(kind, reason)
                tracked.begin_causes[cause] = tracked.begin_causes.get(cause, 0) + counted
        tracked.newest_count = counted
    last = new[-1]
    tracked.newest = (last.event_id, last.event.at, last.event.kind)


def _count_refusal(
    conn: Connection, tracked: _Tracked, event_id: int, kind: str, grown: int
) -> None:
    if kind not in tracked.refusals:
        return
    tracked.refusals[kind] += grown
    if kind in (ev.BEGIN_BUSY, ev.refused_kind("begin")):
        reason = conn.execute(
            text("SELECT reason FROM events WHERE event_id = :e"), {"e": event_id}
        ).scalar()
        cause = counted_begin_cause(kind, None if reason is None else str(reason))
        tracked.begin_causes[cause] = tracked.begin_causes.get(cause, 0) + grown
