"""The engine's startup rule: from what every rank found on its daemon, one verdict.

Each rank describes its daemon as a ``RankFinding`` (``finding_from_layout``), the ranks
all-gather them, and ``decide`` turns the same list into the same verdict on every rank: adopt
the daemons' layout, keep the engine's initial one, or fail on every rank with the reason. It is
in the core so that ``layout-ledger fleet`` reaches the engine's own verdict from the ledgers,
without sglang. Pure: no sglang, no torch, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from layout_ledger.core.layout import Map, layout_digest
from layout_ledger.core.state import PendingMove

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
    """The one decision for these findings (any order; the result depends only on the set).

    1. any daemon dirty, any move still pending after the wait, any rank that could not read
       its daemon: fail;
    2. recording daemons that disagree on version or digest: fail;
    3. every daemon keeps a record, all at one version and digest: adopt that map;
    4. some daemons keep no record (an older daemon, one without ``--enable-eplb``, no daemon):
       keep the initial layout if every recording daemon still holds it at version 0, else fail;
    5. no daemon keeps a record: keep the initial layout.
    """
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

    if len({(f.version, f.digest) for f in recording}) > 1:
        return FailStartup(
            "the weight cache daemons disagree on the expert layout: "
            + "; ".join(f.describe() for f in recording)
            + ". The engine cannot route with one layout over weights laid out differently. "
            + _RESTART_HINT
        )

    without = [f for f in ordered if f.kind in _WITHOUT_RECORD]
    if not without:
        # One version and digest, so one map: only the first record needs to carry it (an
        # engine's ranks gather no map where the digests agree; each puts its own in).
        return _record_of(recording[0])

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


class LayoutSeen(Protocol):
    """What a rank reads of its daemon's layout (``wire.protocol.LayoutView`` is one)."""

    @property
    def version(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def physical_to_logical_map(self) -> Map: ...
    @property
    def dirty(self) -> bool: ...
    @property
    def dirty_reason(self) -> str | None: ...
    @property
    def pending(self) -> PendingMove | None: ...


def finding_from_layout(
    layout: LayoutSeen,
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
