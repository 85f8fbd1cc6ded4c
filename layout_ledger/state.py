"""Snapshots of a daemon's layout record, and their wire form (PROTOCOL.md "layout state")."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from layout_ledger.layout import Geometry, Map


def utc_now() -> str:
    """The ledger's timestamp format: ISO-8601 UTC with microseconds, sortable as text."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class PendingMove:
    """A begun move: which engine, which layers, from which version."""

    engine_id: str
    layers: tuple[int, ...]
    base_version: int
    since: str

    def to_protocol(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "layers": list(self.layers),
            "base_version": self.base_version,
        }


def dirty_reason_for(move: PendingMove) -> str:
    """The one wording of why a daemon is dirty, used in the ledger and in every refusal."""
    return (
        f"engine {move.engine_id!r} detached while its move of layers {list(move.layers)} "
        f"from version {move.base_version} was pending, so the weights of those layers may be "
        f"half-moved; restart the daemon (it reloads the weights from disk) and the engines "
        f"that use it"
    )


@dataclass(frozen=True)
class DirtyMark:
    """Why the layout is unknown: the move that was pending when its engine left."""

    move: PendingMove
    at: str

    @property
    def reason(self) -> str:
        return dirty_reason_for(self.move)


@dataclass(frozen=True)
class LayoutState:
    """One consistent snapshot of a daemon's record."""

    incarnation_id: int
    geometry: Geometry
    version: int
    digest: str
    physical_to_logical_map: Map
    pending: PendingMove | None = None
    dirty: DirtyMark | None = None
    attached: tuple[str, ...] = field(default_factory=tuple)
    non_following_fetch: bool = False

    def to_protocol(self) -> dict[str, Any]:
        """The ``layout`` field of an ``ok`` reply, exactly as PROTOCOL.md spells it."""
        return {
            "version": self.version,
            "digest": self.digest,
            "physical_to_logical_map": [list(row) for row in self.physical_to_logical_map],
            "dirty": self.dirty is not None,
            "dirty_reason": self.dirty.reason if self.dirty else None,
            "pending": self.pending.to_protocol() if self.pending else None,
            "attached": list(self.attached),
            "non_following_fetch": self.non_following_fetch,
        }
