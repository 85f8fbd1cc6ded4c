"""``layout-ledger history``: the events, filtered by incarnation, engine, layer, kind and time.

Read from the ``ledger_events`` view; printed as lines, ``--json``, or one row per event
(``--nl``, ``--csv``). ``--after-event N`` is a poller's cursor (events after the last it saw);
``--follow`` prints new events as they are committed (``cli.follow``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from layout_ledger.cli import exit_codes
from layout_ledger.cli.event_rows import EVENT_COLUMNS, EVENT_COLUMNS_SQL, EventRow, render_event
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.layer_ranges import LayerRanges
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.cli.row_formats import write_rows
from layout_ledger.cli.terminal import printable
from layout_ledger.core import events as ev
from layout_ledger.core.errors import LedgerError
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.rows import in_list, incarnation, incarnations


def run(args: argparse.Namespace) -> int:
    wanted = HistoryRequest(
        incarnation_id=args.incarnation,
        engine=args.engine,
        layers=args.layers,
        kinds=tuple(dict.fromkeys(args.kind or ())),
        since=args.since,
        until=args.until,
        last=args.last,
        after_event=args.after_event,
        reverse=args.reverse,
    )
    paths = expand_ledger_paths(args.ledger)
    # Text names each line's rank when there are many ledgers; --json, --nl and --csv have one
    # shape whatever names the ledgers (one ledger is a timeline of one).
    many = len(paths) > 1
    if many and wanted.after_event is not None:
        print_error(
            "history",
            "--after-event names an event of one ledger (event ids are each ledger's own); "
            "poll each ledger with its own cursor",
        )
        return exit_codes.UNUSABLE
    if args.follow:
        return _follow(args, wanted, paths, many)
    merged = collect_merged(paths, wanted)
    render = render_merged if many else (lambda item: render_event(item.event))
    lines = [render(event) for event in merged.events] or ["no events match"]
    emit(args, merged.to_json(), lines, (MERGED_COLUMNS, merged_rows(merged.events)))
    return exit_codes.OK


@dataclass(frozen=True)
class HistoryRequest:
    """What ``history`` was asked for, before it is checked against the ledger."""

    incarnation_id: int | None = None
    engine: str | None = None  # an engine_id, or a unique prefix of one
    layers: LayerRanges | None = None
    kinds: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    last: int | None = None
    after_event: int | None = None  # only events whose event_id is above this
    reverse: bool = False  # newest first


@dataclass(frozen=True)
class HistoryFilter(JsonShaped):
    """The filter ``history`` applied, resolved against the ledger: the events every given
    filter matches (since <= at < until); no layers and no kinds mean any."""

    incarnation_id: int | None = None
    engine_id: str | None = None
    layers: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    last: int | None = None
    after_event: int | None = None
    reverse: bool = False


@dataclass(frozen=True)
class HistoryReport(JsonShaped):
    path: str
    filter: HistoryFilter
    events: tuple[EventRow, ...]
    # The ledger's highest event_id in the snapshot read (0: no event): the --after-event a
    # poller passes next, whatever the filter matched.
    cursor: int = 0


def resolve_engine(conn: Connection, asked: str, incarnation_id: int | None = None) -> str:
    """The engine_id ``--engine`` means: ``asked`` itself when an event names it, else the one
    engine_id it begins; an ambiguous prefix is an error listing the matches, and a prefix of
    nothing stays as asked (no event matches it)."""
    sql = (
        "SELECT DISTINCT engine_id FROM ledger_events WHERE substr(engine_id, 1, :length) = :asked"
    )
    params: dict[str, Any] = {"length": len(asked), "asked": asked}
    if incarnation_id is not None:
        sql += " AND incarnation_id = :inc"
        params["inc"] = incarnation_id
    matches = sorted(str(engine) for engine in conn.execute(text(sql), params).scalars())
    if asked in matches or not matches:
        return asked
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(repr(engine) for engine in matches)
    raise LedgerError(
        f"--engine {asked!r} matches {len(matches)} engines: {listed}; give more of the id"
    )


def _history_query(applied: HistoryFilter) -> tuple[str, dict[str, Any]]:
    where = []
    params: dict[str, Any] = {}
    if applied.incarnation_id is not None:
        where.append("incarnation_id = :inc")
        params["inc"] = applied.incarnation_id
    if applied.engine_id is not None:
        where.append("engine_id = :engine")
        params["engine"] = applied.engine_id
    if applied.kinds:
        marks, kinds = in_list("kind", applied.kinds)
        where.append(f"kind IN {marks}")
        params.update(kinds)
    if applied.layers:
        marks, layers = in_list("layer", applied.layers)
        where.append(
            f"EXISTS (SELECT 1 FROM json_each(ledger_events.layers) j WHERE j.value IN {marks})"
        )
        params.update(layers)
    if applied.since is not None:
        where.append("at >= :since")
        params["since"] = applied.since
    if applied.until is not None:
        where.append("at < :until")
        params["until"] = applied.until
    if applied.after_event is not None:
        where.append("event_id > :after")
        params["after"] = applied.after_event
    sql = f"SELECT {EVENT_COLUMNS_SQL} FROM ledger_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY event_id DESC"
    if applied.last is not None:
        sql += " LIMIT :last"
        params["last"] = applied.last
    return sql, params


def collect_history(ledger: LedgerReader, wanted: HistoryRequest) -> HistoryReport:
    for kind in wanted.kinds:
        if kind not in ev.ALL_KINDS:
            raise LedgerError(f"unknown event kind {kind!r}; expected one of {ev.ALL_KINDS}")
    if wanted.last is not None and wanted.last < 1:
        raise LedgerError(f"--last must be at least 1, got {wanted.last}")
    with ledger.connect() as conn:
        if wanted.incarnation_id is not None:  # names a missing incarnation
            chosen = [incarnation(conn, wanted.incarnation_id)]
        else:
            chosen = incarnations(conn)
        num_layers = max((inc.geometry.num_layers for inc in chosen), default=0)
        applied = HistoryFilter(
            incarnation_id=wanted.incarnation_id,
            engine_id=(
                None
                if wanted.engine is None
                else resolve_engine(conn, wanted.engine, wanted.incarnation_id)
            ),
            layers=() if wanted.layers is None else wanted.layers.expand(num_layers),
            kinds=wanted.kinds,
            since=wanted.since,
            until=wanted.until,
            last=wanted.last,
            after_event=wanted.after_event,
            reverse=wanted.reverse,
        )
        sql, params = _history_query(applied)
        rows = conn.execute(text(sql), params).all()
        cursor = conn.execute(text("SELECT coalesce(max(event_id), 0) FROM events")).scalar()
    newest_first = tuple(EventRow.from_row(row) for row in rows)
    events = newest_first if wanted.reverse else newest_first[::-1]
    return HistoryReport(str(ledger.path), applied, events, int(cursor or 0))


# Without --last, --since or --after-event, --follow first prints this many (tail -f's habit).
FOLLOW_FIRST = 10


def _follow(args: argparse.Namespace, wanted: HistoryRequest, paths: list[Path], many: bool) -> int:
    """The matching events, then each new one as it is committed (``cli.follow``), each once:
    every read of a ledger asks for the events after the newest one its previous read saw.
    Many ledgers: one merged timeline, each line naming its rank."""
    from layout_ledger.cli.follow import follow_changes

    if wanted.last is None and wanted.since is None and wanted.after_event is None:
        wanted = dataclasses.replace(wanted, last=FOLLOW_FIRST)
    # One JSON object a line, as `journalctl -f -o json` writes them: --json follows as --nl.
    form = "nl" if args.json else getattr(args, "rows", None)
    asked = [wanted] * len(paths)
    ranks: dict[int, int] = {}
    first = [True]

    def read_new(changed: list[int]) -> None:
        found: list[MergedEvent] = []
        for index in changed:
            with LedgerReader(paths[index]) as ledger:
                report = collect_history(ledger, asked[index])
                if index not in ranks:
                    ranks[index] = _rank_of(ledger, index)
            found.extend(MergedEvent(str(paths[index]), ranks[index], e) for e in report.events)
            # Next: after this read's newest event, the engine as it resolved, no --last.
            asked[index] = dataclasses.replace(
                asked[index], engine=report.filter.engine_id, last=None, after_event=report.cursor
            )
        found.sort(key=_merge_key)
        if first[0] and wanted.last is not None:
            found = found[-wanted.last :]
        _write_followed(form, found, many, header=first[0])
        first[0] = False

    return follow_changes(paths, read_new)


def _write_followed(
    form: str | None, found: list[MergedEvent], many: bool, *, header: bool
) -> None:
    if form is not None:
        write_rows(sys.stdout, form, MERGED_COLUMNS, merged_rows(found), header=header)
    else:
        render = render_merged if many else (lambda item: render_event(item.event))
        sys.stdout.write("".join(printable(render(item)) + "\n" for item in found))
    sys.stdout.flush()


# --- many ledgers: one merged timeline --------------------------------------------------------

# A merged row: the ledger and its rank, then the event's columns.
MERGED_COLUMNS: tuple[str, ...] = ("ledger", "rank", *EVENT_COLUMNS)


@dataclass(frozen=True)
class MergedEvent(JsonShaped):
    """An event of one of many ledgers: which ledger, its rank, the event (its columns)."""

    ledger: str
    rank: int  # the TP rank its daemon recorded, else the ledger's place in the list
    event: EventRow = dataclasses.field(metadata=json_field(spread=True))


@dataclass(frozen=True)
class MergedHistory(JsonShaped):
    """``history`` of many ledgers: their events in one timeline (by time, then by the order
    the ledgers were named), each naming its ledger and rank; each ledger's cursor."""

    ledgers: tuple[JsonObject, ...]  # {path, rank, cursor}
    filter: HistoryFilter
    events: tuple[MergedEvent, ...]


def _rank_of(ledger: LedgerReader, index: int) -> int:
    with ledger.connect() as conn:
        tp_rank = incarnation(conn).origin.tp_rank
    return index if tp_rank is None else tp_rank


def _merge_key(item: MergedEvent) -> tuple[str, str, int]:
    return (item.event.at, item.ledger, item.event.event_id)


def collect_merged(paths: list[Path], wanted: HistoryRequest) -> MergedHistory:
    """Each ledger's matching events (its last N with --last), merged by time; the last N of
    the merge with --last, newest first with --reverse."""
    per_ledger = dataclasses.replace(wanted, reverse=False)
    found: list[MergedEvent] = []
    ledgers: list[JsonObject] = []
    applied: HistoryFilter | None = None
    for index, path in enumerate(paths):
        with LedgerReader(path) as ledger:
            report = collect_history(ledger, per_ledger)
            rank = _rank_of(ledger, index)
        applied = applied or report.filter
        ledgers.append({"path": str(path), "rank": rank, "cursor": report.cursor})
        found.extend(MergedEvent(str(path), rank, event) for event in report.events)
    found.sort(key=_merge_key)
    if wanted.last is not None:
        found = found[-wanted.last :]
    if wanted.reverse:
        found.reverse()
    return MergedHistory(tuple(ledgers), applied or HistoryFilter(), tuple(found))


def render_merged(item: MergedEvent) -> str:
    return f"rank {item.rank}  {render_event(item.event)}"


def merged_rows(found: Sequence[MergedEvent]) -> list[JsonObject]:
    return [item.to_json() for item in found]
