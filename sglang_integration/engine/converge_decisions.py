"""The engine's pure convergence decision: clean daemons at different layouts, one target.

An engine's daemons can be clean and still hold different layouts: a mover killed between two
ranks' commits (some daemons at version 6, some at 5), or one daemon restarted alone into
another layout. The engine starts on the newest layout any of them committed, every daemon
brought to that version and digest, or fails naming daemons, versions and the reason
(``plan_convergence``). Each rank's daemon gets there one way:

- **stay**: it holds the target (version and digest) already;
- **move**: a two-phase move (begin at its version, sglang's own expert move, commit the rows
  that differ), when its version is the target's minus one (a commit adds one) and every
  expert the target puts in its local slots, in the layers that change, is held now in some
  daemon's local slots (``held_map``: each daemon's local slots under its own map; sglang's
  move copies an expert only from a slot that holds it);
- **reload**: ``expert_layout_reload`` from its version to the target's (its version chain
  jumps), which reloads from its checkpoint the local slots whose expert changes; where a move
  cannot (a gap of more than one version, an expert no daemon holds now). Reloads run first,
  so what a reloaded daemon holds then (the target's slots) counts for the moves.

The one-mover rule holds here too: a daemon that must change while another engine is attached
to it fails startup (an engine that is not alone on a daemon never changes it). Every rank
computes the same plan from the same all-gathered values. Pure: no sglang, no torch, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.core.layout import Map
from layout_ledger.core.startup_verdict import FailStartup, FindingKind, RankFinding
from layout_ledger.wire.protocol import Reply

# What the operator does when no daemon can reach the target.
RESTART_HINT = (
    "Restart the weight cache daemons (they reload the weights from disk), then start the "
    "engine again."
)
_RESTART_INSTEAD = "restart the weight cache daemons (they reload the weights from disk)."
# How many missing experts a failure names before it says how many more.
_SHOWN = 6


class Way(enum.Enum):
    """How one rank's daemon reaches the target layout."""

    STAY = "stay"
    MOVE = "move"
    RELOAD = "reload"


@dataclass(frozen=True)
class DaemonStep:
    """One rank's way to the target. ``layers``: where its map differs from the target."""

    rank: int
    socket_path: str
    way: Way
    version: int
    digest: str
    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ConvergePlan:
    """Bring every daemon to ``version`` / ``digest`` / ``physical_to_logical_map``.

    ``held_map`` is what the daemons' local slots hold now (each rank's slots under its own
    daemon's map); the engine routes with it until the move, sglang's move goes from it to the
    target. ``move_layers`` are the layers whose held rows differ from the target's.
    """

    version: int
    digest: str
    physical_to_logical_map: Map
    held_map: Map
    steps: tuple[DaemonStep, ...]

    def of_way(self, way: Way) -> tuple[DaemonStep, ...]:
        return tuple(step for step in self.steps if step.way is way)

    def step_of(self, rank: int) -> DaemonStep:
        (step,) = [step for step in self.steps if step.rank == rank]
        return step

    @property
    def move_layers(self) -> tuple[int, ...]:
        return tuple(
            layer
            for layer, row in enumerate(self.physical_to_logical_map)
            if list(self.held_map[layer]) != list(row)
        )

    def describe(self) -> str:
        """The steps in the words of a log line: rank, daemon, way, from which version."""
        return "; ".join(
            f"rank {s.rank} (daemon {s.socket_path}) at version {s.version}: {s.way.value}"
            for s in self.steps
        )


@dataclass(frozen=True)
class ConvergeByMove:
    """The startup decision when a move is left: route with ``plan.held_map`` until the weights
    are loaded, then move to the target (``converge.move_after_load``)."""

    plan: ConvergePlan


def needs_convergence(findings: Sequence[RankFinding]) -> bool:
    """Whether these findings are clean records at more than one version or digest (the only
    case the plan handles; every other disagreement keeps ``startup_verdict.decide``'s verdict)."""
    return (
        len(findings) > 1
        and all(f.kind is FindingKind.RECORD for f in findings)
        and len({(f.version, f.digest) for f in findings}) > 1
    )


def held_map(findings: Sequence[RankFinding], num_local_slots: int) -> Map:
    """What the daemons' local slots hold: rank r's slots ``[r * n, (r + 1) * n)`` of every
    layer as rank r's daemon's map names them (a daemon holds only its own local slots)."""
    ordered = sorted(findings, key=lambda f: f.rank)
    first = _map_of(ordered[0])
    held = [list(row) for row in first]
    for finding in ordered:
        the_map = _map_of(finding)
        start = finding.rank * num_local_slots
        for layer, row in enumerate(the_map):
            held[layer][start : start + num_local_slots] = row[start : start + num_local_slots]
    return held


def plan_convergence(
    findings: Sequence[RankFinding],
    attached: Sequence[Sequence[str]],
    *,
    engine_id: str,
    num_local_slots: int,
    reloaded: Sequence[int] = (),
) -> ConvergePlan | FailStartup:
    """The plan that brings every daemon to the newest committed layout, or the failure.

    ``attached[i]`` lists the engines attached to the daemon of ``findings[i]`` (in the same
    order). ``reloaded`` names ranks whose daemon this engine already reloaded: a second plan
    that wants to reload one again is a failure (a reload that did not reach the target).

    1. the target is the newest version any daemon committed; daemons at that version with
       different digests: fail (two maps under one number, no newest layout);
    2. every map must have the target's shape: else fail;
    3. a daemon not at the target with another engine attached: fail (one-mover rule);
    4. each rank not at the target moves when its version is the target's minus one and every
       expert the target puts in its local slots is held after the reloads; else it reloads
       (repeated until no more rank must reload, since a reload changes what is held).
    """
    if not needs_convergence(findings):
        raise ValueError("plan_convergence() needs clean records at different layouts")
    if len(attached) != len(findings):
        raise ValueError("attached must list the engines of every finding's daemon")
    engines = {f.rank: tuple(names) for f, names in zip(findings, attached, strict=True)}
    ordered = sorted(findings, key=lambda f: f.rank)
    newest = max(_version_of(f) for f in ordered)
    at_newest = [f for f in ordered if f.version == newest]
    if len({f.digest for f in at_newest}) > 1:
        return FailStartup(
            f"the weight cache daemons disagree on the expert layout, and version {newest}, "
            "the newest, names different maps on different daemons, so no layout is the newest: "
            + _listed(ordered)
            + ". "
            + RESTART_HINT
        )
    target = _map_of(at_newest[0])
    digest = str(at_newest[0].digest)
    shape = _shape(target)
    odd = [f for f in ordered if _shape(_map_of(f)) != shape]
    if odd:
        return FailStartup(
            "the weight cache daemons disagree on the expert layout, and their maps have "
            f"different shapes (the newest, version {newest}: {shape[0]} layers of {shape[1]} "
            "slots): "
            + "; ".join(f"{f.describe()}: {_shape(_map_of(f))}" for f in odd)
            + ". Start the daemons of one engine with the same model and "
            "--ep-num-redundant-experts."
        )
    behind = [f for f in ordered if f.digest != digest]
    crowded = [f for f in behind if engines[f.rank] != (engine_id,)]
    if crowded:
        return FailStartup(
            "the weight cache daemons disagree on the expert layout "
            f"({_listed(ordered)}), and this engine cannot bring them to version {newest}: "
            + "; ".join(
                f"{f.describe()} has other engines attached "
                f"({', '.join(repr(e) for e in engines[f.rank] if e != engine_id) or 'none'})"
                for f in crowded
            )
            + ". An engine that is not alone on a daemon never changes it. Stop the other "
            "engines, then start this engine again; or " + _RESTART_INSTEAD
        )
    reloads = {f.rank for f in behind if f.version != newest - 1}
    while True:
        held = _held_after(ordered, reloads, target, num_local_slots)
        missing = {
            f.rank: _missing(target, held, f.rank, num_local_slots)
            for f in behind
            if f.rank not in reloads
        }
        more = {rank for rank, gone in missing.items() if gone}
        if not more:
            break
        reloads |= more
    again = sorted(reloads & set(reloaded))
    if again:
        return FailStartup(
            f"reloading the weight cache daemons of ranks {again} did not bring them to version "
            f"{newest} (digest {digest[:12]}): {_listed(ordered)}. " + RESTART_HINT
        )
    steps = tuple(
        DaemonStep(
            rank=f.rank,
            socket_path=f.socket_path,
            way=Way.STAY if f.digest == digest else Way.RELOAD if f.rank in reloads else Way.MOVE,
            version=_version_of(f),
            digest=str(f.digest),
            layers=_differing_layers(_map_of(f), target),
        )
        for f in ordered
    )
    return ConvergePlan(
        version=newest,
        digest=digest,
        physical_to_logical_map=[list(row) for row in target],
        held_map=held_map(ordered, num_local_slots),
        steps=steps,
    )


def why_reload(plan: ConvergePlan, step: DaemonStep, num_local_slots: int) -> str:
    """Why this rank's daemon reloads rather than moves (for the log and a failure)."""
    if step.version != plan.version - 1:
        return (
            f"a move commits version {step.version + 1}, not {plan.version}; only a reload "
            f"jumps from version {step.version}"
        )
    gone = _missing(plan.physical_to_logical_map, plan.held_map, step.rank, num_local_slots)
    return "no daemon's slots hold " + _missing_text(gone)


def check_steps(
    plan: ConvergePlan, way: Way, replies: Sequence[tuple[int, Reply | None]]
) -> list[str]:
    """The problems of the replies of one way's requests (reload or commit): every daemon that
    took that way must report the target's version and digest. ``replies`` are (rank, reply)
    of every rank, None where the rank sent nothing. Empty: all reached the target."""
    wanted = {step.rank: step for step in plan.of_way(way)}
    problems: list[str] = []
    for rank, reply in sorted(replies, key=lambda pair: pair[0]):
        step = wanted.get(rank)
        if step is None:
            continue
        where = f"rank {rank} (daemon {step.socket_path}, at version {step.version})"
        if reply is None:
            problems.append(f"{where}: sent no {way.value}")
            continue
        if not reply.ok:
            problems.append(f"{where}: {way.value} {reply.outcome.value}: {reply.reason}")
            continue
        version, digest = _reached(reply)
        if version != plan.version or digest != plan.digest:
            problems.append(
                f"{where}: recorded version {version!r}, digest {str(digest)[:12]!r}, not "
                f"version {plan.version}, digest {plan.digest[:12]}"
            )
    return problems


def _reached(reply: Reply) -> tuple[object, object]:
    """The version and digest an ``ok`` reply reports: a commit's own fields, a reload's
    ``layout``."""
    layout = reply.layout
    if layout is not None:
        return layout.version, layout.digest
    return reply.body.get("version"), reply.body.get("digest")


def _held_after(
    ordered: Sequence[RankFinding], reloads: set[int], target: Map, num_local_slots: int
) -> Map:
    """What the local slots hold once ``reloads``' daemons hold the target's slots."""
    held = held_map(ordered, num_local_slots)
    for rank in reloads:
        start = rank * num_local_slots
        for layer, row in enumerate(target):
            held[layer][start : start + num_local_slots] = row[start : start + num_local_slots]
    return held


def _missing(target: Map, held: Map, rank: int, num_local_slots: int) -> list[tuple[int, int]]:
    """(layer, expert) the target puts in ``rank``'s local slots that no local slot holds."""
    start = rank * num_local_slots
    gone: list[tuple[int, int]] = []
    for layer, row in enumerate(target):
        present = set(held[layer])
        for expert in sorted(set(row[start : start + num_local_slots])):
            if expert not in present:
                gone.append((layer, expert))
    return gone


def _missing_text(gone: Sequence[tuple[int, int]]) -> str:
    shown = ", ".join(f"expert {expert} of layer {layer}" for layer, expert in gone[:_SHOWN])
    more = f" and {len(gone) - _SHOWN} more" if len(gone) > _SHOWN else ""
    return shown + more + ", which the target places on it"


def _differing_layers(the_map: Map, target: Map) -> tuple[int, ...]:
    return tuple(layer for layer, row in enumerate(target) if list(the_map[layer]) != list(row))


def _listed(ordered: Sequence[RankFinding]) -> str:
    return "; ".join(f.describe() for f in ordered)


def _shape(the_map: Map) -> tuple[int, int]:
    return len(the_map), len(the_map[0]) if the_map else 0


def _map_of(finding: RankFinding) -> Map:
    if finding.physical_to_logical_map is None:
        raise ValueError(f"a record finding needs a map: {finding!r}")
    return finding.physical_to_logical_map


def _version_of(finding: RankFinding) -> int:
    if finding.version is None:
        raise ValueError(f"a record finding needs a version: {finding!r}")
    return finding.version
