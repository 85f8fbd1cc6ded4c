"""What the read commands of ``layout-ledger`` collect, and how each is shown to a person.

One ``collect_*`` function per command returns a frozen dataclass; ``to_json()`` gives its
documented ``--json`` object (derived from its fields, ``layout_ledger.cli.json_shape``) and a
``render_*`` function its human lines (``layout_ledger.cli.app`` escapes the ledger's control
characters in them, ``layout_ledger.cli.terminal``). Nothing here prints,
parses arguments or exits: ``layout_ledger.cli.app`` does that. Every collect function reads inside
one read transaction of a ``LedgerReader``, so what it reports is one consistent snapshot even
while the daemon writes.

Queries use the forensic views (``ledger_events``) where they answer the question, so the CLI
reads the same stable interface an operator with ``sqlite3`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import Connection, text

from layout_ledger.cli import exit_codes
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.layer_ranges import LayerRanges
from layout_ledger.core import events as ev
from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.errors import LedgerError, LedgerStorageError
from layout_ledger.core.layout import Geometry, Map, layout_digest
from layout_ledger.core.state import DirtyMark, PendingMove
from layout_ledger.history.checks import VerifyReport
from layout_ledger.history.liveness import Liveness, daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.replay import replayed
from layout_ledger.store.rows import (
    Incarnation,
    current_version,
    fingerprints_at,
    in_list,
    incarnation,
    incarnations,
    map_at,
    reconstructible_from,
)
from layout_ledger.wire.protocol import pending_to_wire

# Every event kind the ledger writes (history --kind accepts exactly these).
EVENT_KINDS: tuple[str, ...] = ev.ALL_KINDS


# --- small shared pieces ------------------------------------------------------------------


def format_layers(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8`` (sorted; an operator reads ranges faster)."""
    ordered = sorted(set(layers))
    parts = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)


def check_layers(layers: LayerRanges | None, geometry: Geometry) -> list[int]:
    """The layers a command looks at: all when None, else each must exist in this ledger."""
    if layers is None:
        return list(range(geometry.num_layers))
    return list(layers.expand(geometry.num_layers))


def check_ep_size(ep_size: int, geometry: Geometry) -> None:
    """``--ep-size`` must split every layer's physical slots evenly into the EP ranks' shares,
    as an engine's EP size does (the one check of show, plot and export --check)."""
    if ep_size < 1:
        raise LedgerError(f"--ep-size must be at least 1, got {ep_size}")
    slots = geometry.num_physical_slots
    if slots % ep_size:
        raise LedgerError(
            f"--ep-size {ep_size} does not divide the {slots} physical slots per layer; pass the "
            f"EP size the engines run with"
        )


def _geometry_json(geometry: Geometry) -> JsonObject:
    return {
        "num_layers": geometry.num_layers,
        "num_physical_slots": geometry.num_physical_slots,
        "num_logical_experts": geometry.num_logical_experts,
    }


def version_digest(conn: Connection, incarnation_id: int, version: int) -> str:
    digest = conn.execute(
        text("SELECT digest FROM versions WHERE incarnation_id = :i AND version = :v"),
        {"i": incarnation_id, "v": version},
    ).scalar()
    if digest is None:
        raise LedgerError(f"incarnation {incarnation_id} has no version {version}")
    return str(digest)


@dataclass(frozen=True)
class HeldMap:
    """A whole map at one version of one incarnation, with the digest the ledger recorded."""

    incarnation: Incarnation
    version: int
    digest: str
    physical_to_logical_map: Map


def held_map(conn: Connection, incarnation_id: int | None, version: int | None) -> HeldMap:
    """The map at ``version`` (current when None) of an incarnation (latest when None)."""
    inc = incarnation(conn, incarnation_id)
    current, _ = current_version(conn, inc.incarnation_id)
    chosen = current if version is None else version
    the_map = map_at(conn, inc, chosen)
    return HeldMap(inc, chosen, version_digest(conn, inc.incarnation_id, chosen), the_map)


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventRow(JsonShaped):
    """One row of the ``ledger_events`` view: its columns, in its order."""

    event_id: int
    incarnation_id: int
    at: str
    kind: str
    engine_id: str | None
    layers: tuple[int, ...] | None
    base_version: int | None
    new_version: int | None
    digest_after: str | None
    reason: str | None
    count: int = 1  # identical consecutive refusals on one row
    last_at: str | None = None  # the time of the last of them
    chain: str | None = None  # the events' hash chain value (layout_ledger.store.chain)

    @classmethod
    def from_row(cls, row: Any) -> EventRow:
        return cls(
            event_id=int(row.event_id),
            incarnation_id=int(row.incarnation_id),
            at=str(row.at),
            kind=str(row.kind),
            engine_id=row.engine_id,
            layers=None if row.layers is None else tuple(json.loads(row.layers)),
            base_version=row.base_version,
            new_version=row.new_version,
            digest_after=row.digest_after,
            reason=row.reason,
            count=int(row.count),
            last_at=row.last_at,
            chain=row.chain,
        )


# The columns of an event row, in the view's order (history's --csv header).
EVENT_COLUMNS: tuple[str, ...] = tuple(column.name for column in fields(EventRow))
_EVENT_COLUMNS = ", ".join(EVENT_COLUMNS)


def render_event(event: EventRow) -> str:
    """One line per event: time, incarnation, id, kind, then only the fields it has."""
    parts = [f"{event.at}  inc={event.incarnation_id}  #{event.event_id}  {event.kind}"]
    if event.engine_id is not None:
        parts.append(f"engine={event.engine_id}")
    if event.layers is not None:
        parts.append(f"layers={format_layers(event.layers)}")
    if event.base_version is not None:
        parts.append(f"base={event.base_version}")
    if event.new_version is not None:
        parts.append(f"version={event.new_version}")
    if event.digest_after is not None:
        parts.append(f"digest={event.digest_after[:12]}")
    if event.count > 1:
        parts.append(f"x{event.count} until {event.last_at}")
    line = " ".join(parts)
    if event.reason:
        line += f"  ({event.reason})"
    return line


# --- status -------------------------------------------------------------------------------


def _incarnation_json(inc: Incarnation) -> JsonObject:
    return {
        "incarnation_id": inc.incarnation_id,
        "started_at": inc.started_at,
        "ended_at": inc.ended_at,
        "end_state": inc.end_state,
        "daemon_label": inc.daemon_label,
        "config_fingerprint": inc.config_fingerprint,
        **inc.origin.to_json(),
        **_geometry_json(inc.geometry),
    }


def _liveness_json(liveness: Liveness) -> JsonObject:
    return {"alive": liveness.alive}


def _dirty_json(dirty: DirtyMark | None) -> JsonObject:
    return {
        "dirty": dirty is not None,
        "dirty_reason": None if dirty is None else dirty.reason,
        "dirty_move": None
        if dirty is None or dirty.move is None
        else {**pending_to_wire(dirty.move), "at": dirty.at},
    }


def _pending_protocol(pending: PendingMove | None) -> JsonObject | None:
    return None if pending is None else pending_to_wire(pending)


def _pending_json(pending: PendingMove | None) -> JsonObject:
    return {
        "pending": _pending_protocol(pending),
        "pending_since": None if pending is None else pending.since,
    }


@dataclass(frozen=True)
class StatusReport(JsonShaped):
    """One incarnation's state, as a restarted daemon would derive it, plus what happened."""

    json_properties: ClassVar[tuple[str, ...]] = ("state",)

    path: str
    incarnation_count: int = field(metadata=json_field(key="incarnations"))
    incarnation: Incarnation = field(metadata=json_field(convert=_incarnation_json, spread=True))
    liveness: Liveness = field(metadata=json_field(convert=_liveness_json, spread=True))
    version: int
    digest: str
    reconstructible_from: int
    dirty: DirtyMark | None = field(metadata=json_field(convert=_dirty_json, spread=True))
    pending: PendingMove | None = field(metadata=json_field(convert=_pending_json, spread=True))
    attached: tuple[str, ...]
    non_following_fetch: bool
    refusals: int
    last_event: EventRow | None

    @property
    def state(self) -> str:
        """``dirty``, ``pending``, ``refusals`` or ``clean``: the worst first."""
        if self.dirty is not None:
            return "dirty"
        if self.pending is not None:
            return "pending"
        if self.refusals:
            return "refusals"
        return "clean"

    @property
    def exit_code(self) -> int:
        return {
            "dirty": exit_codes.DIRTY,
            "pending": exit_codes.PENDING_OR_REFUSALS,
            "refusals": exit_codes.PENDING_OR_REFUSALS,
            "clean": exit_codes.OK,
        }[self.state]


def collect_status(ledger: LedgerReader, incarnation_id: int | None = None) -> StatusReport:
    with ledger.connect() as conn:
        inc = incarnation(conn, incarnation_id)
        i = inc.incarnation_id
        version, digest = current_version(conn, i)
        derived = replayed(conn, inc)
        count = conn.execute(text("SELECT count(*) FROM incarnations")).scalar()
        refusals = conn.execute(
            text(
                "SELECT coalesce(sum(count), 0) FROM ledger_events "
                "WHERE incarnation_id = :i AND kind LIKE :k"
            ),
            {"i": i, "k": "%" + ev.REFUSED_SUFFIX},
        ).scalar()
        last = conn.execute(
            text(
                f"SELECT {_EVENT_COLUMNS} FROM ledger_events WHERE incarnation_id = :i "
                f"ORDER BY event_id DESC LIMIT 1"
            ),
            {"i": i},
        ).first()
        latest = conn.execute(text("SELECT max(incarnation_id) FROM incarnations")).scalar()
        return StatusReport(
            path=str(ledger.path),
            incarnation_count=int(count or 0),
            incarnation=inc,
            liveness=daemon_liveness(ledger.path, inc, latest=latest == i),
            version=version,
            digest=digest,
            reconstructible_from=reconstructible_from(conn, i),
            dirty=derived.dirty,
            pending=derived.pending,
            attached=tuple(derived.attached),
            non_following_fetch=derived.non_following_fetch,
            refusals=int(refusals or 0),
            last_event=None if last is None else EventRow.from_row(last),
        )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _pending_text(pending: PendingMove) -> str:
    return (
        f"engine {pending.engine_id!r}, layers {format_layers(pending.layers)}, "
        f"from version {pending.base_version}, since {pending.since}"
    )


def origin_rows(origin: IncarnationOrigin, config_fingerprint: str) -> list[tuple[str, str]]:
    """Where an incarnation ran, as ``status`` shows it: one row per question, the parts it
    knows (``not recorded`` for a daemon that recorded none, such as one older than 0004)."""
    process = " ".join(
        part
        for part in (
            None if origin.pid is None else f"pid {origin.pid}",
            None if origin.host is None else f"on host {origin.host}",
        )
        if part is not None
    )
    if origin.socket_path is not None:
        socket_text = f"socket {origin.socket_path}"
        process = f"{process}, {socket_text}" if process else socket_text
    device = [
        part
        for part in (
            None if origin.gpu_id is None else f"GPU {origin.gpu_id}",
            origin.device_uuid,
            None if origin.tp_rank is None else f"TP rank {origin.tp_rank}",
            None if origin.pp_rank is None else f"PP rank {origin.pp_rank}",
            None if origin.ep_rank is None else f"EP rank {origin.ep_rank}",
        )
        if part is not None
    ]
    software = [
        part
        for part in (
            None if origin.sglang_version is None else f"sglang {origin.sglang_version}",
            None if origin.plugin_version is None else f"plugin {origin.plugin_version}",
        )
        if part is not None
    ]
    return [
        ("daemon", process or _NOT_RECORDED),
        ("device", ", ".join(device) if device else _NOT_RECORDED),
        ("software", ", ".join(software) if software else _NOT_RECORDED),
        ("config fingerprint", config_fingerprint or _NOT_RECORDED),
    ]


_NOT_RECORDED = "not recorded"


def render_status(report: StatusReport) -> list[str]:
    inc = report.incarnation
    geometry = inc.geometry
    if inc.ended_at is None:
        life = f"started {inc.started_at}, {report.liveness.detail}"
    else:
        life = f"started {inc.started_at}, ended {inc.ended_at} ({inc.end_state})"
    if report.dirty is not None:
        dirty = f"yes, since {report.dirty.at}: {report.dirty.reason}"
    else:
        dirty = "no"
    pending = "none" if report.pending is None else _pending_text(report.pending)
    last = report.last_event
    last_text = (
        "none"
        if last is None
        else f"{last.at} {last.kind}" + (f" {last.engine_id}" if last.engine_id else "")
    )
    rows = [
        ("ledger", report.path),
        ("incarnation", f"{inc.incarnation_id} of {report.incarnation_count} ({life})"),
        *origin_rows(inc.origin, inc.config_fingerprint),
        (
            "geometry",
            f"{geometry.num_layers} layers x {geometry.num_physical_slots} physical slots, "
            f"{geometry.num_logical_experts} logical experts",
        ),
        ("version", str(report.version)),
        ("digest", report.digest),
        ("history held", f"versions {report.reconstructible_from}..{report.version}"),
        ("dirty", dirty),
        ("pending move", pending),
        ("attached", ", ".join(report.attached) if report.attached else "none"),
        ("non-following fetch", _yes_no(report.non_following_fetch)),
        ("refusals", str(report.refusals)),
        ("last event", last_text),
        ("state", report.state),
    ]
    width = max(len(label) for label, _ in rows) + 1
    return [f"{label + ':':<{width}} {value}" for label, value in rows]


# --- history ------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class HistoryReport(JsonShaped):
    path: str
    filter: HistoryFilter
    events: tuple[EventRow, ...]


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
    sql = f"SELECT {_EVENT_COLUMNS} FROM ledger_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY event_id DESC"
    if applied.last is not None:
        sql += " LIMIT :last"
        params["last"] = applied.last
    return sql, params


def collect_history(ledger: LedgerReader, wanted: HistoryRequest) -> HistoryReport:
    for kind in wanted.kinds:
        if kind not in EVENT_KINDS:
            raise LedgerError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
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
        )
        sql, params = _history_query(applied)
        rows = conn.execute(text(sql), params).all()
    events = tuple(EventRow.from_row(row) for row in reversed(rows))
    return HistoryReport(str(ledger.path), applied, events)


def render_history(report: HistoryReport) -> list[str]:
    if not report.events:
        return ["no events match"]
    return [render_event(event) for event in report.events]


def history_rows(report: HistoryReport) -> list[JsonObject]:
    """The events as rows of ``EVENT_COLUMNS`` (``--nl``, ``--csv``)."""
    return [event.to_json() for event in report.events]


# --- show ---------------------------------------------------------------------------------


def format_physical_to_logical_map(
    physical_to_logical_map: Map, ep_size: int, layer_ids: Sequence[int] | None = None
) -> str:
    """The text of sglang 0.5.23's ``format_physical_to_logical_map``
    (sglang/srt/eplb/expert_location.py:425), which ``format_expert_location_layout`` (:377)
    returns, reproduced without importing sglang or torch; tests/test_cli_sglang.py compares
    the two on the same maps. Like sglang's, it takes any ``ep_size >= 1`` (whole rows when it
    does not divide the slots); ``show`` passes only one that does (``check_ep_size``)."""
    num_layers = len(physical_to_logical_map)
    if num_layers == 0 or not physical_to_logical_map[0]:
        return "<empty>"
    num_physical = len(physical_to_logical_map[0])
    local, remainder = divmod(num_physical, ep_size)
    lines = [
        "physical_to_logical_map "
        f"num_layers={num_layers} "
        f"num_physical_experts={num_physical} "
        f"ep_size={ep_size}"
    ]
    for layer in range(num_layers) if layer_ids is None else layer_ids:
        row = physical_to_logical_map[layer]
        if remainder != 0:
            lines.append(f"layer={layer}: physical={json.dumps(row, separators=(',', ':'))}")
            continue
        chunks = [
            f"ep{rank}={json.dumps(row[rank * local : (rank + 1) * local], separators=(',', ':'))}"
            for rank in range(ep_size)
        ]
        lines.append(f"layer={layer}: " + " ".join(chunks))
    return "\n".join(lines)


def _held_json(held: HeldMap) -> JsonObject:
    return {
        "incarnation_id": held.incarnation.incarnation_id,
        "version": held.version,
        "digest": held.digest,
        **_geometry_json(held.incarnation.geometry),
    }


@dataclass(frozen=True)
class SlotPrint(JsonShaped):
    slot: int
    fingerprint: str


def _prints_json(prints: tuple[SlotPrint, ...] | None) -> JsonObject:
    return {} if prints is None else {"fingerprints": [p.to_json() for p in prints]}


@dataclass(frozen=True)
class ShownLayer(JsonShaped):
    layer: int
    slots: tuple[int, ...]
    # With --fingerprints: the daemon's local slots' fingerprints at that version.
    fingerprints: tuple[SlotPrint, ...] | None = field(
        default=None, metadata=json_field(convert=_prints_json, spread=True)
    )


@dataclass(frozen=True)
class ShowReport(JsonShaped):
    path: str
    held: HeldMap = field(metadata=json_field(convert=_held_json, spread=True))
    ep_size: int
    layers: tuple[ShownLayer, ...]


def collect_show(
    ledger: LedgerReader,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
    layers: LayerRanges | None = None,
    ep_size: int = 1,
    fingerprints: bool = False,
) -> ShowReport:
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
        recorded = fingerprints_at(conn, held.incarnation, held.version) if fingerprints else None
    check_ep_size(ep_size, held.incarnation.geometry)
    chosen = check_layers(layers, held.incarnation.geometry)
    shown = tuple(
        ShownLayer(
            layer,
            tuple(held.physical_to_logical_map[layer]),
            _slot_prints(recorded, layer) if fingerprints else None,
        )
        for layer in chosen
    )
    return ShowReport(str(ledger.path), held, ep_size, shown)


def _slot_prints(recorded: LocalFingerprints | None, layer: int) -> tuple[SlotPrint, ...]:
    if recorded is None or layer not in recorded.layers:
        return ()
    return tuple(
        SlotPrint(recorded.first_slot + index, value)
        for index, value in enumerate(recorded.layers[layer])
    )


def render_show(report: ShowReport) -> list[str]:
    layer_ids = [shown.layer for shown in report.layers]
    shown_text = format_physical_to_logical_map(
        report.held.physical_to_logical_map, report.ep_size, layer_ids
    )
    lines = shown_text.split("\n")
    printed = [shown for shown in report.layers if shown.fingerprints is not None]
    if printed:
        lines.append(
            f"slot fingerprints at version {report.held.version} (the daemon's own slots; the "
            f"first 12 of 64 hex digits; - none recorded)"
        )
        for shown in printed:
            cells = [f"{p.slot}={p.fingerprint[:12]}" for p in shown.fingerprints or ()]
            lines.append(f"layer={shown.layer}: " + (" ".join(cells) or "-"))
    return lines


# --- diff ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotChange(JsonShaped):
    slot: int
    before: int = field(metadata=json_field(key="from"))
    after: int = field(metadata=json_field(key="to"))


@dataclass(frozen=True)
class LayerChange(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("changed",)

    layer: int
    slots: tuple[SlotChange, ...]

    @property
    def changed(self) -> int:
        return len(self.slots)


# The columns of diff's rows (--nl, --csv): one changed slot each.
DIFF_COLUMNS: tuple[str, ...] = ("layer", "slot", "from", "to")


@dataclass(frozen=True)
class DiffReport(JsonShaped):
    json_properties: ClassVar[tuple[str, ...]] = ("changed_slots", "total_slots")

    path: str
    incarnation_id: int
    num_physical_slots: int = field(metadata=json_field(omit=True))
    from_version: int
    from_digest: str
    to_version: int
    to_digest: str
    layers: tuple[int, ...]
    changes: tuple[LayerChange, ...] = field(metadata=json_field(key="changed_layers"))

    @property
    def changed_slots(self) -> int:
        return sum(len(change.slots) for change in self.changes)

    @property
    def total_slots(self) -> int:
        return len(self.layers) * self.num_physical_slots

    def slot_rows(self) -> list[JsonObject]:
        """Every changed slot as a row of ``DIFF_COLUMNS``."""
        return [
            {"layer": change.layer, **slot.to_json()}
            for change in self.changes
            for slot in change.slots
        ]


def collect_diff(
    ledger: LedgerReader,
    from_version: int,
    to_version: int,
    *,
    incarnation_id: int | None = None,
    layers: LayerRanges | None = None,
) -> DiffReport:
    with ledger.connect() as conn:
        before = held_map(conn, incarnation_id, from_version)
        after = held_map(conn, before.incarnation.incarnation_id, to_version)
    geometry = before.incarnation.geometry
    chosen = check_layers(layers, geometry)
    changes = []
    for layer in chosen:
        old, new = before.physical_to_logical_map[layer], after.physical_to_logical_map[layer]
        moved = tuple(
            SlotChange(slot, a, b)
            for slot, (a, b) in enumerate(zip(old, new, strict=True))
            if a != b
        )
        if moved:
            changes.append(LayerChange(layer, moved))
    return DiffReport(
        path=str(ledger.path),
        incarnation_id=before.incarnation.incarnation_id,
        num_physical_slots=geometry.num_physical_slots,
        from_version=from_version,
        from_digest=before.digest,
        to_version=to_version,
        to_digest=after.digest,
        layers=tuple(chosen),
        changes=tuple(changes),
    )


def render_diff(report: DiffReport, *, slots: bool = False) -> list[str]:
    """sglang's ``format_expert_location_layout_diff`` lines under a header; ``slots`` adds one
    line per changed slot."""
    lines = [
        f"incarnation {report.incarnation_id}: version {report.from_version} "
        f"(digest {report.from_digest[:12]}) -> version {report.to_version} "
        f"(digest {report.to_digest[:12]})",
        f"changed_physical_slots={report.changed_slots}/{report.total_slots}",
    ]
    if not report.changes:
        lines.append("changed_layers=[]")
    for change in report.changes:
        lines.append(
            f"layer={change.layer}: changed={len(change.slots)}/{report.num_physical_slots}"
        )
        if slots:
            lines.extend(f"  slot {s.slot}: {s.before} -> {s.after}" for s in change.slots)
    return lines


# --- export -------------------------------------------------------------------------------

# sglang reads --init-expert-location as a file only when the name ends in .json (or .pt);
# any other value is parsed as inline JSON (sglang/srt/eplb/expert_location.py:775-780).
EXPORT_SUFFIX = ".json"


@dataclass(frozen=True)
class ExportReport(JsonShaped):
    path: str
    output: str
    incarnation_id: int
    version: int
    digest: str
    geometry: Geometry = field(metadata=json_field(convert=_geometry_json, spread=True))
    dirty: bool
    pending: PendingMove | None = field(metadata=json_field(convert=_pending_protocol))
    # False until the file is in place, and for good when export --check refused it.
    written: bool = field(default=False, metadata=json_field(omit=True))


def init_expert_location_text(physical_to_logical_map: Map) -> str:
    """The file ``--init-expert-location`` reads: one key (sglang passes every key of the file
    to ``ExpertLocationMetadata.init_by_mapping`` as a keyword, expert_location.py:786-790),
    one layer per line."""
    rows = ",\n".join(
        "    " + json.dumps(row, separators=(",", ":")) for row in physical_to_logical_map
    )
    return '{\n  "physical_to_logical_map": [\n' + rows + "\n  ]\n}\n"


def _sync_directory(output: Path) -> None:
    try:
        fd = os.open(output.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise LedgerError(
            f"wrote {output} but could not sync its directory to disk: {exc.strerror}"
        ) from exc


def write_atomically(
    output: Path,
    data: bytes,
    accept: Callable[[Path], bool] | None = None,
    *,
    temporary_suffix: str | None = None,
) -> bool:
    """Write ``data`` to ``output`` through a temporary file in its directory (same suffix, or
    ``temporary_suffix``), synced to disk, then a rename, then a sync of the directory.
    ``accept`` sees the complete temporary file first: when it returns False or raises, the
    temporary file is removed and ``output`` stays as it was. Returns whether ``output`` was
    written."""
    directory = output.parent
    if not directory.is_dir():
        raise LedgerError(f"cannot write {output}: the directory {directory} does not exist")
    try:
        suffix = output.suffix if temporary_suffix is None else temporary_suffix
        fd, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=suffix, dir=directory)
    except OSError as exc:
        raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.chmod(0o644)
        if accept is not None and not accept(temporary):
            temporary.unlink()
            return False
        os.replace(temporary, output)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        if isinstance(exc, OSError):
            raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
        raise
    _sync_directory(output)
    return True


def read_export(
    ledger: LedgerReader,
    output: str | Path,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
) -> tuple[ExportReport, Map]:
    """What ``export`` would write (nothing written yet): the report and the map, after the
    output's name and the rows' digest are checked."""
    output = Path(output)
    if output.suffix != EXPORT_SUFFIX:
        raise LedgerError(
            f"name the output file *{EXPORT_SUFFIX} (got {output}): sglang reads "
            f"--init-expert-location as a file only when the name ends in {EXPORT_SUFFIX}"
        )
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
        i = held.incarnation.incarnation_id
        derived = replayed(conn, held.incarnation)
        dirty, pending = derived.dirty is not None, derived.pending
    if layout_digest(held.physical_to_logical_map) != held.digest:
        raise LedgerStorageError(
            f"the rows of incarnation {i} version {held.version} do not give its recorded "
            f"digest {held.digest[:12]}; nothing exported. Run `layout-ledger verify "
            f"{ledger.path}`"
        )
    report = ExportReport(
        path=str(ledger.path),
        output=str(output),
        incarnation_id=i,
        version=held.version,
        digest=held.digest,
        geometry=held.incarnation.geometry,
        dirty=dirty,
        pending=pending,
    )
    return report, held.physical_to_logical_map


def write_export(
    report: ExportReport, the_map: Map, accept: Callable[[Path], bool] | None = None
) -> ExportReport:
    """Write the map as ``report.output`` (``write_atomically``; ``accept`` may refuse it)."""
    data = init_expert_location_text(the_map).encode()
    written = write_atomically(Path(report.output), data, accept)
    return dataclasses.replace(report, written=written)


def export_map(
    ledger: LedgerReader,
    output: str | Path,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
) -> tuple[ExportReport, Map]:
    """Write the map at ``version`` as an ``--init-expert-location`` file; returns the report
    and the map written."""
    report, the_map = read_export(ledger, output, incarnation_id=incarnation_id, version=version)
    return write_export(report, the_map), the_map


def render_export(report: ExportReport) -> list[str]:
    geometry = report.geometry
    what = (
        f"incarnation {report.incarnation_id} version {report.version} "
        f"(digest {report.digest[:12]}), {geometry.num_layers} layers x "
        f"{geometry.num_physical_slots} physical slots"
    )
    if report.written:
        lines = [
            f"wrote {report.output}: {what}",
            f"start an engine with it: --init-expert-location {report.output}",
        ]
    else:
        lines = [f"checked {report.output}, not written: {what}"]
    if report.dirty:
        lines.append(
            "note: this incarnation is dirty; the file holds its last committed layout, not "
            "necessarily what the daemon's memory holds"
        )
    if report.pending is not None:
        lines.append(
            f"note: a move is pending ({_pending_text(report.pending)}); the file holds the "
            f"last committed layout, which that move changes when it commits"
        )
    return lines


def render_verify(report: VerifyReport) -> list[str]:
    lines = [f"ledger {report.path} (schema {report.schema_revision})"]
    for result in report.checks:
        verdict = "ok" if result.ok else "INCONSISTENT"
        detail = "" if result.ok and result.detail == "ok" else f": {result.detail}"
        lines.append(f"{result.label}: {verdict}{detail}")
    if report.ok:
        lines.append("verified: no inconsistency")
    else:
        lines.append(
            f"{len(report.inconsistencies)} inconsistent; first: {report.first_inconsistency}"
        )
    return lines
