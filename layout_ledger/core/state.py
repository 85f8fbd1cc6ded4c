"""The state of a daemon's layout record at one moment, and the values it is made of.

``LayoutState`` is what a record holds (``LayoutRecord.state()``); its wire form is
``wire.protocol.LayoutView``. ``PendingMove`` is a begun move, ``DirtyMark`` why the layout is
unknown, ``ContentState`` what a content check found. Plain frozen values, so the rules, the
wire and the history package share them without importing the record.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from layout_ledger.core.content import LocalFingerprints
from layout_ledger.core.layout import Geometry, Map


def utc_now() -> str:
    """The ledger's timestamp format: ISO-8601 UTC with microseconds, sortable as text."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class PendingMove:
    """A begun move: which engine, which layers, from which version.

    ``since`` is when the daemon recorded the begin; the daemon and its ledger know it, the wire
    does not carry it (a move read from the wire has ``since`` None).
    """

    engine_id: str
    layers: tuple[int, ...]
    base_version: int
    since: str | None = None


@dataclass(frozen=True)
class Reloading:
    """A reload from the checkpoint writing local slots now (``LayoutRecord.heal``, ``.reload``):
    ``kind`` is ``heal`` or ``reload``, ``engine_id`` the reloading engine's (None for a heal).
    The record's lock is not held while it reads, so the rules refuse what could race it."""

    kind: str
    layers: tuple[int, ...]
    engine_id: str | None = None

    def describe(self) -> str:
        by = "" if self.engine_id is None else f" for engine {self.engine_id!r}"
        return f"a {self.kind}{by} of layers {list(self.layers)} from the checkpoint is running"


def dirty_reason_for(move: PendingMove) -> str:
    """The one wording of why a daemon is dirty, used in the ledger and in every refusal."""
    return (
        f"engine {move.engine_id!r} detached while its move of layers {list(move.layers)} "
        f"from version {move.base_version} was pending, so the weights of those layers may be "
        f"half-moved; restart the daemon (it reloads the weights from disk) and the engines "
        f"that use it"
    )


@dataclass(frozen=True)
class ContentFinding:
    """Content that is not what the record says: which layers, at which version, in words."""

    layers: tuple[int, ...]
    version: int
    reason: str


@dataclass(frozen=True)
class DirtyMark:
    """Why the layout is unknown: the move that was pending when its engine left (``move``), or
    slot content that does not match the record (``content``). Only the first can be repaired
    (``rules.check_repair``)."""

    move: PendingMove | None
    at: str
    content: ContentFinding | None = None

    @property
    def reason(self) -> str:
        if self.move is not None:
            return dirty_reason_for(self.move)
        if self.content is not None:
            return self.content.reason
        return "the layout is unknown"

    @property
    def engine_id(self) -> str | None:
        return None if self.move is None else self.move.engine_id

    @property
    def layers(self) -> tuple[int, ...]:
        if self.move is not None:
            return self.move.layers
        return () if self.content is None else self.content.layers

    @property
    def base_version(self) -> int | None:
        if self.move is not None:
            return self.move.base_version
        return None if self.content is None else self.content.version


@dataclass(frozen=True)
class Cordon:
    """An operator's cordon on a daemon: every begin is answered ``busy`` (``rules.check_begin``)
    from ``since`` until an uncordon, or until the incarnation ends (a daemon restart clears it)."""

    since: str
    reason: str


@dataclass(frozen=True)
class RestoredFrom:
    """The committed version an incarnation restored: it started at this ``version`` and
    ``digest``, with the map ``incarnation`` recorded for them (``--expert-layout-restore last``).

    ``source`` None: ``incarnation`` is an earlier incarnation of this ledger; otherwise it names
    the ledger of another daemon of the engine whose rows were taken (``incarnation`` is that
    ledger's). The wire carries incarnation, version and digest (``wire.protocol.LayoutView``).
    """

    incarnation: int
    version: int
    digest: str
    source: str | None = None

    def describe(self) -> str:
        """The ``restore`` event's reason, derived from these fields alone (a replay rebuilds
        it from the incarnation's row)."""
        where = "" if self.source is None else f" of {self.source}"
        return f"restored version {self.version} of incarnation {self.incarnation}{where}"

    def to_wire(self) -> dict[str, int | str]:
        return {"incarnation": self.incarnation, "version": self.version, "digest": self.digest}


@dataclass(frozen=True)
class CheckpointChange:
    """A restored incarnation loads another checkpoint than its ledger's ``incarnation`` did:
    identity ``old`` there, ``new`` now (``checkpoint_changed``). ``baseline``: the incarnation
    whose clean load of ``new`` its slots are judged against (None: none, its own load becomes
    the new baseline)."""

    old: str
    incarnation: int
    new: str
    baseline: int | None = None

    def describe(self) -> str:
        """The ``checkpoint_changed`` event's reason: both identities, and what the slots were
        judged against."""
        against = (
            "its load becomes that checkpoint's baseline"
            if self.baseline is None
            else f"its slots are judged against incarnation {self.baseline}'s clean load of it"
        )
        return (
            f"the checkpoint changed: identity {self.old} (incarnation {self.incarnation}) -> "
            f"{self.new}; the restored layout keeps its version and digest, {against}"
        )


# An attached engine's role (``expert_layout_attach``'s optional ``role``): an ``active`` engine
# serves and always holds an active lease; a ``standby`` holds one only while it serves (from an
# ``expert_layout_lease`` to its ``expert_layout_release`` or its detach). The one-mover rule
# counts lease holders only (``rules.lease_holders``).
ROLE_ACTIVE = "active"
ROLE_STANDBY = "standby"
ROLES = (ROLE_ACTIVE, ROLE_STANDBY)


@dataclass(frozen=True)
class LayoutState:
    """What a daemon's record holds at one moment (live, or derived by a replay)."""

    incarnation_id: int
    geometry: Geometry
    version: int
    digest: str
    physical_to_logical_map: Map
    pending: PendingMove | None = None
    dirty: DirtyMark | None = None
    attached: tuple[str, ...] = field(default_factory=tuple)
    non_following_fetch: bool = False
    cordon: Cordon | None = None
    # The attached engines whose role is standby (every other attached engine is active), and
    # those of them that hold a lease now.
    standbys: tuple[str, ...] = field(default_factory=tuple)
    leases: tuple[str, ...] = field(default_factory=tuple)
    # The committed version this incarnation restored at its start (None: it started at
    # version 0 in sglang's initial layout).
    restored_from: RestoredFrom | None = None
    # A heal or reload writing slots from the checkpoint now (live records only; a replay
    # never sees one: it ends in the same event that records it).
    reloading: Reloading | None = None

    def role_of(self, engine_id: str) -> str:
        """An attached engine's role."""
        return ROLE_STANDBY if engine_id in self.standbys else ROLE_ACTIVE

    def holds_lease(self, engine_id: str) -> bool:
        """Whether an attached engine holds an active lease (every active engine does)."""
        return engine_id in self.attached and (
            engine_id not in self.standbys or engine_id in self.leases
        )


@dataclass(frozen=True)
class ContentState:
    """What a content check found: the record's state, the fingerprints it holds for the local
    slots (``recorded``) and the ones the slots have now (``current``)."""

    state: LayoutState
    recorded: LocalFingerprints
    current: LocalFingerprints

    @property
    def dirty(self) -> bool:
        return self.state.dirty is not None

    @property
    def dirty_reason(self) -> str | None:
        return None if self.state.dirty is None else self.state.dirty.reason

    @property
    def dirty_move(self) -> PendingMove | None:
        """The unfinished move of an engine that left mid-move (the one cause a repair clears,
        ``rules.check_repair``)."""
        return None if self.state.dirty is None else self.state.dirty.move
