"""``layout-ledger fleet``: every ledger of an engine at once, and the verdict its startup reaches.

Each ledger, read read-only, becomes the finding the engine rank on that GPU would make of its
daemon (``finding_from_layout``; NO_DAEMON when its writer lock is free, UNREADABLE when it
cannot be read), and ``core.startup_verdict.decide``, the code every engine rank runs at
startup, reaches the verdict over them. Exit codes: ``FleetReport.exit_code``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from layout_ledger.cli import exit_codes
from layout_ledger.cli.json_shape import JsonObject, JsonShaped, json_field
from layout_ledger.cli.layer_ranges import format_layers
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.path_expansion import expand_ledger_paths
from layout_ledger.core.errors import LedgerError, LedgerFileError
from layout_ledger.core.startup_verdict import (
    AdoptLayout,
    FailStartup,
    FindingKind,
    KeepInitialLayout,
    RankFinding,
    decide,
    finding_from_layout,
    pending_move_text,
)
from layout_ledger.core.state import PendingMove
from layout_ledger.history.overview import (
    LedgerOverview,
    UnreadableLedger,
    read_overviews,
    require_one_readable,
)
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.origin import IncarnationOrigin
from layout_ledger.wire.protocol import LayoutView, pending_to_wire

WAIT_TIMEOUT_ENV = "SGLANG_EXPERT_LAYOUT_WAIT_TIMEOUT"  # how long a starting engine waits

Key = TypeVar("Key")


def run(args: argparse.Namespace) -> int:
    paths = expand_ledger_paths(args.paths)
    if args.verify:
        verified = collect_fleet_verify(paths)
        emit(args, verified.to_json(), render_fleet_verify(verified))
        return verified.exit_code
    collected = collect_fleet(paths)
    emit(args, collected.to_json(), render_fleet(collected))
    for row in collected.ledgers:
        if row.problem is not None:
            print_error("fleet", f"cannot read ledger {row.path}: {row.problem}")
    return collected.exit_code


def _pending_json(pending: PendingMove | None) -> JsonObject | None:
    return None if pending is None else {**pending_to_wire(pending), "since": pending.since}


@dataclass(frozen=True)
class FleetRow(JsonShaped):
    """One ledger as ``fleet`` shows it, and the finding the engine rank would make of it."""

    json_properties: ClassVar[tuple[str, ...]] = ("state",)

    path: str
    rank: int
    origin: IncarnationOrigin = field(
        metadata=json_field(convert=IncarnationOrigin.to_json, spread=True)
    )
    config_fingerprint: str | None
    alive: bool | None
    daemon: str  # liveness in words
    incarnation_id: int | None
    version: int | None
    digest: str | None
    dirty: bool
    dirty_reason: str | None
    pending: PendingMove | None = field(metadata=json_field(convert=_pending_json))
    attached: tuple[str, ...]
    problem: str | None  # why the ledger cannot be read
    finding: RankFinding = field(metadata=json_field(convert=lambda f: f.kind.value))

    @property
    def state(self) -> str:
        """``unreadable``, ``dirty``, ``pending`` or ``clean``: what the ledger says."""
        if self.problem is not None:
            return "unreadable"
        if self.dirty:
            return "dirty"
        return "pending" if self.pending is not None else "clean"


@dataclass(frozen=True)
class FleetVerdict(JsonShaped):
    """What an engine starting now on these daemons does: ``outcome`` adopt, keep_initial or
    fail; ``reason`` a summary naming the ranks; ``engine_reason`` the text every rank of a
    failing engine raises (``ExpertLayoutStartupError``)."""

    outcome: str
    version: int | None
    digest: str | None
    reason: str
    engine_reason: str | None


@dataclass(frozen=True)
class FleetReport(JsonShaped):
    ledgers: tuple[FleetRow, ...]
    verdict: FleetVerdict

    @property
    def exit_code(self) -> int:
        if self.verdict.outcome != "fail":
            return exit_codes.OK
        kinds = {row.finding.kind for row in self.ledgers}
        if kinds == {FindingKind.NO_DAEMON}:
            return exit_codes.NOT_RUNNING
        if FindingKind.DIRTY in kinds:
            return exit_codes.DIRTY
        if FindingKind.STUCK in kinds:
            return exit_codes.PENDING_OR_REFUSALS
        if len(_record_groups(self.ledgers)) > 1:
            return exit_codes.INCONSISTENT
        if FindingKind.UNREADABLE in kinds:
            return exit_codes.UNUSABLE
        return exit_codes.INCONSISTENT


def collect_fleet(paths: Sequence[Path]) -> FleetReport:
    """Read every ledger and reach the engine's startup verdict over them."""
    read = read_overviews(paths)
    require_one_readable(read)
    ranks = _ranks(read)
    rows = tuple(_row(rank, item) for rank, item in zip(ranks, read, strict=True))
    return FleetReport(rows, _verdict(rows))


def _ranks(read: Sequence[LedgerOverview | UnreadableLedger]) -> list[int]:
    """Each ledger's TP rank when all recorded distinct ones, else the paths' order."""
    tp_ranks = [
        item.incarnation.origin.tp_rank if isinstance(item, LedgerOverview) else None
        for item in read
    ]
    known = [rank for rank in tp_ranks if rank is not None]
    if len(known) == len(read) and len(set(known)) == len(known):
        return known
    return list(range(len(read)))


def _row(rank: int, item: LedgerOverview | UnreadableLedger) -> FleetRow:
    if isinstance(item, UnreadableLedger):
        finding = RankFinding(
            rank, FindingKind.UNREADABLE, f"ledger {item.path}", "", reason=item.problem
        )
        return FleetRow(
            path=item.path,
            rank=rank,
            origin=IncarnationOrigin(),
            config_fingerprint=None,
            alive=None,
            daemon="unknown: the ledger cannot be read",
            incarnation_id=None,
            version=None,
            digest=None,
            dirty=False,
            dirty_reason=None,
            pending=None,
            attached=(),
            problem=item.problem,
            finding=finding,
        )
    inc, state, liveness = item.incarnation, item.state, item.liveness
    return FleetRow(
        path=item.path,
        rank=rank,
        origin=inc.origin,
        config_fingerprint=inc.config_fingerprint,
        alive=liveness.alive,
        daemon=liveness.detail,
        incarnation_id=inc.incarnation_id,
        version=state.version,
        digest=state.digest,
        dirty=state.dirty is not None,
        dirty_reason=None if state.dirty is None else state.dirty.reason,
        pending=state.pending,
        attached=tuple(state.attached),
        problem=None,
        finding=_finding(rank, item),
    )


def _finding(rank: int, item: LedgerOverview) -> RankFinding:
    """What the engine rank on this ledger's GPU would find, were it starting now."""
    inc = item.incarnation
    socket_path = inc.origin.socket_path or f"ledger {item.path}"
    if item.liveness.alive is False:
        return RankFinding(
            rank,
            FindingKind.NO_DAEMON,
            socket_path,
            inc.initial_digest,
            reason=f"{item.liveness.detail}; a daemon started now begins at version 0",
        )
    pending = item.state.pending
    since = "" if pending is None or pending.since is None else f" since {pending.since}"
    still_pending = (
        f"{since}; an engine starting now waits for it (up to {WAIT_TIMEOUT_ENV} seconds, "
        f"300 by default) and fails if it does not end"
    )
    return finding_from_layout(
        LayoutView.of(item.state),
        rank=rank,
        socket_path=socket_path,
        initial_digest=inc.initial_digest,
        still_pending=still_pending,
    )


# --- the verdict --------------------------------------------------------------------------


def _verdict(rows: Sequence[FleetRow]) -> FleetVerdict:
    if rows and all(row.finding.kind is FindingKind.NO_DAEMON for row in rows):
        # An engine would start (keeping its initial layout), but on no daemon at all: a
        # health check must not pass with every daemon down.
        reason = (
            f"no daemon of these ledgers runs ({_ranks_text([row.rank for row in rows])} not "
            f"running): start the daemons, then check again"
        )
        return FleetVerdict("fail", None, None, reason, None)
    decision = decide([row.finding for row in rows])
    if isinstance(decision, AdoptLayout):
        reason = (
            f"every daemon holds version {decision.version} (digest {decision.digest[:12]}), "
            f"none dirty, no move pending: an engine starting now routes with it"
        )
        return FleetVerdict("adopt", decision.version, decision.digest, reason, None)
    if isinstance(decision, KeepInitialLayout):
        without = [f.rank for f in decision.without_record]
        reason = (
            f"{_ranks_text(without)} not running; every running daemon holds the initial "
            f"layout at version 0: an engine starting now keeps its initial layout"
        )
        return FleetVerdict("keep_initial", None, None, reason, None)
    if not isinstance(decision, FailStartup):
        raise TypeError(f"decide() returned {decision!r}")
    return FleetVerdict("fail", None, None, _failure_summary(rows), decision.reason)


def _failure_summary(rows: Sequence[FleetRow]) -> str:
    """The ranks that keep an engine from starting, grouped (a summary for 16 ranks or more)."""
    parts: list[str] = []
    for kind, say in (
        (FindingKind.DIRTY, lambda r: f"dirty: {r.dirty_reason}"),
        (FindingKind.STUCK, _pending_text),
        (FindingKind.UNREADABLE, lambda r: f"unreadable: {r.finding.reason}"),
        (FindingKind.NO_DAEMON, _not_running_text),
    ):
        for text, ranks in _grouped(
            (say(row), row.rank) for row in rows if row.finding.kind is kind
        ):
            parts.append(f"{_ranks_text(ranks)} {text}")
    groups = _record_groups(rows)
    described = ", ".join(
        f"{_ranks_text(ranks)} at version {version} (digest {digest[:12]}"
        + (", its daemon restarted" if restarted else "")
        + ")"
        for (version, digest, restarted), ranks in groups
    )
    if len(groups) > 1:
        parts.append(f"the ledgers disagree: {described}")
    elif groups:
        parts.append(described)
    return "; ".join(parts)


def _not_running_text(row: FleetRow) -> str:
    why = row.daemon.removeprefix("not running").lstrip(", ")
    return f"not running ({why})" if why else "not running"


def _pending_text(row: FleetRow) -> str:
    if row.pending is None:  # a wait that timed out on a layout no longer pending
        return f"stuck: {row.finding.reason}"
    return f"pending: {pending_move_text(row.pending)}"


def _record_groups(
    rows: Sequence[FleetRow],
) -> list[tuple[tuple[int, str, bool], list[int]]]:
    """The clean records by (version, digest, restarted), largest group first."""
    keys = (
        (
            (
                row.version or 0,
                row.digest or "",
                row.version == 0 and (row.incarnation_id or 0) > 1,
            ),
            row.rank,
        )
        for row in rows
        if row.finding.kind is FindingKind.RECORD
    )
    groups = _grouped(keys)
    return sorted(groups, key=lambda group: (-len(group[1]), -group[0][0]))


def _grouped(pairs: Iterable[tuple[Key, int]]) -> list[tuple[Key, list[int]]]:
    """Ranks grouped by key, in the order each key first appears."""
    groups: dict[Key, list[int]] = {}
    for key, rank in pairs:
        groups.setdefault(key, []).append(rank)
    return list(groups.items())


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {format_layers(ranks)}"


# --- human output -------------------------------------------------------------------------

_COLUMNS = (
    "rank",
    "host",
    "gpu",
    "device",
    "tp",
    "pp",
    "ep",
    "daemon",
    "inc",
    "version",
    "digest",
    "state",
    "ledger",
)


def _cells(row: FleetRow) -> tuple[str, ...]:
    def shown(value: object) -> str:
        return "-" if value is None else str(value)

    origin = row.origin
    alive = {True: "running", False: "not running", None: "unknown"}[row.alive]
    return (
        str(row.rank),
        shown(origin.host),
        shown(origin.gpu_id),
        shown(origin.device_uuid),
        shown(origin.tp_rank),
        shown(origin.pp_rank),
        shown(origin.ep_rank),
        alive,
        shown(row.incarnation_id),
        shown(row.version),
        "-" if row.digest is None else row.digest[:12],
        row.state,
        row.path,
    )


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell (the last one not padded)."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def verdict_line(verdict: FleetVerdict) -> str:
    if verdict.outcome == "adopt":
        return f"verdict: adopt version {verdict.version} with digest {verdict.digest}"
    if verdict.outcome == "keep_initial":
        return "verdict: keep the initial layout"
    return "verdict: fail"


def render_fleet(report: FleetReport) -> list[str]:
    lines = render_table(_COLUMNS, [_cells(row) for row in report.ledgers])
    lines.append("")
    lines.append(verdict_line(report.verdict))
    lines.append(f"  {report.verdict.reason}")
    return lines


# --- fleet --verify -----------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedLedger(JsonShaped):
    """``verify`` of one ledger: ``ok`` None when it cannot be read at all."""

    path: str
    ok: bool | None
    schema_revision: str | None
    detail: str  # the chain's head when ok, else the first inconsistency or the error


@dataclass(frozen=True)
class FleetVerifyReport(JsonShaped):
    ledgers: tuple[VerifiedLedger, ...]

    @property
    def exit_code(self) -> int:
        """5 when a ledger is inconsistent, else 2 when one cannot be read, else 0."""
        if any(ledger.ok is False for ledger in self.ledgers):
            return exit_codes.INCONSISTENT
        if any(ledger.ok is None for ledger in self.ledgers):
            return exit_codes.UNUSABLE
        return exit_codes.OK


def collect_fleet_verify(paths: Sequence[Path]) -> FleetVerifyReport:
    """``verify`` on every ledger (each in its own snapshot); when none can be read at all,
    raise why the first cannot."""
    verified = tuple(_verify_one(path) for path in paths)
    if all(ledger.ok is None for ledger in verified):
        raise LedgerFileError(verified[0].detail)
    return FleetVerifyReport(verified)


def _verify_one(path: Path) -> VerifiedLedger:
    from layout_ledger.history.checks import collect_verify

    try:
        with LedgerReader(path) as ledger:
            report = collect_verify(ledger)
    except (LedgerError, SQLAlchemyError, ValueError) as exc:
        return VerifiedLedger(str(path), None, None, str(exc))
    if not report.ok:
        return VerifiedLedger(
            str(path), False, report.schema_revision, str(report.first_inconsistency)
        )
    chained = [result.detail for result in report.checks if result.check == "chain"]
    return VerifiedLedger(str(path), True, report.schema_revision, "; ".join(chained))


def render_fleet_verify(report: FleetVerifyReport) -> list[str]:
    words = {True: "ok", False: "INCONSISTENT", None: "unusable"}
    return [f"{ledger.path}: {words[ledger.ok]}: {ledger.detail}" for ledger in report.ledgers]
