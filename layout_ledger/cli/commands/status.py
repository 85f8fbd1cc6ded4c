"""``layout-ledger status``: one incarnation's state, as a restarted daemon would derive it.

Exit 3 when dirty, 4 when a move is pending or the daemon refused requests, else 0.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import ClassVar

from sqlalchemy import text

from layout_ledger.cli import exit_codes
from layout_ledger.cli.event_rows import EVENT_COLUMNS_SQL, EventRow
from layout_ledger.cli.held_maps import geometry_json
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.output import emit
from layout_ledger.cli.pending_moves import pending_text, pending_wire
from layout_ledger.core import events as ev
from layout_ledger.core.state import DirtyMark, PendingMove
from layout_ledger.history.liveness import Liveness, daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.replay import replayed
from layout_ledger.store.rows import Incarnation, current_version, incarnation, reconstructible_from
from layout_ledger.wire.protocol import pending_to_wire


def run(args: argparse.Namespace) -> int:
    with LedgerReader(args.ledger) as ledger:
        collected = collect_status(ledger, args.incarnation)
    emit(args, collected.to_json(), render_status(collected))
    return collected.exit_code


def _incarnation_json(inc: Incarnation) -> JsonObject:
    return {
        "incarnation_id": inc.incarnation_id,
        "started_at": inc.started_at,
        "ended_at": inc.ended_at,
        "end_state": inc.end_state,
        "daemon_label": inc.daemon_label,
        "config_fingerprint": inc.config_fingerprint,
        **inc.origin.to_json(),
        **geometry_json(inc.geometry),
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


def _pending_json(pending: PendingMove | None) -> JsonObject:
    return {
        "pending": pending_wire(pending),
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
                f"SELECT {EVENT_COLUMNS_SQL} FROM ledger_events WHERE incarnation_id = :i "
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
    pending = "none" if report.pending is None else pending_text(report.pending)
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
