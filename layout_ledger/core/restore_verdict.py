"""The restore rule: from what every daemon of one engine found in its ledger, one verdict.

The daemons of one engine start together in one process group. Before any of them loads its
weights, each describes what its ledger offers as a ``RestoreFinding``; they all-gather the
findings over that group and ``decide`` turns the same list into the same verdict in every
daemon: all restore the newest version any of them committed (``Restore``, its map from the
daemon that holds it), or all load sglang's initial layout (``LoadInitial``, with the reason).
Pure: no sglang, no torch, no I/O; a finding is a plain value, so it travels pickled.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import Geometry, Map, layout_digest, validate_map
from layout_ledger.core.state import RestoredFrom


class OfferKind(enum.Enum):
    """What one daemon's ledger offers."""

    OFFER = "offer"  # a committed version of the same geometry and checkpoint, its rows verified
    NOTHING = "nothing"  # nothing to restore (no earlier version, another model or geometry)
    UNREADABLE = "unreadable"  # the ledger cannot be opened or its rows do not verify
    INITIAL = "initial"  # the daemon runs with --expert-layout-restore initial


@dataclass(frozen=True)
class RestoreFinding:
    """One daemon's finding: what it is about to load, and what its ledger offers.

    ``checkpoint_digest`` and ``geometry`` are what it loads now, ``initial_digest`` the digest
    of the initial layout sglang built for it; for an ``OFFER``, the offered version: of
    ``incarnation`` of the ledger at ``ledger``, with its ``digest`` and map.
    """

    rank: int
    ledger: str
    kind: OfferKind
    checkpoint_digest: str
    geometry: Geometry
    initial_digest: str
    reason: str = ""
    incarnation: int | None = None
    version: int | None = None
    digest: str | None = None
    physical_to_logical_map: Map | None = None

    def describe(self) -> str:
        where = f"rank {self.rank} (ledger {self.ledger})"
        if self.kind is OfferKind.OFFER:
            return (
                f"{where} offers version {self.version} of incarnation {self.incarnation}, "
                f"digest {_short(self.digest)}"
            )
        return f"{where}: {self.reason or self.kind.value}"


@dataclass(frozen=True)
class Restore:
    """Every daemon loads its weights into this version's map and starts at its number and
    digest; ``holder`` is the finding whose rows it is (the lowest rank that offered it)."""

    version: int
    digest: str
    physical_to_logical_map: Map
    holder: RestoreFinding

    def restored_from(self, own: RestoreFinding) -> RestoredFrom:
        """What the daemon of ``own`` records: its own ledger's incarnation when it offered this
        very version, else the holder's, naming the holder's ledger."""
        if own.kind is OfferKind.OFFER and (own.version, own.digest) == (
            self.version,
            self.digest,
        ):
            return RestoredFrom(_incarnation_of(own), self.version, self.digest)
        holder = self.holder
        return RestoredFrom(
            _incarnation_of(holder),
            self.version,
            self.digest,
            source=f"rank {holder.rank}'s ledger {holder.ledger}",
        )


@dataclass(frozen=True)
class LoadInitial:
    """Every daemon loads sglang's initial layout at version 0. ``warn``: one warning names
    ``reason`` (False only when the newest version is that initial layout: nothing to do)."""

    reason: str
    warn: bool = True


Verdict = Restore | LoadInitial


def decide(findings: Sequence[RestoreFinding]) -> Verdict:
    """The one verdict for these findings (any order; it depends only on the set).

    1. a daemon with ``--expert-layout-restore initial``, daemons that load different
       checkpoints or geometries or build different initial layouts, a ledger that cannot be
       read or whose rows do not verify: all load the initial layout;
    2. no ledger offers a version: all load the initial layout, naming each ledger's reason;
    3. the newest offered version, when every offer of that number has one digest (else all
       load the initial layout): all restore it, with the rows of the lowest rank holding it;
    4. but version 0 is sglang's initial layout itself: nothing to restore when its digest is
       the initial one, and a version 0 of another map is never restored (an engine without
       the plugin is served at version 0 only, and routes with the initial layout).
    """
    if not findings:
        raise ValueError("decide() needs the finding of at least one daemon")
    ordered = sorted(findings, key=lambda f: f.rank)
    ranks = [f.rank for f in ordered]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"each daemon must report exactly one finding, got ranks {ranks}")

    initial = [f for f in ordered if f.kind is OfferKind.INITIAL]
    if initial:
        return LoadInitial(
            "--expert-layout-restore initial on " + ", ".join(f"rank {f.rank}" for f in initial)
        )
    for what, values in (
        ("checkpoints", [f.checkpoint_digest for f in ordered]),
        ("geometries", [f.geometry.describe() for f in ordered]),
        ("initial layouts", [f.initial_digest for f in ordered]),
    ):
        if len(set(values)) > 1:
            return LoadInitial(
                f"the daemons of this engine load different {what}: "
                + "; ".join(
                    f"rank {f.rank} {_short(v)}" for f, v in zip(ordered, values, strict=True)
                )
            )
    unreadable = [f for f in ordered if f.kind is OfferKind.UNREADABLE]
    if unreadable:
        return LoadInitial(
            "a ledger cannot be read or its rows do not verify: "
            + "; ".join(f.describe() for f in unreadable)
        )
    offers = [f for f in ordered if f.kind is OfferKind.OFFER]
    if not offers:
        return LoadInitial("nothing to restore: " + "; ".join(f.describe() for f in ordered))
    newest = max(_version_of(f) for f in offers)
    at_newest = [f for f in offers if f.version == newest]
    if len({f.digest for f in at_newest}) > 1:
        return LoadInitial(
            f"the ledgers name version {newest} with different maps: "
            + "; ".join(f.describe() for f in at_newest)
        )
    holder = at_newest[0]
    try:
        the_map = validate_map(holder.physical_to_logical_map, holder.geometry)
    except LedgerError as exc:
        return LoadInitial(f"{holder.describe()}, but its map is not one of its geometry: {exc}")
    digest = layout_digest(the_map)
    if digest != holder.digest:
        return LoadInitial(
            f"{holder.describe()}, but its map hashes to {digest[:12]}: rows that do not verify"
        )
    if newest == 0:
        if digest == holder.initial_digest:
            return LoadInitial(
                "the newest committed version is version 0, sglang's initial layout: nothing "
                "to restore",
                warn=False,
            )
        return LoadInitial(
            f"{holder.describe()}, a version 0 other than this daemon's initial layout "
            f"{holder.initial_digest[:12]} (another --init-expert-location?); version 0 only "
            f"ever names the initial layout"
        )
    return Restore(newest, digest, the_map, holder)


def _version_of(finding: RestoreFinding) -> int:
    if finding.version is None:
        raise ValueError(f"an offer needs its version: {finding!r}")
    return finding.version


def _incarnation_of(finding: RestoreFinding) -> int:
    if finding.incarnation is None:
        raise ValueError(f"an offer needs its incarnation: {finding!r}")
    return finding.incarnation


def _short(digest: str | None) -> str:
    """A digest's first 12 characters (other text as it is)."""
    if digest is None:
        return "none"
    return digest[:12] if len(digest) == 64 else digest
