"""The engine's pure decisions: every rank computes the same one from all-gathered values.

Each rank describes what it found or what its daemon answered; the values are all-gathered over
the world CPU group, and these functions turn the same list into the same decision on every
rank, so every rank takes the same branch and no rank is left waiting in a collective. They live
in ``layout_ledger`` so that tools reading several daemons' ledgers (the CLI) can compute the
same verdict without sglang. Pure: no sglang, no torch, no I/O.

Startup (``decide``, DESIGN.md "Engine side"): each rank reads its own daemon and describes it
as a ``RankFinding`` (``finding_from_layout`` turns the layout it read into one, for the engine
and for ``layout-ledger fleet`` alike); then

1. any daemon dirty, any move still pending after the wait, any rank that could not read its
   daemon: fail;
2. recording daemons that disagree on version or digest: fail;
3. every daemon keeps a record, all at one version and digest: adopt that map;
4. some daemons keep no record (an older daemon, one without ``--enable-eplb``, no daemon):
   keep the initial layout if every recording daemon still holds it at version 0, else fail;
5. no daemon keeps a record: keep the initial layout.

Rebalance (the ``EPLBManager.rebalance`` hook, ``sglang_integration.rebalance``):

- ``decide_mode``, once, from every rank's ``RankLayoutStatus``: weights from disk on every rank
  rebalance as sglang does; weights from the daemons on every rank, each attached to a daemon
  that keeps a record, all at one version, move in two phases; anything else (an older daemon,
  a daemon without ``--enable-eplb``, an engine that did not attach, ranks mixing disk and daemon
  weights, elastic EP) never rebalances the shared weights, one reason per cause.
- ``decide_begin``, per chunk, from every rank's begin ``Reply``: all ``ok`` -> move; any
  refusal (or an error) -> off for good; otherwise any ``busy`` -> skip this rebalance.
- ``check_commits``, per chunk, from every rank's commit ``Reply``: every daemon at the same
  new version (base + 1) with a digest equal to the engine's own whole-map digest.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from layout_ledger.layout import Map, layout_digest
from layout_ledger.protocol import LayoutView, Outcome, PendingMove, Reply

# ================================================================ startup ====================

# Appended to every failure: what the operator does next.
_RESTART_HINT = (
    "Restart the weight cache daemons (they reload the weights from disk), then start the "
    "engine again."
)


class ExpertLayoutStartupError(RuntimeError):
    """The engine cannot know which expert each slot of its shared weights holds: do not start."""


class FindingKind(enum.Enum):
    """What one rank found on its daemon."""

    RECORD = "record"  # a clean record: version, digest and map, no pending move
    NO_RECORD = "no_record"  # the daemon runs without --enable-eplb
    OLDER_DAEMON = "older_daemon"  # the daemon answered "Unknown request type"
    NO_DAEMON = "no_daemon"  # no socket file: the loader will read the weights from disk
    DIRTY = "dirty"  # an engine left mid-move; the layout is unknown
    STUCK = "stuck"  # another engine's move was still pending when the wait timed out
    UNREADABLE = "unreadable"  # refused, timed out, broke the protocol


_WITHOUT_RECORD = frozenset(
    {FindingKind.NO_RECORD, FindingKind.OLDER_DAEMON, FindingKind.NO_DAEMON}
)
_FAILED = (FindingKind.DIRTY, FindingKind.STUCK, FindingKind.UNREADABLE)


@dataclass(frozen=True)
class RankFinding:
    """One rank's finding. ``initial_digest`` is the digest of the engine's own initial map."""

    rank: int
    kind: FindingKind
    socket_path: str
    initial_digest: str
    version: int | None = None
    digest: str | None = None
    physical_to_logical_map: Map | None = None
    reason: str | None = None

    def describe(self) -> str:
        where = f"rank {self.rank} (daemon {self.socket_path})"
        if self.kind is FindingKind.RECORD:
            return f"{where} at version {self.version}, digest {_short(self.digest)}"
        detail = f": {self.reason}" if self.reason else ""
        return f"{where}: {self.kind.value}{detail}"


@dataclass(frozen=True)
class AdoptLayout:
    """Every daemon keeps a record at this version and digest: route with this map."""

    version: int
    digest: str
    physical_to_logical_map: Map


@dataclass(frozen=True)
class KeepInitialLayout:
    """Start with the engine's own initial layout; ``without_record`` lists the ranks why."""

    without_record: tuple[RankFinding, ...]
    recording_ranks: tuple[int, ...]


@dataclass(frozen=True)
class FailStartup:
    """Every rank raises ``ExpertLayoutStartupError(reason)``."""

    reason: str


Decision = AdoptLayout | KeepInitialLayout | FailStartup


def decide(findings: Sequence[RankFinding]) -> Decision:
    """The one decision for these findings (any order; the result depends only on the set)."""
    if not findings:
        raise ValueError("decide() needs the finding of at least one rank")
    ordered = sorted(findings, key=lambda f: f.rank)
    ranks = [f.rank for f in ordered]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"each rank must report exactly one finding, got ranks {ranks}")

    for kind in _FAILED:
        failed = [f for f in ordered if f.kind is kind]
        if failed:
            return FailStartup(_failure_text(kind, failed))

    recording = [f for f in ordered if f.kind is FindingKind.RECORD]
    records = [_record_of(f) for f in recording]

    if len({(f.version, f.digest) for f in recording}) > 1:
        return FailStartup(
            "the weight cache daemons disagree on the expert layout: "
            + "; ".join(f.describe() for f in recording)
            + ". The engine cannot route with one layout over weights laid out differently. "
            + _RESTART_HINT
        )

    without = [f for f in ordered if f.kind in _WITHOUT_RECORD]
    if not without:
        return records[0]

    if recording:
        moved = [f for f in recording if f.version != 0]
        if moved:
            return FailStartup(
                "some weight cache daemons keep no expert layout record while others have "
                "moved experts, so the engine cannot know the layout on every rank: "
                + "; ".join(f.describe() for f in moved)
                + "; without a record: "
                + "; ".join(f.describe() for f in without)
                + ". "
                + _RESTART_HINT
            )
        different = [f for f in recording if f.digest != f.initial_digest]
        if different:
            return FailStartup(
                "some weight cache daemons keep no expert layout record, and the recording "
                "daemons hold a version-0 layout other than this engine's initial layout: "
                + "; ".join(
                    f"{f.describe()} (engine's initial layout {_short(f.initial_digest)})"
                    for f in different
                )
                + "; without a record: "
                + "; ".join(f.describe() for f in without)
                + ". Start the engine and the daemons with the same --init-expert-location "
                "and --ep-num-redundant-experts."
            )
    return KeepInitialLayout(
        without_record=tuple(without), recording_ranks=tuple(f.rank for f in recording)
    )


def pending_move_text(pending: PendingMove) -> str:
    """A pending move in the words of a startup failure."""
    return (
        f"engine {pending.engine_id!r} began a move of layers {list(pending.layers)} from "
        f"version {pending.base_version}"
    )


def finding_from_layout(
    layout: LayoutView,
    *,
    rank: int,
    socket_path: str,
    initial_digest: str,
    still_pending: str = "",
) -> RankFinding:
    """What a rank finds in its daemon's layout once it stopped waiting for a pending move.

    Dirty: DIRTY with the daemon's reason. A move still pending: STUCK, the move named, then
    ``still_pending`` (how long the rank waited). A map that does not hash to the digest the
    daemon reports: UNREADABLE. Otherwise a RECORD of version, digest and map.
    """

    def found(kind: FindingKind, **fields: Any) -> RankFinding:
        return RankFinding(rank, kind, socket_path, initial_digest, **fields)

    if layout.dirty:
        return found(FindingKind.DIRTY, reason=layout.dirty_reason or "marked dirty")
    if layout.pending is not None:
        reason = f"{pending_move_text(layout.pending)}, and it was still pending{still_pending}"
        return found(FindingKind.STUCK, reason=reason)
    actual = layout_digest(layout.physical_to_logical_map)
    if actual != layout.digest:
        return found(
            FindingKind.UNREADABLE,
            reason=f"the daemon's map hashes to {actual[:12]}, not to the digest "
            f"{layout.digest[:12]} it reports",
        )
    return found(
        FindingKind.RECORD,
        version=layout.version,
        digest=layout.digest,
        physical_to_logical_map=layout.physical_to_logical_map,
    )


def _record_of(finding: RankFinding) -> AdoptLayout:
    """The layout a RECORD finding reports; raise ``ValueError`` if a field is missing."""
    version, digest, the_map = (
        finding.version,
        finding.digest,
        finding.physical_to_logical_map,
    )
    if version is None or digest is None or the_map is None:
        raise ValueError(f"a record finding needs version, digest and map: {finding!r}")
    return AdoptLayout(version=version, digest=digest, physical_to_logical_map=the_map)


def _failure_text(kind: FindingKind, failed: Sequence[RankFinding]) -> str:
    listed = "; ".join(f.describe() for f in failed)
    if kind is FindingKind.DIRTY:
        return (
            "a weight cache daemon's expert layout is unknown (dirty), so its weights may be "
            f"half-moved: {listed}. " + _RESTART_HINT
        )
    if kind is FindingKind.STUCK:
        return (
            "another engine's expert move is still pending on a weight cache daemon: "
            f"{listed}. Stop that engine (its daemons are then dirty and must be restarted) "
            "or wait for its move to finish, then start this engine again."
        )
    return (
        f"a rank could not read its weight cache daemon's expert layout: {listed}. "
        "Check that the daemon is running and healthy (or remove its socket file if it is "
        "gone), then start the engine again."
    )


def _short(digest: str | None) -> str:
    return "none" if digest is None else digest[:12]


# ================================================================ rebalance ==================


class WeightSource(enum.Enum):
    """Where a rank's weights came from (what its IPC loader recorded)."""

    DAEMON = "daemon"  # mapped zero-copy from the weight cache daemon
    DISK = "disk"  # the IPC loader fell back to a disk load (client mode, no daemon socket)


# Why shared-weights rebalancing stays off: one warning per reason.
REASON_ELASTIC_EP = (
    "elastic EP is on; rebalancing of daemon-shared weights is not coordinated with elastic EP"
)
REASON_MIXED_SOURCES = "some ranks loaded their weights from disk and others from the daemons"
REASON_UNKNOWN_SOURCE = "the loader recorded no weight source"
REASON_OLDER_DAEMON = "the daemon is an older version without the expert layout protocol"
REASON_NO_RECORD = "the daemon runs without --enable-eplb and keeps no expert layout record"
REASON_NOT_ATTACHED = "the engine did not attach to its daemon at startup"
REASON_VERSIONS_DIFFER = "the daemons are at different layout versions"

RESTART_DAEMONS_ADVICE = (
    "Restart the weight cache daemons before another engine uses them; "
    "this engine keeps serving and will not rebalance again."
)


@dataclass(frozen=True)
class RankLayoutStatus:
    """What one rank knows at its first rebalance; all-gathered, so plain picklable values.

    ``finding`` is what its startup found on its daemon (None: startup did not read a daemon);
    ``attached`` whether its attach connection is open; ``version`` the layout version it routes
    with, when attached.
    """

    weights_from: WeightSource | None
    finding: FindingKind | None
    attached: bool = False
    version: int | None = None

    @property
    def on_record(self) -> bool:
        """Attached to a daemon that keeps a record."""
        return self.finding is FindingKind.RECORD and self.attached


class Mode(enum.Enum):
    ORIGINAL = "original"  # sglang's rebalance, unchanged
    TWO_PHASE = "two_phase"  # begin/move/synchronize/commit/verify per chunk
    OFF = "off"  # never rebalance the shared weights


@dataclass(frozen=True)
class ModeDecision:
    mode: Mode
    reasons: tuple[str, ...] = ()
    version: int | None = None


def decide_mode(statuses: Sequence[RankLayoutStatus], *, elastic_ep: bool) -> ModeDecision:
    """How this engine rebalances, from every rank's status (index = world rank)."""
    sources = {status.weights_from for status in statuses}
    if sources == {WeightSource.DISK}:
        return ModeDecision(Mode.ORIGINAL)
    reasons: list[str] = []

    def add(reason: str, ranks: Sequence[int]) -> None:
        if ranks:
            reasons.append(f"{reason} (rank {', '.join(str(rank) for rank in ranks)})")

    if elastic_ep:
        reasons.append(REASON_ELASTIC_EP)
    add(REASON_MIXED_SOURCES, _ranks_where(statuses, lambda s: s.weights_from is WeightSource.DISK))
    add(REASON_UNKNOWN_SOURCE, _ranks_where(statuses, lambda s: s.weights_from is None))
    daemon_statuses = [
        (rank, s) for rank, s in enumerate(statuses) if s.weights_from is WeightSource.DAEMON
    ]
    for kind, reason in (
        (FindingKind.OLDER_DAEMON, REASON_OLDER_DAEMON),
        (FindingKind.NO_RECORD, REASON_NO_RECORD),
    ):
        add(reason, [rank for rank, s in daemon_statuses if s.finding is kind])
    without_record = (FindingKind.OLDER_DAEMON, FindingKind.NO_RECORD)
    add(
        REASON_NOT_ATTACHED,
        [
            rank
            for rank, s in daemon_statuses
            if s.finding not in without_record and not (s.on_record and isinstance(s.version, int))
        ],
    )
    versions = {s.version for _, s in daemon_statuses if s.on_record}
    if len(versions) > 1:
        reasons.append(f"{REASON_VERSIONS_DIFFER} ({sorted(versions, key=str)})")
    if reasons:
        return ModeDecision(Mode.OFF, tuple(reasons))
    (version,) = versions
    return ModeDecision(Mode.TWO_PHASE, version=version)


def _ranks_where(
    statuses: Sequence[RankLayoutStatus], predicate: Callable[[RankLayoutStatus], bool]
) -> list[int]:
    return [rank for rank, status in enumerate(statuses) if predicate(status)]


class BeginAction(enum.Enum):
    MOVE = "move"
    SKIP = "skip"  # some daemon is busy: stop this rebalance, the next interval retries
    DISABLE = "disable"  # some daemon refused: rebalancing off for good


@dataclass(frozen=True)
class BeginDecision:
    action: BeginAction
    reason: str = ""


def decide_begin(replies: Sequence[Reply]) -> BeginDecision:
    """What every rank does with the all-gathered begin replies (index = world rank).

    A refusal is permanent, so it wins over busy; any outcome that is neither ok nor busy (an
    error, a transport failure, an older daemon, a malformed reply) counts as a refusal.
    """
    refusals = [
        f"rank {rank}: {reply.outcome.value}: {reply.reason}"
        for rank, reply in enumerate(replies)
        if reply.outcome not in (Outcome.OK, Outcome.BUSY)
    ]
    if refusals:
        return BeginDecision(BeginAction.DISABLE, "; ".join(refusals))
    busy = [
        f"rank {rank}: {reply.reason}"
        for rank, reply in enumerate(replies)
        if reply.outcome is Outcome.BUSY
    ]
    if busy:
        return BeginDecision(BeginAction.SKIP, "; ".join(busy))
    return BeginDecision(BeginAction.MOVE)


@dataclass(frozen=True)
class CommitCheck:
    ok: bool
    version: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)


def check_commits(
    replies: Sequence[Reply], *, base_version: int, engine_digest: str
) -> CommitCheck:
    """Did every daemon record this chunk at the same new version, with the engine's digest?

    ``engine_digest`` is the digest of the engine's own whole map after the move; each daemon's
    digest is compared with it, never the other way round.
    """
    problems: list[str] = []
    versions = set()
    for rank, reply in enumerate(replies):
        if not reply.ok:
            problems.append(f"rank {rank}: commit {reply.outcome.value}: {reply.reason}")
            continue
        version, digest = reply.body.get("version"), reply.body.get("digest")
        versions.add(version)
        if version != base_version + 1:
            problems.append(
                f"rank {rank}: daemon recorded version {version!r}, expected {base_version + 1}"
            )
        if digest != engine_digest:
            problems.append(
                f"rank {rank}: daemon digest {digest!r} differs from the engine's {engine_digest}"
            )
    if len(versions) > 1:
        problems.append(f"daemons recorded different versions {sorted(versions, key=str)}")
    if problems:
        return CommitCheck(False, problems=tuple(problems))
    return CommitCheck(True, version=base_version + 1)
