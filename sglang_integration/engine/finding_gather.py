"""What the ranks all-gather of their daemons to decide a start: what the decision needs.

Every rank attaches to its own daemon, and the attach reply carries that daemon's map (checked
to hash to the digest the daemon reports, ``startup_verdict.finding_from_layout``). The
decision (``startup_verdict.decide``) needs every daemon's kind, version and digest, not its
map: where the digests agree, each rank routes with the map it holds (one digest, one map). So
the ranks gather in rounds, one ``all_gather_object`` each, every rank choosing the next round
from the same gathered values (no rank is left in a collective alone):

1. always: each rank's finding without its map (``without_map``), its content finding without
   what only a repair reads (``for_the_decision``: the content view's map and the fingerprints
   the daemon computed now; the recorded ones stay, from which every rank learns each expert's
   fingerprint, ``content_decisions.expected_contents``), and ``extra`` (the start's role).
   Each rank then puts its own map into every record of its daemon's digest;
2. only when clean daemons disagree (``converge_decisions.needs_convergence``: a convergence
   plans from every daemon's map): one map per digest, sent by the lowest rank holding it;
3. only when a daemon is dirty (a repair derives the rows from what every daemon's slots hold
   now, ``content_decisions.plan_repair``): every rank's whole content finding.

What a rank receives in a start whose daemons agree is a few hundred bytes per rank (with the
content check on, plus the recorded fingerprints of every daemon's local slots: the whole map's
slots once, whatever the ranks): linear in the ranks, never the ranks times a map
(docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from layout_ledger.core.layout import Map
from layout_ledger.core.startup_verdict import FindingKind, RankFinding
from sglang_integration.engine.content_decisions import RankContent
from sglang_integration.engine.converge_decisions import needs_convergence

# An all-gather over the engine's ranks: every rank's value, in rank order.
Gather = Callable[[Any], list[Any]]


def world_gather(world: Any) -> Gather:
    """The start's all-gather over sglang's world group: through its first rank, a few steps
    whatever the ranks (``reply_gather``)."""
    from sglang_integration.engine import reply_gather

    return lambda value: reply_gather.all_gather_small(world, value)


@dataclass(frozen=True)
class Gathered:
    """Every rank's finding (maps where the decision needs them), content and extra value."""

    findings: list[RankFinding]
    contents: list[RankContent]
    extras: list[Any]


def gather_findings(
    gather: Gather, finding: RankFinding, content: RankContent, extra: Any = None
) -> Gathered:
    """This rank's part of the start's gathers (see the module docstring); a collective."""
    gathered = gather((without_map(finding), for_the_decision(content), extra))
    findings = with_own_map([each for each, _, _ in gathered], finding)
    contents = [each for _, each, _ in gathered]
    extras = [each for _, _, each in gathered]
    if needs_convergence(findings):
        findings = with_maps(findings, gather(map_to_send(findings, finding)))
    if any(f.kind is FindingKind.DIRTY for f in findings):
        contents = list(gather(content))
    return Gathered(findings, contents, extras)


def without_map(finding: RankFinding) -> RankFinding:
    """The finding as the first round sends it: all but the map."""
    if finding.physical_to_logical_map is None:
        return finding
    return dataclasses.replace(finding, physical_to_logical_map=None)


def for_the_decision(content: RankContent) -> RankContent:
    """The content finding as the first round sends it: the view without its map and without
    the fingerprints the daemon computed now (what only a repair reads)."""
    view = content.view
    if view is None:
        return content
    return dataclasses.replace(
        content, view=dataclasses.replace(view, physical_to_logical_map=[], current={})
    )


def with_own_map(findings: Sequence[RankFinding], own: RankFinding) -> list[RankFinding]:
    """``findings`` with this rank's map in every record of its daemon's version and digest."""
    the_map = own.physical_to_logical_map
    if own.kind is not FindingKind.RECORD or the_map is None:
        return list(findings)
    return [
        dataclasses.replace(f, physical_to_logical_map=the_map)
        if _record_of(f) == _record_of(own)
        else f
        for f in findings
    ]


def map_to_send(findings: Sequence[RankFinding], own: RankFinding) -> Map | None:
    """This rank's map if it is the lowest rank whose daemon holds its version and digest."""
    holders = [f.rank for f in findings if _record_of(f) == _record_of(own)]
    if own.kind is not FindingKind.RECORD or min(holders) != own.rank:
        return None
    return own.physical_to_logical_map


def with_maps(findings: Sequence[RankFinding], sent: Sequence[Map | None]) -> list[RankFinding]:
    """``findings`` with the maps of the second round (``sent``, gathered in the same rank
    order): each record gets the map sent for its version and digest."""
    maps = {
        _record_of(f): the_map
        for f, the_map in zip(findings, sent, strict=True)
        if the_map is not None
    }
    return [
        dataclasses.replace(f, physical_to_logical_map=maps[_record_of(f)])
        if f.kind is FindingKind.RECORD and _record_of(f) in maps
        else f
        for f in findings
    ]


def _record_of(finding: RankFinding) -> tuple[FindingKind, int | None, str | None]:
    return finding.kind, finding.version, finding.digest
