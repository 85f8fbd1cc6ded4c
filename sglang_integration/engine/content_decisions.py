"""The engine ranks' pure decisions about slot content: expected contents, repairs, load checks.

Like the layout decisions of ``layout_ledger.core.startup_verdict``, every function here turns
all-gathered values into the same result on every rank (no I/O, no torch). At startup each rank
asks its daemon for its content (``expert_layout_content_check``) and describes the answer as a
``RankContent``; then:

- ``expected_contents``: every daemon recorded its slots' fingerprints at the version the
  engine adopts, so every rank learns each logical expert's fingerprint per layer, from all of
  them (an expert a rank never held is known from the rank that did). ``None`` (with the reasons
  to warn once) when some daemon records none: an older daemon, ``--expert-layout-content-check
  off``, no tensors. Daemons that recorded different contents for one expert fail startup.
- ``plan_repair``: daemons that an engine left mid-move (dirty, with the move's layers and base
  version, the same on every daemon). Each slot of the pending layers, as each daemon
  fingerprints it now, must hold a whole known expert, and the derived rows must be valid (every
  logical expert in at least one slot of each layer): then a ``RepairPlan``, else the startup
  failure, naming the slots whose content is unknown or partial.
- ``loaded_slot_problems``: after the weights are loaded, each rank's own slots must hold the
  experts the adopted map names; a slot whose expected expert no daemon recorded content for
  (every copy of it was zero-filled at their load) is refused, never skipped.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from layout_ledger.core.content import ExpertContents, LocalFingerprints, changed_slots
from layout_ledger.core.layout import Map, layout_digest
from layout_ledger.core.startup_verdict import FailStartup, FindingKind, RankFinding
from layout_ledger.wire.protocol import ContentView

# How many slots a failure names before it says how many more.
_SHOWN = 8


class ContentKind(enum.Enum):
    """What one rank's daemon answered to the content check."""

    CONTENT = "content"  # its recorded and current fingerprints
    NOT_RECORDED = "not_recorded"  # no_record: the check is off there, or it serves no tensors
    OLDER_DAEMON = "older_daemon"  # "Unknown request type": a daemon from before content checks
    UNREADABLE = "unreadable"  # an error, a transport failure, a malformed reply
    NOT_ASKED = "not_asked"  # the rank's daemon keeps no record, or the check is off here


@dataclass(frozen=True)
class RankContent:
    """One rank's content finding (all-gathered: plain picklable values)."""

    rank: int
    kind: ContentKind
    reason: str | None = None
    view: ContentView | None = None

    def describe(self) -> str:
        detail = f": {self.reason}" if self.reason else ""
        return f"rank {self.rank}: {self.kind.value}{detail}"


# ================================================================ expected contents =========


@dataclass(frozen=True)
class NoContentCheck:
    """The engine starts without the content check; ``reasons`` says why (warn once)."""

    reasons: tuple[str, ...]


def _views(contents: Sequence[RankContent]) -> list[tuple[int, ContentView]]:
    return [(c.rank, c.view) for c in sorted(contents, key=lambda c: c.rank) if c.view is not None]


def expected_contents(
    contents: Sequence[RankContent],
    the_map: Map,
    *,
    extra: dict[int, LocalFingerprints] | None = None,
) -> ExpertContents | NoContentCheck | FailStartup:
    """Each expert's fingerprint, learned from every daemon's record under ``the_map``.

    ``extra`` (rank -> fingerprints) adds what a repair just recorded.
    """
    missing = [c for c in contents if c.kind is not ContentKind.CONTENT or c.view is None]
    if missing:
        return NoContentCheck(tuple(c.describe() for c in missing))
    known = ExpertContents()
    for rank, view in _views(contents):
        recorded = LocalFingerprints(view.first_slot, view.recorded)
        if extra is not None and rank in extra:
            recorded = recorded.updated(extra[rank])
        for layer in sorted(recorded.layers):
            known.learn_slots(layer, the_map[layer], recorded)
    if known.conflicts:
        return FailStartup(
            "the weight cache daemons recorded different contents for one expert: "
            + "; ".join(known.conflicts[:_SHOWN])
            + ". Restart the weight cache daemons (they reload the weights from disk)."
        )
    return known


# ================================================================ repairs ===================


@dataclass(frozen=True)
class RepairPlan:
    """The rows the weights of the pending layers hold, for every daemon to record."""

    base_version: int
    layers: tuple[int, ...]
    mover: str  # the engine that left the move unfinished
    rows: dict[int, list[int]]
    physical_to_logical_map: Map  # the whole map after the repair
    fingerprints: dict[int, dict[int, list[str]]]  # rank -> layer -> its local slots
    # rank -> layer -> expert -> fingerprint: each expert the rows name in the rank's local
    # slots, as the daemon that holds it recorded it (the repair's expected_fingerprints)
    expected: dict[int, dict[int, dict[int, str]]] = dataclasses.field(default_factory=dict)

    @property
    def digest(self) -> str:
        return layout_digest(self.physical_to_logical_map)


def plan_repair(
    findings: Sequence[RankFinding],
    contents: Sequence[RankContent],
    failure: FailStartup,
    engine_shape: tuple[int, int, int],
) -> RepairPlan | FailStartup:
    """A repair of daemons an engine left mid-move, or ``failure`` (with why not, if tried).

    ``engine_shape``: the engine's layers, physical slots per layer and logical experts.
    """
    if not any(f.kind is FindingKind.DIRTY for f in findings):
        return failure
    if any(f.kind is not FindingKind.DIRTY for f in findings):
        return _no_repair(failure, "not every daemon is dirty from the same unfinished move")
    unusable = [c for c in contents if c.kind is not ContentKind.CONTENT or c.view is None]
    if unusable:
        listed = "; ".join(c.describe() for c in unusable)
        return _no_repair(failure, f"some daemons cannot show their slots' content ({listed})")
    views = _views(contents)
    common = _common_move(views)
    if isinstance(common, str):
        return _no_repair(failure, common)
    layers, base_version, base_map = common
    num_layers, num_slots, num_logical_experts = engine_shape
    if len(base_map) != num_layers or any(len(row) != num_slots for row in base_map):
        return _no_repair(failure, "the daemons' map does not have this engine's shape")
    known = expected_contents(contents, base_map)
    if not isinstance(known, ExpertContents):
        reason = known.reason if isinstance(known, FailStartup) else "; ".join(known.reasons)
        return _no_repair(failure, reason)
    derived = _derive_rows(views, layers, base_map, known, num_logical_experts)
    if isinstance(derived, str):
        return _no_repair(failure, derived)
    new_map = [list(row) for row in base_map]
    for layer, row in derived.items():
        new_map[layer] = row
    prints = {
        rank: {layer: list(view.current[layer]) for layer in layers if layer in view.current}
        for rank, view in views
    }
    mover = next((v.dirty_move.engine_id for _, v in views if v.dirty_move is not None), "")
    expected = {rank: _named_fingerprints(view, derived, known) for rank, view in views}
    return RepairPlan(base_version, layers, mover, derived, new_map, prints, expected)


def _named_fingerprints(
    view: ContentView, rows: dict[int, list[int]], known: ExpertContents
) -> dict[int, dict[int, str]]:
    """Per repaired layer, the fingerprint of each expert ``rows`` names in ``view``'s slots."""
    found: dict[int, dict[int, str]] = {}
    for layer, row in rows.items():
        if layer not in view.current:
            continue
        of_layer: dict[int, str] = {}
        for slot, _ in LocalFingerprints(view.first_slot, view.current).slots(layer):
            fingerprint = known.fingerprint_of(layer, row[slot])
            if fingerprint is not None:
                of_layer[row[slot]] = fingerprint
        found[layer] = of_layer
    return found


def _no_repair(failure: FailStartup, why: str) -> FailStartup:
    return FailStartup(f"{failure.reason} No repair is possible: {why}.")


def _common_move(views: list[tuple[int, ContentView]]) -> tuple[tuple[int, ...], int, Map] | str:
    moves = {(v.dirty_move.layers, v.dirty_move.base_version) for _, v in views if v.dirty_move}
    if any(view.dirty_move is None for _, view in views):
        reasons = "; ".join(f"rank {r}: {v.dirty_reason}" for r, v in views if v.dirty_move is None)
        return f"some daemons are dirty for another cause than an unfinished move ({reasons})"
    if len(moves) != 1 or len({(v.version, v.digest) for _, v in views}) != 1:
        return "the daemons were left by different moves or at different versions"
    ((layers, base_version),) = moves
    moved_elsewhere = []
    for rank, view in views:
        recorded = LocalFingerprints(view.first_slot, view.recorded)
        current = LocalFingerprints(view.first_slot, view.current)
        for layer, indexes in changed_slots(recorded, current, skip=layers).items():
            slots = [view.first_slot + index for index in indexes]
            moved_elsewhere.append(f"rank {rank} layer {layer} slots {slots}")
    if moved_elsewhere:
        return "content outside the pending layers moved: " + "; ".join(moved_elsewhere)
    return tuple(layers), base_version, views[0][1].physical_to_logical_map


def _derive_rows(
    views: list[tuple[int, ContentView]],
    layers: Sequence[int],
    base_map: Map,
    known: ExpertContents,
    num_logical_experts: int,
) -> dict[int, list[int]] | str:
    """The rows the slots hold, or why they cannot be recorded (every bad slot named)."""
    rows: dict[int, list[int]] = {}
    problems: list[str] = []
    for layer in layers:
        if all(layer not in view.current for _, view in views):
            rows[layer] = list(base_map[layer])  # no routed-expert tensors: no move changes it
            continue
        row, layer_problems = _held_row(views, layer, base_map[layer], known)
        problems += layer_problems
        if layer_problems:
            continue
        absent = sorted(set(range(num_logical_experts)) - set(row))
        if absent:
            problems.append(f"layer {layer} would hold no copy of experts {absent}")
        rows[layer] = row
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        return "slots hold unknown or partial content: " + "; ".join(problems[:_SHOWN]) + more
    return rows


def _held_row(
    views: list[tuple[int, ContentView]],
    layer: int,
    base_row: Sequence[int],
    known: ExpertContents,
) -> tuple[list[int], list[str]]:
    """The experts one layer's slots hold, by every daemon's fingerprints, and the problems."""
    num_slots = len(base_row)
    row: list[int | None] = [None] * num_slots
    problems: list[str] = []
    for rank, view in views:
        if layer not in view.current:
            problems.append(f"rank {rank} shows no fingerprints of layer {layer}")
            continue
        for slot, fingerprint in LocalFingerprints(view.first_slot, view.current).slots(layer):
            held = known.identify(layer, fingerprint)
            if not held.whole_expert:
                problems.append(f"rank {rank} layer {layer} slot {slot} holds {held.text}")
            elif slot < num_slots:
                # tied experts (the same bytes): the name the base map gave the slot, if it is
                # one of them (bytes cannot tell them apart), else the first
                named = base_row[slot] if slot < len(base_row) else None
                row[slot] = named if named in held.experts else held.experts[0]
    uncovered = [slot for slot, value in enumerate(row) if value is None]
    if uncovered and not problems:
        problems.append(f"layer {layer} slots {uncovered} are on no daemon")
    return [int(value or 0) for value in row], problems


# ================================================================ after the load ===========


def loaded_slot_problems(
    rank: int, local: LocalFingerprints, the_map: Map, known: ExpertContents
) -> list[str]:
    """This rank's slots that do not hold the expert ``the_map`` names (each named in words)."""
    problems = []
    for layer in sorted(local.layers):
        for slot, fingerprint in local.slots(layer):
            named = int(the_map[layer][slot])
            expected = known.fingerprint_of(layer, named)
            if expected == fingerprint:
                continue
            held = known.identify(layer, fingerprint)
            if expected is None:  # every copy was empty at the daemons' load: nothing to match
                problems.append(
                    f"rank {rank} layer {layer} slot {slot}: expected expert {named}, which no "
                    f"daemon recorded content for (holds {held.text})"
                )
                continue
            problems.append(
                f"rank {rank} layer {layer} slot {slot}: expected expert {named}, holds {held.text}"
            )
    return problems


def loaded_failure(problems: Sequence[str]) -> FailStartup:
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return FailStartup(
        "the loaded expert weights do not hold the experts the layout names: "
        + "; ".join(problems[:_SHOWN])
        + more
        + ". The engine would route tokens to the wrong experts. Restart the weight cache "
        "daemons (they reload the weights from disk), then start the engine again."
    )
