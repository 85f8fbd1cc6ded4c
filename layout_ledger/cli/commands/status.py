"""``layout-ledger status``: one incarnation's state, as a restarted daemon would derive it.

Exit 3 when dirty, 4 when a move is pending, 6 when the daemon of the latest incarnation is not
running, 4 when the daemon refused requests within the last ``REFUSALS_WINDOW`` (10 minutes),
else 0 (also for a retired ledger). Many ledgers at once (PATH... as ``fleet`` takes them): one
block each, and the worst exit code (``StatusesReport``).
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from layout_ledger.cli import exit_codes
from layout_ledger.cli.event_rows import EVENT_COLUMNS_SQL, EventRow
from layout_ledger.cli.held_maps import geometry_json
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.path_expansion import expand_ledger_paths, names_many
from layout_ledger.cli.pending_moves import pending_text, pending_wire
from layout_ledger.cli.time_text import ago
from layout_ledger.core import events as ev
from layout_ledger.core.content import ExpertContents
from layout_ledger.core.errors import LedgerError, LedgerFileError
from layout_ledger.core.state import Cordon, DirtyMark, PendingMove, RestoredFrom
from layout_ledger.history.liveness import Liveness, daemon_liveness
from layout_ledger.history.reader import LedgerReader
from layout_ledger.history.retirement import RetirementStep, current_retirement
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.store.replay import replayed
from layout_ledger.store.rows import (
    Incarnation,
    current_version,
    fingerprints_at,
    incarnation,
    map_at,
    reconstructible_from,
)
from layout_ledger.wire.healing import HEAL_UNAVAILABLE

# Refusals make ``state: refusals`` (exit 4) only while the newest of them is this recent: a
# refusal is a symptom to look at now, and a health check must not stay failed for the rest of
# an incarnation after one transient refusal. Ten minutes: two of Prometheus' default
# evaluation windows for the refusal alert, and longer than an engine's startup wait (300 s).
REFUSALS_WINDOW = datetime.timedelta(minutes=10)

Clock = Callable[[], datetime.datetime]


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def run(args: argparse.Namespace) -> int:
    if not names_many(args.ledger):
        (path,) = args.ledger
        with LedgerReader(path) as ledger:
            collected = collect_status(ledger, args.incarnation)
        # --json has one shape whatever names the ledgers: one ledger is a list of one.
        emit(args, StatusesReport((collected,)).to_json(), render_status(collected))
        return collected.exit_code
    many = collect_statuses(expand_ledger_paths(args.ledger), args.incarnation)
    emit(args, many.to_json(), render_statuses(many))
    for problem in many.unreadable:
        print_error("status", f"cannot read ledger {problem.path}: {problem.problem}")
    return many.exit_code


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
        else {**(pending_wire(dirty.move) or {}), "at": dirty.at},
    }


def _pending_json(pending: PendingMove | None) -> JsonObject:
    return {
        "pending": pending_wire(pending),
        "pending_since": None if pending is None else pending.since,
    }


def _step_json(step: RetirementStep | None) -> JsonObject | None:
    return None if step is None else step.to_json()


def _cordon_json(cordon: Cordon | None) -> JsonObject | None:
    return None if cordon is None else {"since": cordon.since, "reason": cordon.reason}


def _restored_json(restored: RestoredFrom | None) -> JsonObject | None:
    return None if restored is None else dict(restored.to_wire())


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
    refusals: int  # refused requests (``*_refused``) in this incarnation, each counted in full
    last_event: EventRow | None
    latest: bool = field(metadata=json_field(omit=True))  # the ledger's newest incarnation
    # Refused requests whose newest refusal is within REFUSALS_WINDOW of the collection.
    recent_refusals: int = 0
    refusals_window_seconds: int = int(REFUSALS_WINDOW.total_seconds())
    # Begins answered busy (another engine, another's move, a cordon): not refusals, the same
    # begin can succeed later.
    busy_begins: int = 0
    cordon: Cordon | None = field(default=None, metadata=json_field(convert=_cordon_json))
    # Of ``attached``: the standbys, and those of them holding a lease (an active engine always
    # holds one).
    standbys: tuple[str, ...] = ()
    leases: tuple[str, ...] = ()
    retired: RetirementStep | None = field(default=None, metadata=json_field(convert=_step_json))
    # Per layer, the groups of logical experts the daemon's recorded slots show with the same
    # bytes (tied), from the fingerprints and the map at the current version.
    tied_experts: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    # The committed version the incarnation restored at its start (None: it started at 0).
    restored_from: RestoredFrom | None = field(
        default=None, metadata=json_field(convert=_restored_json)
    )
    # Whether the incarnation heals itself from its checkpoint (``incarnations.heal``):
    # {"mode": "auto" | "off" | None, "available": bool, "reason": str | None}; None: not
    # recorded (a ledger or daemon from before heals).
    heal: dict[str, Any] | None = None
    # When it was collected: the text says how long ago each time it shows was.
    observed_at: datetime.datetime | None = field(default=None, metadata=json_field(omit=True))

    @property
    def state(self) -> str:
        """``retired``, ``dirty``, ``pending``, ``not_running``, ``refusals`` or ``clean``:
        the worst first (a retired ledger is retired whatever else it says)."""
        if self.retired is not None:
            return "retired"
        if self.dirty is not None:
            return "dirty"
        if self.pending is not None:
            return "pending"
        if self.latest and self.liveness.alive is False:
            return "not_running"
        if self.recent_refusals:
            return "refusals"
        return "clean"

    @property
    def exit_code(self) -> int:
        return STATE_EXIT_CODES[self.state]


STATE_EXIT_CODES = {
    "retired": exit_codes.OK,
    "dirty": exit_codes.DIRTY,
    "pending": exit_codes.PENDING_OR_REFUSALS,
    "not_running": exit_codes.NOT_RUNNING,
    "refusals": exit_codes.PENDING_OR_REFUSALS,
    "unreadable": exit_codes.UNUSABLE,
    "clean": exit_codes.OK,
}
# Over many ledgers: the state that decides the exit code, the worst first.
STATE_PRECEDENCE = ("dirty", "pending", "not_running", "refusals", "unreadable")


def _refusal_counts(conn: Any, incarnation_id: int, since: str) -> tuple[int, int, int]:
    """(refusals, of them since ``since``, busy begins) in the incarnation, counted in full."""
    row = conn.execute(
        text(
            "SELECT "
            "coalesce(sum(CASE WHEN kind LIKE :k THEN count END), 0), "
            "coalesce(sum(CASE WHEN kind LIKE :k AND coalesce(last_at, at) >= :since "
            "THEN count END), 0), "
            "coalesce(sum(CASE WHEN kind = :busy THEN count END), 0) "
            "FROM ledger_events WHERE incarnation_id = :i"
        ),
        {"i": incarnation_id, "k": "%" + ev.REFUSED_SUFFIX, "since": since, "busy": ev.BEGIN_BUSY},
    ).one()
    return int(row[0]), int(row[1]), int(row[2])


def collect_status(
    ledger: LedgerReader, incarnation_id: int | None = None, now: Clock | None = None
) -> StatusReport:
    observed_at = (now or _utc_now)()
    since = (observed_at - REFUSALS_WINDOW).isoformat(timespec="microseconds")
    with ledger.connect() as conn:
        inc = incarnation(conn, incarnation_id)
        i = inc.incarnation_id
        version, digest = current_version(conn, i)
        derived = replayed(conn, inc)
        count = conn.execute(text("SELECT count(*) FROM incarnations")).scalar()
        refusals, recent, busy = _refusal_counts(conn, i, since)
        last = conn.execute(
            text(
                f"SELECT {EVENT_COLUMNS_SQL} FROM ledger_events WHERE incarnation_id = :i "
                f"ORDER BY event_id DESC LIMIT 1"
            ),
            {"i": i},
        ).first()
        latest = conn.execute(text("SELECT max(incarnation_id) FROM incarnations")).scalar()
        is_latest = latest == i
        return StatusReport(
            path=str(ledger.path),
            incarnation_count=int(count or 0),
            incarnation=inc,
            liveness=daemon_liveness(ledger.path, inc, latest=is_latest),
            version=version,
            digest=digest,
            reconstructible_from=reconstructible_from(conn, i),
            dirty=derived.dirty,
            pending=derived.pending,
            attached=tuple(derived.attached),
            non_following_fetch=derived.non_following_fetch,
            refusals=refusals,
            last_event=None if last is None else EventRow.from_row(last),
            latest=is_latest,
            recent_refusals=recent,
            busy_begins=busy,
            cordon=derived.cordon,
            standbys=tuple(derived.standbys),
            leases=tuple(derived.leases),
            retired=current_retirement(ledger.path, i) if is_latest else None,
            tied_experts=_tied_experts(conn, inc, version),
            restored_from=inc.restored_from,
            heal=_heal(conn, i),
            observed_at=observed_at,
        )


def _heal(conn: Any, incarnation_id: int) -> dict[str, Any] | None:
    """``incarnations.heal`` as the status shows it (revision 0009)."""
    raw = conn.execute(
        text("SELECT heal FROM incarnations WHERE incarnation_id = :i"), {"i": incarnation_id}
    ).scalar()
    if raw is None:
        return None
    said = str(raw)
    if said.startswith(HEAL_UNAVAILABLE):
        return {"mode": None, "available": False, "reason": said.removeprefix(HEAL_UNAVAILABLE)}
    return {"mode": said, "available": True, "reason": None}


def _tied_experts(conn: Any, inc: Incarnation, version: int) -> dict[int, list[tuple[int, ...]]]:
    """The tied experts the recorded fingerprints show at ``version`` (none when unrecorded, or
    when the rows cannot be read: ``verify`` names those, status reports the state)."""
    try:
        recorded = fingerprints_at(conn, inc, version)
        if recorded is None:
            return {}
        the_map = map_at(conn, inc, version)
    except LedgerError:
        return {}
    known = ExpertContents()
    for layer in recorded.layers:
        known.learn_slots(layer, the_map[layer], recorded)
    return known.tied()


@dataclass(frozen=True)
class UnreadableStatus(JsonShaped):
    """A ledger among many that cannot be read, and why."""

    json_properties: ClassVar[tuple[str, ...]] = ("state",)

    path: str
    problem: str

    @property
    def state(self) -> str:
        return "unreadable"


@dataclass(frozen=True)
class StatusesReport(JsonShaped):
    """``status`` of many ledgers: each one's report (or why it cannot be read) and the worst
    state, whose exit code is the command's."""

    json_properties: ClassVar[tuple[str, ...]] = ("state",)

    ledgers: tuple[StatusReport | UnreadableStatus, ...]

    @property
    def unreadable(self) -> tuple[UnreadableStatus, ...]:
        return tuple(item for item in self.ledgers if isinstance(item, UnreadableStatus))

    @property
    def state(self) -> str:
        states = {item.state for item in self.ledgers}
        return next((state for state in STATE_PRECEDENCE if state in states), "clean")

    @property
    def exit_code(self) -> int:
        return STATE_EXIT_CODES[self.state]


def collect_statuses(paths: Sequence[Path], incarnation_id: int | None = None) -> StatusesReport:
    """Each ledger's status, or why it cannot be read; in the order given."""
    found: list[StatusReport | UnreadableStatus] = []
    for path in paths:
        try:
            with LedgerReader(path) as ledger:
                found.append(collect_status(ledger, incarnation_id))
        except LedgerError as exc:
            found.append(UnreadableStatus(os.fspath(path), str(exc)))
        except (SQLAlchemyError, ValueError) as exc:
            found.append(
                UnreadableStatus(
                    os.fspath(path),
                    f"the ledger {path} looks damaged ({type(exc).__name__}: {exc}); run "
                    f"`layout-ledger verify {path}`",
                )
            )
    unreadable = [item for item in found if isinstance(item, UnreadableStatus)]
    if unreadable and len(unreadable) == len(found):
        more = f" (and {len(unreadable) - 1} more unreadable)" if len(unreadable) > 1 else ""
        raise LedgerFileError(unreadable[0].problem + more)
    return StatusesReport(tuple(found))


def roles_text(attached: Sequence[str], standbys: Sequence[str], leases: Sequence[str]) -> str:
    """Each attached engine's role and lease: ``A active (lease), C standby (no lease)``."""
    return ", ".join(
        f"{engine} standby ({'lease' if engine in leases else 'no lease'})"
        if engine in standbys
        else f"{engine} active (lease)"
        for engine in attached
    )


def _roles_rows(report: StatusReport) -> list[tuple[str, str]]:
    """The ``roles`` row, shown while a standby is attached (else every attached engine is
    active and holds its lease)."""
    if not report.standbys:
        return []
    return [("roles", roles_text(report.attached, report.standbys, report.leases))]


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


def _when(report: StatusReport, recorded: str) -> str:
    """A recorded time and how long before the collection it was: ``T; 5 min ago``."""
    if report.observed_at is None:
        return recorded
    return f"{recorded}; {ago(recorded, report.observed_at)}"


def render_status(report: StatusReport) -> list[str]:
    inc = report.incarnation
    geometry = inc.geometry
    if inc.ended_at is None:
        life = f"started {_when(report, inc.started_at)}, {report.liveness.detail}"
    else:
        life = f"started {inc.started_at}, ended {_when(report, inc.ended_at)} ({inc.end_state})"
    if report.dirty is not None:
        dirty = f"yes, since {_when(report, report.dirty.at)}: {report.dirty.reason}"
    else:
        dirty = "no"
    pending = "none"
    if report.pending is not None:  # its text ends with "since T"
        pending = pending_text(report.pending)
        if report.observed_at is not None and report.pending.since is not None:
            pending += f"; {ago(report.pending.since, report.observed_at)}"
    last = report.last_event
    last_text = "none"
    if last is not None:
        last_text = f"{last.at} {last.kind}" + (f" {last.engine_id}" if last.engine_id else "")
        if report.observed_at is not None:
            last_text += f"; {ago(last.at, report.observed_at)}"
    rows = [
        ("ledger", report.path),
        ("incarnation", f"{inc.incarnation_id} of {report.incarnation_count} ({life})"),
        *origin_rows(inc.origin, inc.config_fingerprint),
        ("geometry", geometry.describe()),
        ("version", str(report.version)),
        ("digest", report.digest),
        ("history held", f"versions {report.reconstructible_from}..{report.version}"),
        ("dirty", dirty),
        ("pending move", pending),
        ("attached", ", ".join(report.attached) if report.attached else "none"),
        *_roles_rows(report),
        ("non-following fetch", _yes_no(report.non_following_fetch)),
        ("refusals", _refusals_text(report)),
        *_optional_rows(report),
        ("last event", last_text),
        ("state", report.state),
    ]
    width = max(len(label) for label, _ in rows) + 1
    return [f"{label + ':':<{width}} {value}" for label, value in rows]


def _refusals_text(report: StatusReport) -> str:
    if not report.refusals:
        return "0"
    minutes = report.refusals_window_seconds // 60
    recent = "none" if not report.recent_refusals else str(report.recent_refusals)
    return f"{report.refusals} ({recent} in the last {minutes} minutes)"


def _optional_rows(report: StatusReport) -> list[tuple[str, str]]:
    """The rows shown only when they say something: busy begins, a cordon, a retirement."""
    rows = []
    if report.restored_from is not None:
        restored = report.restored_from
        rows.append(
            (
                "restored",
                f"{restored.describe().removeprefix('restored ')} (digest {restored.digest[:12]}) "
                f"at its start",
            )
        )
    if report.heal is not None:
        heal = report.heal
        if not heal["available"]:
            rows.append(("heal", f"unavailable: {heal['reason']}"))
        elif heal["mode"] == "off":
            rows.append(("heal", "off (a dirty daemon heals only when asked: layout-ledger heal)"))
        else:
            rows.append(("heal", f"{heal['mode']} (a dirty daemon reloads its dirty layers)"))
    if report.busy_begins:
        rows.append(("busy begins", f"{report.busy_begins} (answered busy, not refused)"))
    if report.cordon is not None:
        rows.append(
            (
                "cordon",
                f"since {_when(report, report.cordon.since)}: {report.cordon.reason} (every "
                f"begin is busy "
                f"until `layout-ledger uncordon`; a daemon restart clears it)",
            )
        )
    if report.retired is not None:
        step = report.retired
        rows.append(("retired", f"since {_when(report, step.at)} by {step.by}: {step.reason}"))
    if report.tied_experts:
        groups = "; ".join(
            f"layer {layer}: " + ", ".join("/".join(map(str, group)) for group in found)
            for layer, found in report.tied_experts.items()
        )
        rows.append(("tied experts", f"{groups} (the same bytes: checks compare bytes)"))
    return rows


def render_statuses(report: StatusesReport) -> list[str]:
    """One status block per ledger, a blank line between them, then the worst state."""
    lines: list[str] = []
    for item in report.ledgers:
        if lines:
            lines.append("")
        if isinstance(item, UnreadableStatus):
            lines.extend([f"ledger: {item.path}", "state:  unreadable (see the error below)"])
        else:
            lines.extend(render_status(item))
    counts: dict[str, int] = {}
    for item in report.ledgers:
        counts[item.state] = counts.get(item.state, 0) + 1
    summary = ", ".join(f"{count} {state}" for state, count in sorted(counts.items()))
    lines.extend(["", f"{len(report.ledgers)} ledgers: {summary}; worst: {report.state}"])
    return lines
