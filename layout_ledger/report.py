"""What the read commands of ``layout-ledger`` collect, and how each is shown to a person.

One ``collect_*`` function per command returns a frozen dataclass; ``to_json()`` gives its
documented ``--json`` object and a ``render_*`` function its human text. Nothing here prints,
parses arguments or exits: ``layout_ledger.cli`` does that. Every collect function reads inside
one read transaction of a ``LedgerReader``, so what it reports is one consistent snapshot even
while the daemon writes.

Queries use the forensic views (``ledger_events``) where they answer the question, so the CLI
reads the same stable interface an operator with ``sqlite3`` does.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, text

from layout_ledger import events as ev
from layout_ledger import exit_codes, reader
from layout_ledger.errors import LedgerError, LedgerStorageError
from layout_ledger.layout import Geometry, Map, layout_digest
from layout_ledger.protocol import PendingMove
from layout_ledger.reader import Incarnation, LedgerReader
from layout_ledger.state import DirtyMark

JsonObject = dict[str, Any]

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


def check_layers(layers: Sequence[int] | None, geometry: Geometry) -> list[int]:
    """The layers a command looks at: all when None, else each must exist in this ledger."""
    if layers is None:
        return list(range(geometry.num_layers))
    for layer in layers:
        if not 0 <= layer < geometry.num_layers:
            raise LedgerError(
                f"layer {layer} does not exist: this ledger's maps have layers "
                f"0..{geometry.num_layers - 1}"
            )
    return list(layers)


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
    inc = reader.incarnation(conn, incarnation_id)
    current, _ = reader.current_version(conn, inc.incarnation_id)
    chosen = current if version is None else version
    the_map = reader.map_at(conn, inc, chosen)
    return HeldMap(inc, chosen, version_digest(conn, inc.incarnation_id, chosen), the_map)


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventRow:
    """One row of the ``ledger_events`` view."""

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
        )

    def to_json(self) -> JsonObject:
        return {
            "event_id": self.event_id,
            "incarnation_id": self.incarnation_id,
            "at": self.at,
            "kind": self.kind,
            "engine_id": self.engine_id,
            "layers": None if self.layers is None else list(self.layers),
            "base_version": self.base_version,
            "new_version": self.new_version,
            "digest_after": self.digest_after,
            "reason": self.reason,
        }


_EVENT_COLUMNS = (
    "event_id, incarnation_id, at, kind, engine_id, layers, base_version, new_version, "
    "digest_after, reason"
)


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
    line = " ".join(parts)
    if event.reason:
        line += f"  ({event.reason})"
    return line


# --- status -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusReport:
    """One incarnation's state, as a restarted daemon would derive it, plus what happened."""

    path: str
    incarnation_count: int
    incarnation: Incarnation
    version: int
    digest: str
    reconstructible_from: int
    dirty: DirtyMark | None
    pending: PendingMove | None
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

    def to_json(self) -> JsonObject:
        inc = self.incarnation
        dirty = self.dirty
        return {
            "path": self.path,
            "incarnation_id": inc.incarnation_id,
            "incarnations": self.incarnation_count,
            "started_at": inc.started_at,
            "ended_at": inc.ended_at,
            "end_state": inc.end_state,
            "daemon_label": inc.daemon_label,
            **_geometry_json(inc.geometry),
            "version": self.version,
            "digest": self.digest,
            "reconstructible_from": self.reconstructible_from,
            "dirty": dirty is not None,
            "dirty_reason": None if dirty is None else dirty.reason,
            "dirty_move": None if dirty is None else {**dirty.move.to_wire(), "at": dirty.at},
            "pending": None if self.pending is None else self.pending.to_wire(),
            "pending_since": None if self.pending is None else self.pending.since,
            "attached": list(self.attached),
            "non_following_fetch": self.non_following_fetch,
            "refusals": self.refusals,
            "last_event": None if self.last_event is None else self.last_event.to_json(),
            "state": self.state,
        }


def collect_status(ledger: LedgerReader, incarnation_id: int | None = None) -> StatusReport:
    with ledger.connect() as conn:
        inc = reader.incarnation(conn, incarnation_id)
        i = inc.incarnation_id
        version, digest = reader.current_version(conn, i)
        derived = reader.replayed(conn, inc)
        count = conn.execute(text("SELECT count(*) FROM incarnations")).scalar()
        refusals = conn.execute(
            text("SELECT count(*) FROM ledger_events WHERE incarnation_id = :i AND kind LIKE :k"),
            {"i": i, "k": "%" + ev.REFUSED_SUFFIX},
        ).scalar()
        last = conn.execute(
            text(
                f"SELECT {_EVENT_COLUMNS} FROM ledger_events WHERE incarnation_id = :i "
                f"ORDER BY event_id DESC LIMIT 1"
            ),
            {"i": i},
        ).first()
        return StatusReport(
            path=str(ledger.path),
            incarnation_count=int(count or 0),
            incarnation=inc,
            version=version,
            digest=digest,
            reconstructible_from=reader.reconstructible_from(conn, i),
            dirty=derived.dirty,
            pending=derived.pending,
            attached=tuple(derived.attached),
            non_following_fetch=derived.non_following_fetch,
            refusals=int(refusals or 0),
            last_event=None if last is None else EventRow.from_row(last),
        )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def render_status(report: StatusReport) -> str:
    inc = report.incarnation
    geometry = inc.geometry
    if inc.ended_at is None:
        life = f"started {inc.started_at}, running"
    else:
        life = f"started {inc.started_at}, ended {inc.ended_at} ({inc.end_state})"
    if report.dirty is not None:
        dirty = f"yes, since {report.dirty.at}: {report.dirty.reason}"
    else:
        dirty = "no"
    pending = report.pending
    pending_text = (
        "none"
        if pending is None
        else f"engine {pending.engine_id!r}, layers {format_layers(pending.layers)}, "
        f"from version {pending.base_version}, since {pending.since}"
    )
    last = report.last_event
    last_text = (
        "none"
        if last is None
        else f"{last.at} {last.kind}" + (f" {last.engine_id}" if last.engine_id else "")
    )
    rows = [
        ("ledger", report.path),
        ("incarnation", f"{inc.incarnation_id} of {report.incarnation_count} ({life})"),
        (
            "geometry",
            f"{geometry.num_layers} layers x {geometry.num_physical_slots} physical slots, "
            f"{geometry.num_logical_experts} logical experts",
        ),
        ("version", str(report.version)),
        ("digest", report.digest),
        ("history held", f"versions {report.reconstructible_from}..{report.version}"),
        ("dirty", dirty),
        ("pending move", pending_text),
        ("attached", ", ".join(report.attached) if report.attached else "none"),
        ("non-following fetch", _yes_no(report.non_following_fetch)),
        ("refusals", str(report.refusals)),
        ("last event", last_text),
        ("state", report.state),
    ]
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(f"{label + ':':<{width}} {value}" for label, value in rows)


# --- history ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HistoryFilter:
    """Which events ``history`` shows: those every given filter matches (since <= at < until)."""

    incarnation_id: int | None = None
    engine_id: str | None = None
    layers: tuple[int, ...] = ()
    kinds: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    last: int | None = None

    def to_json(self) -> JsonObject:
        return {
            "incarnation_id": self.incarnation_id,
            "engine_id": self.engine_id,
            "layers": list(self.layers),
            "kinds": list(self.kinds),
            "since": self.since,
            "until": self.until,
            "last": self.last,
        }


@dataclass(frozen=True)
class HistoryReport:
    path: str
    filter: HistoryFilter
    events: tuple[EventRow, ...]

    def to_json(self) -> JsonObject:
        return {
            "path": self.path,
            "filter": self.filter.to_json(),
            "events": [event.to_json() for event in self.events],
        }


def collect_history(ledger: LedgerReader, wanted: HistoryFilter) -> HistoryReport:
    for kind in wanted.kinds:
        if kind not in EVENT_KINDS:
            raise LedgerError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
    if wanted.last is not None and wanted.last < 1:
        raise LedgerError(f"--last must be at least 1, got {wanted.last}")
    where = []
    params: dict[str, Any] = {}
    if wanted.incarnation_id is not None:
        where.append("incarnation_id = :inc")
        params["inc"] = wanted.incarnation_id
    if wanted.engine_id is not None:
        where.append("engine_id = :engine")
        params["engine"] = wanted.engine_id
    if wanted.kinds:
        marks = ", ".join(f":kind{n}" for n in range(len(wanted.kinds)))
        where.append(f"kind IN ({marks})")
        params.update({f"kind{n}": kind for n, kind in enumerate(wanted.kinds)})
    if wanted.layers:
        marks = ", ".join(f":layer{n}" for n in range(len(wanted.layers)))
        where.append(
            f"EXISTS (SELECT 1 FROM json_each(ledger_events.layers) j WHERE j.value IN ({marks}))"
        )
        params.update({f"layer{n}": layer for n, layer in enumerate(wanted.layers)})
    if wanted.since is not None:
        where.append("at >= :since")
        params["since"] = wanted.since
    if wanted.until is not None:
        where.append("at < :until")
        params["until"] = wanted.until
    sql = f"SELECT {_EVENT_COLUMNS} FROM ledger_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY event_id DESC"
    if wanted.last is not None:
        sql += " LIMIT :last"
        params["last"] = wanted.last
    with ledger.connect() as conn:
        if wanted.incarnation_id is not None:
            reader.incarnation(conn, wanted.incarnation_id)  # names a missing incarnation
        rows = conn.execute(text(sql), params).all()
    events = tuple(EventRow.from_row(row) for row in reversed(rows))
    return HistoryReport(str(ledger.path), wanted, events)


def render_history(report: HistoryReport) -> str:
    if not report.events:
        return "no events match"
    return "\n".join(render_event(event) for event in report.events)


# --- show ---------------------------------------------------------------------------------


def format_physical_to_logical_map(
    physical_to_logical_map: Map, ep_size: int, layer_ids: Sequence[int] | None = None
) -> str:
    """The text of sglang 0.5.23's ``format_physical_to_logical_map``
    (sglang/srt/eplb/expert_location.py:425), which ``format_expert_location_layout`` (:377)
    returns, reproduced without importing sglang or torch; tests/test_cli_sglang.py compares
    the two on the same maps."""
    if ep_size < 1:
        raise LedgerError(f"--ep-size must be at least 1, got {ep_size}")
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


@dataclass(frozen=True)
class ShowReport:
    path: str
    held: HeldMap
    ep_size: int
    layers: tuple[int, ...]

    def to_json(self) -> JsonObject:
        held = self.held
        return {
            "path": self.path,
            "incarnation_id": held.incarnation.incarnation_id,
            "version": held.version,
            "digest": held.digest,
            **_geometry_json(held.incarnation.geometry),
            "ep_size": self.ep_size,
            "layers": [
                {"layer": layer, "slots": list(held.physical_to_logical_map[layer])}
                for layer in self.layers
            ],
        }


def collect_show(
    ledger: LedgerReader,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
    layers: Sequence[int] | None = None,
    ep_size: int = 1,
) -> ShowReport:
    if ep_size < 1:
        raise LedgerError(f"--ep-size must be at least 1, got {ep_size}")
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
    chosen = check_layers(layers, held.incarnation.geometry)
    return ShowReport(str(ledger.path), held, ep_size, tuple(chosen))


def render_show(report: ShowReport) -> str:
    return format_physical_to_logical_map(
        report.held.physical_to_logical_map, report.ep_size, report.layers
    )


# --- diff ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlotChange:
    slot: int
    before: int
    after: int


@dataclass(frozen=True)
class LayerChange:
    layer: int
    slots: tuple[SlotChange, ...]


@dataclass(frozen=True)
class DiffReport:
    path: str
    incarnation_id: int
    num_physical_slots: int
    from_version: int
    from_digest: str
    to_version: int
    to_digest: str
    layers: tuple[int, ...]
    changes: tuple[LayerChange, ...]

    @property
    def changed_slots(self) -> int:
        return sum(len(change.slots) for change in self.changes)

    @property
    def total_slots(self) -> int:
        return len(self.layers) * self.num_physical_slots

    def to_json(self) -> JsonObject:
        return {
            "path": self.path,
            "incarnation_id": self.incarnation_id,
            "from_version": self.from_version,
            "from_digest": self.from_digest,
            "to_version": self.to_version,
            "to_digest": self.to_digest,
            "layers": list(self.layers),
            "changed_slots": self.changed_slots,
            "total_slots": self.total_slots,
            "changed_layers": [
                {
                    "layer": change.layer,
                    "changed": len(change.slots),
                    "slots": [
                        {"slot": s.slot, "from": s.before, "to": s.after} for s in change.slots
                    ],
                }
                for change in self.changes
            ],
        }


def collect_diff(
    ledger: LedgerReader,
    from_version: int,
    to_version: int,
    *,
    incarnation_id: int | None = None,
    layers: Sequence[int] | None = None,
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


def render_diff(report: DiffReport, *, slots: bool = False) -> str:
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
    return "\n".join(lines)


# --- export -------------------------------------------------------------------------------

# sglang reads --init-expert-location as a file only when the name ends in .json (or .pt);
# any other value is parsed as inline JSON (sglang/srt/eplb/expert_location.py:775-780).
EXPORT_SUFFIX = ".json"


@dataclass(frozen=True)
class ExportReport:
    path: str
    output: str
    incarnation_id: int
    version: int
    digest: str
    geometry: Geometry
    dirty: bool

    def to_json(self) -> JsonObject:
        return {
            "path": self.path,
            "output": self.output,
            "incarnation_id": self.incarnation_id,
            "version": self.version,
            "digest": self.digest,
            **_geometry_json(self.geometry),
            "dirty": self.dirty,
        }


def init_expert_location_text(physical_to_logical_map: Map) -> str:
    """The file ``--init-expert-location`` reads: one key (sglang passes every key of the file
    to ``ExpertLocationMetadata.init_by_mapping`` as a keyword, expert_location.py:786-790),
    one layer per line."""
    rows = ",\n".join(
        "    " + json.dumps(row, separators=(",", ":")) for row in physical_to_logical_map
    )
    return '{\n  "physical_to_logical_map": [\n' + rows + "\n  ]\n}\n"


def write_atomically(output: Path, data: bytes) -> None:
    """Write ``data`` to ``output`` through a temporary file in its directory and a rename."""
    directory = output.parent
    if not directory.is_dir():
        raise LedgerError(f"cannot write {output}: the directory {directory} does not exist")
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{output.name}.", dir=directory)
    except OSError as exc:
        raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, output)
    except OSError as exc:
        os.unlink(temporary)
        raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc


def export_map(
    ledger: LedgerReader,
    output: str | Path,
    *,
    incarnation_id: int | None = None,
    version: int | None = None,
) -> tuple[ExportReport, Map]:
    """Write the map at ``version`` as an ``--init-expert-location`` file; returns the report
    and the map written."""
    output = Path(output)
    if output.suffix != EXPORT_SUFFIX:
        raise LedgerError(
            f"name the output file *{EXPORT_SUFFIX} (got {output}): sglang reads "
            f"--init-expert-location as a file only when the name ends in {EXPORT_SUFFIX}"
        )
    with ledger.connect() as conn:
        held = held_map(conn, incarnation_id, version)
        dirty = reader.replayed(conn, held.incarnation).dirty is not None
    if layout_digest(held.physical_to_logical_map) != held.digest:
        raise LedgerStorageError(
            f"the rows of incarnation {held.incarnation.incarnation_id} version {held.version} "
            f"do not give its recorded digest {held.digest[:12]}; nothing exported. Run "
            f"`layout-ledger verify {ledger.path}`"
        )
    write_atomically(output, init_expert_location_text(held.physical_to_logical_map).encode())
    report = ExportReport(
        path=str(ledger.path),
        output=str(output),
        incarnation_id=held.incarnation.incarnation_id,
        version=held.version,
        digest=held.digest,
        geometry=held.incarnation.geometry,
        dirty=dirty,
    )
    return report, held.physical_to_logical_map


def render_export(report: ExportReport) -> str:
    geometry = report.geometry
    lines = [
        f"wrote {report.output}: incarnation {report.incarnation_id} version {report.version} "
        f"(digest {report.digest[:12]}), {geometry.num_layers} layers x "
        f"{geometry.num_physical_slots} physical slots",
        f"start an engine with it: --init-expert-location {report.output}",
    ]
    if report.dirty:
        lines.append(
            "note: this incarnation is dirty; the file holds its last committed layout, not "
            "necessarily what the daemon's memory holds"
        )
    return "\n".join(lines)
