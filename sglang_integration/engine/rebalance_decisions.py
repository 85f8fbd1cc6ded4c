"""The engine's pure rebalance decisions: every rank computes the same one from all-gathered values.

- ``decide_mode``, once, from every rank's ``RankLayoutStatus``: weights from disk on every rank
  rebalance as sglang does; weights from the daemons on every rank, each attached to a daemon
  that keeps a record, all at one version, move in two phases; anything else (an older daemon,
  a daemon without ``--enable-eplb``, an engine that did not attach, ranks mixing disk and daemon
  weights, elastic EP) never rebalances the shared weights, one reason per cause.
- ``decide_begin``, per chunk, from every rank's begin ``Reply``: all ``ok`` -> move; any
  refusal (or an error) -> off for good; otherwise any ``busy`` -> skip this rebalance.
- ``check_commits``, per chunk, from every rank's commit ``Reply``: every daemon at the same
  new version (base + 1) with a digest equal to the engine's own whole-map digest.

Pure: no sglang, no torch, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from layout_ledger.core.startup_verdict import FindingKind
from layout_ledger.wire.protocol import Outcome, Reply


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
