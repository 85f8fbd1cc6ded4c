"""``layout-ledger fleet``: every ledger of an engine at once, and the verdict its startup reaches.

Each ledger, read read-only, becomes the finding the engine rank on that GPU would make of its
daemon (``finding_from_layout``; NO_DAEMON when its writer lock is free, UNREADABLE when it
cannot be read), and ``core.startup_verdict.decide``, the code every engine rank runs at
startup, reaches the verdict over them. Exit codes: ``FleetReport.exit_code``. A retired
ledger (``history.retirement``) is shown but not counted. ``--ready-to-stop ENGINE`` asks
another question: may that engine be stopped now (every rank attached, cordoned, no move
pending)?
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

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
from layout_ledger.core.state import Cordon, PendingMove
from layout_ledger.history.overview import (
    LedgerOverview,
    UnreadableLedger,
    read_overviews,
    require_one_readable,
)
from layout_ledger.history.reader import LedgerReader
from layout_ledger.history.retirement import RetirementStep
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
    if args.ready_to_stop is not None:
        ready = ready_to_stop(collected, args.ready_to_stop)
        emit(args, ready.to_json(), render_ready_to_stop(ready))
        return ready.exit_code
    emit(args, collected.to_json(), render_fleet(collected, wide=args.wide))
    for row in collected.ledgers:
        if row.problem is not None:
            print_error("fleet", f"cannot read ledger {row.path}: {row.problem}")
    return collected.exit_code


def _pending_json(pending: PendingMove | None) -> JsonObject | None:
    return None if pending is None else {**pending_to_wire(pending), "since": pending.since}


def _cordon_json(cordon: Cordon | None) -> JsonObject | None:
    return None if cordon is None else {"since": cordon.since, "reason": cordon.reason}


def _retired_json(step: RetirementStep | None) -> JsonObject | None:
    return None if step is None else step.to_json()


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
    last_commit_at: str | None = None
    cordon: Cordon | None = field(default=None, metadata=json_field(convert=_cordon_json))
    retired: RetirementStep | None = field(default=None, metadata=json_field(convert=_retired_json))
    # Of ``attached``: the standbys, and those of them holding a lease.
    standbys: tuple[str, ...] = ()
    leases: tuple[str, ...] = ()

    @property
    def lease_holders(self) -> tuple[str, ...]:
        """The attached engines the one-mover rule counts: active ones, and leased standbys."""
        return tuple(e for e in self.attached if e not in self.standbys or e in self.leases)

    @property
    def state(self) -> str:
        """``unreadable``, ``retired``, ``dirty``, ``pending``, ``cordoned`` or ``clean``: what
        the ledger says."""
        if self.problem is not None:
            return "unreadable"
        if self.retired is not None:
            return "retired"
        if self.dirty:
            return "dirty"
        if self.pending is not None:
            return "pending"
        return "cordoned" if self.cordon is not None else "clean"


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
    # Which engine may move experts now (the one lease holder on every running daemon; None:
    # none may), and why, in words.
    mover: str | None = None
    moves: str = ""


@dataclass(frozen=True)
class FleetReport(JsonShaped):
    ledgers: tuple[FleetRow, ...]
    verdict: FleetVerdict

    @property
    def counted(self) -> tuple[FleetRow, ...]:
        """The rows the verdict is reached over: every ledger but the retired ones."""
        return tuple(row for row in self.ledgers if row.retired is None)

    @property
    def exit_code(self) -> int:
        if self.verdict.outcome != "fail":
            return exit_codes.OK
        kinds = {row.finding.kind for row in self.counted}
        if not kinds:
            return exit_codes.UNUSABLE
        if kinds == {FindingKind.NO_DAEMON}:
            return exit_codes.NOT_RUNNING
        if FindingKind.DIRTY in kinds:
            return exit_codes.DIRTY
        if FindingKind.STUCK in kinds:
            return exit_codes.PENDING_OR_REFUSALS
        if len(_record_groups(self.counted)) > 1:
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
    return FleetReport(rows, _verdict([row for row in rows if row.retired is None]))


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
        last_commit_at=item.last_commit_at,
        cordon=state.cordon,
        retired=item.retired,
        standbys=tuple(state.standbys),
        leases=tuple(state.leases),
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
            reason=f"{item.liveness.detail}; a daemon started now restores its last committed "
            f"layout or begins at version 0",
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
    verdict = _startup_verdict(rows)
    mover, moves = _mover(rows)
    return dataclasses.replace(verdict, mover=mover, moves=moves)


def _mover(rows: Sequence[FleetRow]) -> tuple[str | None, str]:
    """Which engine may move experts now: the one engine that holds a lease on every running
    daemon and is the only lease holder on each (standbys without a lease do not count)."""
    running = [row for row in rows if row.problem is None and row.alive is not False]
    if not running:
        return None, "no daemon runs: no engine moves experts"
    if any(row.dirty for row in running):
        return None, "no engine may move: a daemon is dirty (see the verdict)"
    holders = sorted({engine for row in running for engine in row.lease_holders})
    idle = sorted({e for row in running for e in row.standbys if e not in row.lease_holders})
    waiting = f"; standbys without a lease (not counted): {', '.join(idle)}" if idle else ""
    if not holders:
        return None, "no engine holds a lease: an active engine attached to every daemon may"
    if len(holders) > 1:
        shown = ", ".join(
            f"{e} (standby, serving)" if any(e in row.standbys for row in running) else e
            for e in holders
        )
        return None, (
            f"no engine may move: {shown} hold leases; begins are busy until one alone holds "
            f"a lease{waiting}"
        )
    engine = holders[0]
    missing = [row.rank for row in running if engine not in row.attached]
    if missing:
        return None, (
            f"no engine may move: {engine} is the only lease holder but is not attached on "
            f"{_ranks_text(missing)}"
        )
    cordoned = [row.rank for row in running if row.cordon is not None]
    if cordoned:
        return None, (
            f"no engine may move: {engine} is the only lease holder, but "
            f"{_ranks_text(cordoned)} cordoned (begins are busy)"
        )
    return engine, f"engine {engine} may move (the one lease holder on every daemon){waiting}"


def _startup_verdict(rows: Sequence[FleetRow]) -> FleetVerdict:
    if not rows:
        reason = "every ledger given is retired: there is no rank to reach a verdict over"
        return FleetVerdict("fail", None, None, reason, None)
    if all(row.finding.kind is FindingKind.NO_DAEMON for row in rows):
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


# ``-o wide``: these after the state.
_WIDE_COLUMNS = ("attached", "pending_since", "last_commit", "cordon")


def _wide_cells(row: FleetRow) -> tuple[str, ...]:
    return (
        ",".join(row.attached) or "-",
        "-" if row.pending is None or row.pending.since is None else row.pending.since,
        row.last_commit_at or "-",
        "-" if row.cordon is None else row.cordon.since,
    )


def render_fleet(report: FleetReport, *, wide: bool = False) -> list[str]:
    if wide:
        header = (*_COLUMNS[:-1], *_WIDE_COLUMNS, _COLUMNS[-1])
        cells = [(*_cells(row)[:-1], *_wide_cells(row), row.path) for row in report.ledgers]
        lines = render_table(header, cells)
    else:
        lines = render_table(_COLUMNS, [_cells(row) for row in report.ledgers])
    lines.append("")
    lines.append(verdict_line(report.verdict))
    lines.append(f"  {report.verdict.reason}")
    lines.append(f"  moves: {report.verdict.moves}")
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
    from layout_ledger.cli.progress import Progress

    found = []
    with Progress("fleet --verify") as progress:
        for number, path in enumerate(paths, 1):
            found.append(_verify_one(path, _phase_of(progress, f"ledger {number} of {len(paths)}")))
    verified = tuple(found)
    if all(ledger.ok is None for ledger in verified):
        raise LedgerFileError(verified[0].detail)
    return FleetVerifyReport(verified)


def _phase_of(progress: Any, where: str) -> Callable[[str], None]:
    return lambda text: progress.phase(f"{where}: {text}")


def _verify_one(path: Path, on_phase: Callable[[str], None] | None = None) -> VerifiedLedger:
    from layout_ledger.history.checks import collect_verify

    try:
        with LedgerReader(path) as ledger:
            report = collect_verify(ledger, on_phase)
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


# --- fleet --ready-to-stop ----------------------------------------------------------------


@dataclass(frozen=True)
class RankReadiness(JsonShaped):
    """Whether one rank's daemon lets the engine stop now, and what keeps it from it."""

    json_properties: ClassVar[tuple[str, ...]] = ("ready",)

    rank: int
    path: str
    problems: tuple[str, ...]
    blocker: str | None  # the worst problem's kind: unreadable, not_running, pending, not_ready

    @property
    def ready(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class ReadyToStop(JsonShaped):
    """``fleet --ready-to-stop ENGINE``: every counted rank attached to the engine, cordoned,
    no move pending, its daemon running; else the ranks and why."""

    json_properties: ClassVar[tuple[str, ...]] = ("ready",)

    engine_id: str
    ranks: tuple[RankReadiness, ...]

    @property
    def ready(self) -> bool:
        return bool(self.ranks) and all(rank.ready for rank in self.ranks)

    @property
    def exit_code(self) -> int:
        """0 ready; else 2 a ledger unreadable, 6 a daemon not running, 4 a move pending, 7
        a rank not cordoned or without the engine (the worst first)."""
        if self.ready:
            return exit_codes.OK
        blockers = {rank.blocker for rank in self.ranks}
        for blocker, code in (
            ("unreadable", exit_codes.UNUSABLE),
            ("not_running", exit_codes.NOT_RUNNING),
            ("pending", exit_codes.PENDING_OR_REFUSALS),
        ):
            if blocker in blockers:
                return code
        return exit_codes.NOT_READY


def _engine_named(rows: Sequence[FleetRow], given: str) -> str:
    """The engine id ``given`` names: itself when attached anywhere, else the one attached id
    it begins (an engine id is long; its prefix is what an operator types)."""
    ids = {engine for row in rows for engine in row.attached}
    if given in ids:
        return given
    matches = sorted(engine for engine in ids if engine.startswith(given))
    if len(matches) > 1:
        raise LedgerError(
            f"--ready-to-stop {given!r} matches {len(matches)} attached engines: "
            f"{', '.join(repr(m) for m in matches)}; give more of the id"
        )
    return matches[0] if matches else given


_BLOCKER_ORDER = ("unreadable", "not_running", "pending", "not_ready")


def ready_to_stop(report: FleetReport, given: str) -> ReadyToStop:
    rows = report.counted
    engine = _engine_named(rows, given)
    ranks = []
    for row in rows:
        problems: list[tuple[str, str]] = []
        if row.problem is not None:
            problems.append(("unreadable", f"unreadable: {row.problem}"))
        elif row.alive is False:
            problems.append(("not_running", f"its daemon is {row.daemon}"))
        else:
            if engine not in row.attached:
                attached = ", ".join(repr(e) for e in row.attached) or "none"
                problems.append(
                    ("not_ready", f"engine {engine!r} is not attached (attached: {attached})")
                )
            if row.pending is not None:
                problems.append(("pending", f"a move is pending: {pending_move_text(row.pending)}"))
            if row.cordon is None:
                problems.append(
                    ("not_ready", f"not cordoned (run `layout-ledger cordon {row.path}`)")
                )
        blocker = min((kind for kind, _ in problems), key=_BLOCKER_ORDER.index, default=None)
        ranks.append(
            RankReadiness(row.rank, row.path, tuple(text for _, text in problems), blocker)
        )
    return ReadyToStop(engine, tuple(ranks))


def render_ready_to_stop(report: ReadyToStop) -> list[str]:
    lines = []
    for rank in report.ranks:
        if rank.ready:
            lines.append(f"rank {rank.rank}: ready ({rank.path})")
        else:
            lines.append(f"rank {rank.rank}: not ready: {'; '.join(rank.problems)} ({rank.path})")
    lines.append("")
    count = len(report.ranks)
    if report.ready:
        lines.append(
            f"ready to stop engine {report.engine_id!r}: on all {count} ranks it is attached, "
            f"no move is pending and the daemon is cordoned"
        )
    else:
        waiting = [rank.rank for rank in report.ranks if not rank.ready]
        lines.append(
            f"not ready to stop engine {report.engine_id!r}: {_ranks_text(waiting)} of {count} "
            f"not ready"
        )
    return lines
