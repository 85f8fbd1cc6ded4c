"""The engine ranks' content decisions (``sglang_integration.engine.content_decisions``), as pure
functions.

Two EP ranks of 6 slots each (8 experts, slots 8-11 replicate 0-3). Each rank's daemon answered
the content check with a ``ContentView``; the decisions must name what stops a repair or a start.
"""

from __future__ import annotations

import dataclasses

import pytest
from content_support import Slots, expert_fingerprint, half_and_half

from layout_ledger.core.content import ExpertContents
from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.core.startup_verdict import FailStartup, FindingKind, RankFinding
from layout_ledger.core.state import PendingMove
from layout_ledger.wire.protocol import ContentView
from sglang_integration.engine.content_decisions import (
    ContentKind,
    NoContentCheck,
    RankContent,
    RepairPlan,
    expected_contents,
    loaded_slot_problems,
    plan_repair,
)

LAYERS, SLOTS, EXPERTS = 4, 12, 8
BASE = trivial_map(LAYERS, SLOTS, EXPERTS)
MOVE = PendingMove("engine-A", (0, 1), 3)
FAILED = FailStartup("a daemon is dirty.")
SHAPE = (LAYERS, SLOTS, EXPERTS)


def _world() -> list[Slots]:
    return [Slots(BASE, 0, 6), Slots(BASE, 6, 6)]


def _view(slots: Slots, *, dirty_move: PendingMove | None = MOVE, reason: str = "x") -> ContentView:
    recorded = Slots(BASE, slots.first_slot, 6).fingerprints()
    return ContentView(
        version=3,
        digest=layout_digest(BASE),
        physical_to_logical_map=BASE,
        first_slot=slots.first_slot,
        recorded=dict(recorded.layers),
        current=dict(slots.fingerprints().layers),
        dirty=True,
        dirty_reason=reason,
        dirty_move=dirty_move,
        pending=None,
    )


def _findings(kinds=(FindingKind.DIRTY, FindingKind.DIRTY)) -> list[RankFinding]:
    return [RankFinding(rank, kind, f"d{rank}.sock", "x") for rank, kind in enumerate(kinds)]


def _contents(world: list[Slots], **view_args) -> list[RankContent]:
    return [
        RankContent(rank, ContentKind.CONTENT, view=_view(slots, **view_args))
        for rank, slots in enumerate(world)
    ]


def test_a_repair_records_what_the_pending_layers_hold_and_leaves_the_others():
    world = _world()
    world[0].move(0, 1, 3)
    world[1].move(0, 9, 1)  # layer 0: slot 1 holds expert 3, slot 9 expert 1 (a swap)
    plan = plan_repair(_findings(), _contents(world), FAILED, SHAPE)
    assert isinstance(plan, RepairPlan)
    expected_row = list(BASE[0])
    expected_row[1], expected_row[9] = 3, 1
    assert plan.rows == {0: expected_row, 1: list(BASE[1])}
    assert plan.physical_to_logical_map[0] == expected_row
    assert plan.physical_to_logical_map[2:] == BASE[2:]
    assert (plan.base_version, plan.layers, plan.mover) == (3, (0, 1), "engine-A")
    assert plan.fingerprints[1][0] == list(world[1].held[0])
    assert plan.digest == layout_digest(plan.physical_to_logical_map)


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (
            lambda w: w[0].put(1, 2, half_and_half(1, 6, 2)),
            "rank 0 layer 1 slot 2 holds partial: parts 0-1 of expert 6, parts 2-3 of expert 2",
        ),
        (lambda w: w[1].zero(0, 7), "rank 1 layer 0 slot 7 holds zero-filled"),
        (lambda w: w[1].put(0, 8, "ab" * 32), "rank 1 layer 0 slot 8 holds unknown content"),
        (lambda w: w[0].move(1, 5, 0), "layer 1 would hold no copy of experts [5]"),
        (lambda w: w[1].move(3, 6, 0), "content outside the pending layers moved: rank 1 layer 3"),
    ],
)
def test_no_repair_names_the_slots_whose_content_is_not_a_valid_layout(damage, named):
    world = _world()
    damage(world)
    result = plan_repair(_findings(), _contents(world), FAILED, SHAPE)
    assert isinstance(result, FailStartup)
    assert result.reason.startswith("a daemon is dirty. No repair is possible: ")
    assert named in result.reason


def test_no_repair_unless_every_daemon_was_left_by_the_same_unfinished_move():
    world = _world()
    mixed = plan_repair(
        _findings((FindingKind.DIRTY, FindingKind.RECORD)), _contents(world), FAILED, SHAPE
    )
    assert "not every daemon is dirty from the same unfinished move" in mixed.reason
    contents = _contents(world)
    contents[1] = RankContent(1, ContentKind.CONTENT, view=_view(world[1], dirty_move=None))
    other_cause = plan_repair(_findings(), contents, FAILED, SHAPE)
    assert "dirty for another cause than an unfinished move (rank 1: x)" in other_cause.reason
    older = [contents[0], RankContent(1, ContentKind.OLDER_DAEMON, "Unknown request type")]
    assert (
        "cannot show their slots' content" in plan_repair(_findings(), older, FAILED, SHAPE).reason
    )
    clean = plan_repair(_findings((FindingKind.STUCK, FindingKind.RECORD)), contents, FAILED, SHAPE)
    assert clean is FAILED
    narrower = plan_repair(_findings(), _contents(world), FAILED, (LAYERS, SLOTS - 2, EXPERTS))
    assert "does not have this engine's shape" in narrower.reason


@pytest.mark.parametrize("differ", ["digest", "version"])
def test_no_repair_when_the_daemons_one_move_left_hold_different_layouts(differ):
    # The same move (layers, base version) on both, but rank 1's daemon holds another map (or
    # version): rows derived from rank 0's map would record a layout rank 1 never held.
    contents = _contents(_world())
    view = contents[1].view
    assert view is not None
    other = [list(row) for row in BASE]
    other[3][6], other[3][7] = other[3][7], other[3][6]
    changed: dict[str, object] = (
        {"digest": layout_digest(other), "physical_to_logical_map": other}
        if differ == "digest"
        else {"version": 4}
    )
    contents[1] = RankContent(1, ContentKind.CONTENT, view=dataclasses.replace(view, **changed))
    result = plan_repair(_findings(), contents, FAILED, SHAPE)
    assert isinstance(result, FailStartup)
    assert result.reason == (
        "a daemon is dirty. No repair is possible: the daemons were left by different moves or "
        "at different versions."
    )


def test_expected_contents_learns_every_expert_from_every_daemon_and_flags_conflicts():
    world = _world()
    known = expected_contents(_contents(world), BASE)
    assert isinstance(known, ExpertContents)
    assert known.fingerprint_of(2, 7) == expert_fingerprint(2, 7)  # only rank 1 holds expert 7
    contents = _contents(world)
    view = contents[1].view
    assert view is not None
    recorded = dict(view.recorded)
    # rank 1's slot 10 (expert 2's replica) recorded with other bytes than rank 0's slot 2
    recorded[2] = (*recorded[2][:4], expert_fingerprint(2, 7), *recorded[2][5:])
    contents[1] = RankContent(
        1, ContentKind.CONTENT, view=ContentView(**{**view.__dict__, "recorded": recorded})
    )
    conflict = expected_contents(contents, BASE)
    assert isinstance(conflict, FailStartup)
    assert "layer 2: expert 2 was recorded with two contents" in conflict.reason
    missing = expected_contents(
        [contents[0], RankContent(1, ContentKind.NOT_RECORDED, "off")], BASE
    )
    assert isinstance(missing, NoContentCheck) and missing.reasons == ("rank 1: not_recorded: off",)


def test_loaded_slots_that_do_not_hold_the_named_expert_are_named_with_what_they_hold():
    known = expected_contents(_contents(_world()), BASE)
    assert isinstance(known, ExpertContents)
    loaded = Slots(BASE, 6, 6)
    loaded.zero(1, 10)
    loaded.move(2, 7, 3)
    problems = loaded_slot_problems(1, loaded.fingerprints(), BASE, known)
    assert problems == [
        "rank 1 layer 1 slot 10: expected expert 2, holds zero-filled",
        "rank 1 layer 2 slot 7: expected expert 7, holds expert 3",
    ]
    assert loaded_slot_problems(0, Slots(BASE, 0, 6).fingerprints(), BASE, known) == []


def test_a_loaded_slot_whose_expected_expert_has_no_known_content_is_refused_not_skipped():
    world = _world()
    world[0].zero(1, 5)  # expert 5's only copy, never filled: no daemon recorded its content
    views = [dataclasses.replace(_view(s), recorded=dict(s.fingerprints().layers)) for s in world]
    contents = [RankContent(rank, ContentKind.CONTENT, view=v) for rank, v in enumerate(views)]
    known = expected_contents(contents, BASE)
    assert isinstance(known, ExpertContents) and known.fingerprint_of(1, 5) is None
    problems = loaded_slot_problems(0, world[0].fingerprints(), BASE, known)
    assert problems == [
        "rank 0 layer 1 slot 5: expected expert 5, which no daemon recorded content for "
        "(holds zero-filled)"
    ]


def test_a_repair_plan_carries_each_named_experts_fingerprint_to_the_daemon_that_never_held_it():
    world = _world()
    world[0].move(0, 1, 7)
    world[1].move(0, 7, 1)  # layer 0: expert 7 (rank 1's) into rank 0's slot 1, and back
    plan = plan_repair(_findings(), _contents(world), FAILED, SHAPE)
    assert isinstance(plan, RepairPlan)
    assert plan.expected[0][0][7] == expert_fingerprint(0, 7)
    assert plan.expected[1][0][1] == expert_fingerprint(0, 1)
    assert sorted(plan.expected[0][0]) == sorted(set(plan.rows[0][:6]))  # its own slots only
    assert sorted(plan.expected[0]) == [0, 1]


def test_tied_experts_are_the_expected_content_not_a_conflict_at_engine_startup():
    world = _world()
    for slots in world:
        for layer_slot, expert in enumerate(BASE[2]):
            if expert == 5 and slots.first_slot <= layer_slot < slots.first_slot + 6:
                slots.put(2, layer_slot, expert_fingerprint(2, 4))
    views = [dataclasses.replace(_view(s), recorded=dict(s.fingerprints().layers)) for s in world]
    contents = [RankContent(rank, ContentKind.CONTENT, view=v) for rank, v in enumerate(views)]
    known = expected_contents(contents, BASE)
    assert isinstance(known, ExpertContents), known
    swapped = [list(row) for row in BASE]
    swapped[2][4], swapped[2][5] = 5, 4  # a legitimate commit swapped the tied experts' slots
    assert loaded_slot_problems(0, world[0].fingerprints(), swapped, known) == []
