"""Rules of the rulebook (``layout_ledger.core.rules`` and ``record``) that a plausible bug could
break without any other test noticing; each test names its rule and breaks where it is broken.

- At load, a daemon of EP rank r > 0 checks its replicas against its own slots of the map (from
  slot r * slots per rank), not against the map's first slots.
- A commit whose moved-in slot is zero-filled marks the daemon dirty, also for an expert the
  daemon never held (whose content it cannot know).
- A fetch without the ``expert_layout`` field (an older engine) once an expert has moved is
  refused with the advice to upgrade the engine or restart the daemon, whether or not an engine
  is attached.
- The content check marks a daemon dirty for content that moved without a commit in every layer
  that no pending move is changing, a move pending or not; the commit of the move pending then
  is refused (the layout is unknown), and changes nothing.
- A commit whose moved-in slot holds less than the whole expert its row names (half-written,
  or bytes of no expert), an expert the daemon knows, marks the daemon dirty.

Slots are the ``content_support`` stand-ins (a fingerprint per layer and expert); records are the
real ``LayoutRecord`` on a real ledger where the history matters (``verify`` must accept it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from content_support import Slots, expert_fingerprint, half_and_half
from ledger_support import SMALL, open_ledger, refusals_added, table_dump

from layout_ledger.core import errors, rules
from layout_ledger.core.content import ZERO, ExpertContents, LocalFingerprints
from layout_ledger.core.layout import Map, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.ledger import Ledger

LOCAL = 6  # SMALL's 12 slots on two EP ranks: rank 1 holds slots 6-11
INITIAL = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
UPGRADE_ADVICE = "upgrade the engine (install the expert layout plugin) or restart the daemon"


def _rank_one_map() -> Map:
    """A layout whose rank-1 slots replicate experts 6 and 7 (slots 6/8 and 7/9), while the
    map's first six slots hold six different experts: a check that reads the map from slot 0
    sees no replica at all there."""
    row = [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 0, 1]
    return [list(row) for _ in range(SMALL.num_layers)]


def _verified(record: LayoutRecord, path) -> None:
    with LedgerReader(path) as reader:
        report = collect_verify(reader)
        assert reader.state() == record.state()
    assert report.ok, report.first_inconsistency


# --- the load check reads each rank's own slots of the map ------------------------------------


def test_the_load_check_of_ep_rank_1_compares_its_replicas_in_its_own_slots_of_the_map() -> None:
    the_map = _rank_one_map()
    slots = Slots(the_map, LOCAL, LOCAL)
    slots.zero(3, 8)  # expert 6's second replica on rank 1, never filled
    problems = rules.loaded_content_problems(the_map, slots.fingerprints())
    assert problems == {
        3: f"layer 3: expert 6 in slots that differ (slot 6 {expert_fingerprint(3, 6)[:12]}..., "
        "slot 8 zero-filled)"
    }


def test_the_load_check_of_ep_rank_1_does_not_pair_its_slots_as_the_maps_first_slots() -> None:
    # The map's first six slots hold expert 0 twice (slots 0 and 4) and expert 1 twice (1 and
    # 5); rank 1's slots 6-11 hold six different experts, each whole: nothing is wrong there.
    the_map = [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7] for _ in range(SMALL.num_layers)]
    slots = Slots(the_map, LOCAL, LOCAL)
    assert rules.loaded_content_problems(the_map, slots.fingerprints()) == {}
    rank_zero = Slots(the_map, 0, LOCAL)
    rank_zero.zero(2, 4)
    assert rules.loaded_content_problems(the_map, rank_zero.fingerprints()) == {
        2: f"layer 2: expert 0 in slots that differ (slot 0 {expert_fingerprint(2, 0)[:12]}..., "
        "slot 4 zero-filled)"
    }


def test_a_daemon_of_ep_rank_1_whose_loaded_replica_is_unfilled_starts_dirty(tmp_path) -> None:
    the_map = _rank_one_map()
    slots = Slots(the_map, LOCAL, LOCAL)
    slots.zero(5, 9)  # expert 7's second replica on rank 1
    ledger = open_ledger(tmp_path / "l.sqlite")
    try:
        record = ledger.start_incarnation(
            SMALL, the_map, config_fingerprint="t", content=slots.fingerprints()
        )
        problem = record.check_loaded_content()
        assert problem is not None and "layer 5: expert 7 in slots that differ (slot 7 " in problem
        assert "slot 9 zero-filled" in problem
        assert record.dirty is not None and record.dirty.layers == (5,)
        record.attach("A")
        with pytest.raises(errors.LayoutDirty, match="slot 9 zero-filled"):
            record.begin("A", 0, [1])
        _verified(record, ledger.path)
    finally:
        ledger.close()


# --- a zero-filled moved-in slot marks the daemon dirty -------------------------------------------


def test_a_commit_whose_moved_in_slot_of_a_new_expert_is_zero_filled_marks_the_daemon_dirty(
    tmp_path,
) -> None:
    # EP rank 0 of 2 (slots 0-5) has never held expert 7, so it knows no fingerprint for it: only
    # the zero-fill check can tell that the slot never received the expert's bytes.
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 0, LOCAL)
    ledger = open_ledger(tmp_path / "l.sqlite")
    try:
        record = ledger.start_incarnation(
            SMALL, initial, config_fingerprint="t", content=slots.fingerprints()
        )
        assert record.known.fingerprint_of(2, 7) is None
        record.attach("A")
        record.begin("A", 0, [2])
        row = list(initial[2])
        row[3] = 7
        slots.fill(2, row)
        slots.zero(2, 3)  # the move named expert 7 for slot 3, its bytes never came
        version, _ = record.commit("A", {2: row}, slots.fingerprints)
        assert version == 1
        assert record.dirty is not None and record.dirty.layers == (2,)
        assert "layer 2: slot 3 holds zero-filled, not expert 7" in record.dirty.reason
        _verified(record, ledger.path)
    finally:
        ledger.close()


def _moving_into_slot_3_of_layer_2(expert: int) -> tuple[LayoutRecord, Slots, list[int]]:
    """EP rank 0's record (slots 0-5), engine A moving ``expert`` into slot 3 of layer 2: the
    record, the slots (filled as the new row says) and that row."""
    slots = Slots(INITIAL, 0, LOCAL)
    record = LayoutRecord.in_memory(SMALL, INITIAL, content=slots.fingerprints())
    record.attach("A")
    record.begin("A", 0, [2])
    row = list(INITIAL[2])
    row[3] = expert
    slots.fill(2, row)
    return record, slots, row


@pytest.mark.parametrize(
    ("held", "text"),
    [
        ("half-written", "partial: parts 0-1 of expert 4, parts 2-3 of expert 3"),
        ("foreign bytes", "unknown content"),
    ],
)
def test_a_commit_whose_moved_in_slot_holds_less_than_the_whole_named_expert_marks_it_dirty(
    held: str, text: str
) -> None:
    # Expert 4 is one this daemon holds (its fingerprint is known): a slot the move filled only
    # in part (a transfer cut short), or with bytes of no expert, is not expert 4.
    record, slots, row = _moving_into_slot_3_of_layer_2(4)
    bytes_now = half_and_half(2, 4, 3) if held == "half-written" else expert_fingerprint(0, 99)
    slots.put(2, 3, bytes_now)
    assert record.commit("A", {2: row}, slots.fingerprints)[0] == 1
    assert record.dirty is not None and record.dirty.layers == (2,)
    assert f"layer 2: slot 3 holds {text}, not expert 4; restart" in record.dirty.reason


def test_committed_content_names_every_zero_filled_slot_whatever_the_daemon_knows() -> None:
    the_map = [[0, 1, 2, 7, 4, 5, 6, 7, 0, 1, 2, 3]]
    known_nothing = ExpertContents()
    local = LocalFingerprints(0, {0: (ZERO,) * LOCAL})
    problems = rules.committed_content_problems(the_map, local, known_nothing)
    assert problems == {
        0: "layer 0: "
        + "; ".join(
            f"slot {slot} holds zero-filled, not expert {the_map[0][slot]}" for slot in range(6)
        )
    }


def test_a_commit_whose_new_expert_arrived_whole_is_learned_not_marked(tmp_path) -> None:
    record, slots, row = _moving_into_slot_3_of_layer_2(7)
    record.commit("A", {2: row}, slots.fingerprints)
    assert record.dirty is None
    assert record.known.fingerprint_of(2, 7) == expert_fingerprint(2, 7)


# --- a fetch without the field once experts moved -------------------------------------------------


def _moved_record(attached: bool) -> LayoutRecord:
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    record = LayoutRecord.in_memory(SMALL, initial)
    record.attach("A")
    record.begin("A", 0, [1])
    row = list(initial[1])
    row[0], row[1] = row[1], row[0]
    record.commit("A", {1: row})
    if not attached:
        record.detach("A")
    return record


@pytest.mark.parametrize("attached", [True, False], ids=["an engine attached", "none attached"])
def test_a_fetch_without_the_field_after_a_move_is_refused_advising_upgrade_or_restart(
    attached: bool,
) -> None:
    record = _moved_record(attached)
    assert record.version == 1 and bool(record.attached) is attached
    with pytest.raises(errors.LayoutMismatch) as refused:
        rules.check_fetch(record, None, None)
    assert str(refused.value) == (
        "this daemon's experts have moved (layout version 1) and the engine did not send the "
        "expert_layout field, so it would route with the initial layout; " + UPGRADE_ADVICE
    )
    with pytest.raises(errors.LayoutMismatch, match="upgrade the engine"):
        record.fetch(None)
    assert not record.non_following_fetch  # refused: served nothing, disabled nothing


def test_a_fetch_without_the_field_before_any_move_is_served_as_non_following() -> None:
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    record = LayoutRecord.in_memory(SMALL, initial)
    verdict = record.fetch(None)
    assert (verdict.following, verdict.reason) == (False, rules.FETCH_WITHOUT_FIELD)
    assert record.non_following_fetch


# --- the content check covers every layer no pending move is changing ---------------------------


@contextlib.contextmanager
def _moving_layer_1(tmp_path: Path) -> Iterator[tuple[Ledger, LayoutRecord, Slots]]:
    """A ledger whose daemon records the content of every slot, engine A moving layer 1."""
    slots = Slots(INITIAL, 0, SMALL.num_physical_slots)
    ledger = open_ledger(tmp_path / "l.sqlite")
    try:
        record = ledger.start_incarnation(
            SMALL, INITIAL, config_fingerprint="t", content=slots.fingerprints()
        )
        record.attach("A")
        record.begin("A", 0, [1])
        yield ledger, record, slots
    finally:
        ledger.close()


def test_the_content_check_marks_a_layer_no_pending_move_changes_while_a_move_is_pending(
    tmp_path: Path,
) -> None:
    with _moving_layer_1(tmp_path) as (ledger, record, slots):
        slots.move(1, 0, 3)  # the pending move is under way in layer 1: not a finding
        slots.move(4, 7, 2)  # someone else moved expert 2 into slot 7 of layer 4
        view = record.content_check(slots.fingerprints)
        assert view.dirty and record.dirty is not None
        assert record.dirty.layers == (4,)
        assert view.dirty_reason is not None
        assert "layer 4 slot 7: expert 7 by the record, holds expert 2" in view.dirty_reason
        assert "layer 1" not in view.dirty_reason
        assert view.dirty_move is None
        _verified(record, ledger.path)


def test_the_commit_of_a_move_pending_when_the_content_check_marked_the_daemon_is_refused(
    tmp_path: Path,
) -> None:
    # The layout is unknown once the content check marks the daemon: the mover's commit must not
    # record a new version (an ok would tell the engine its move is known).
    with _moving_layer_1(tmp_path) as (ledger, record, slots):
        row = list(INITIAL[1])
        row[0], row[3] = row[3], row[0]
        slots.fill(1, row)
        slots.move(4, 7, 2)  # meanwhile someone else moved expert 2 into slot 7 of layer 4
        assert record.content_check(slots.fingerprints).dirty
        before = table_dump(ledger.path)
        with pytest.raises(errors.LayoutDirty, match="layer 4 slot 7"):
            record.commit("A", {1: row}, slots.fingerprints)
        assert refusals_added(ledger.path, before) == ["commit_refused"]
        assert (record.version, record.dirty is not None) == (0, True)
        _verified(record, ledger.path)


def test_the_content_check_marks_a_moved_layer_with_no_move_pending() -> None:
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 0, SMALL.num_physical_slots)
    record = LayoutRecord.in_memory(SMALL, initial, content=slots.fingerprints())
    record.attach("A")
    record.begin("A", 0, [1])
    record.abort("A")  # a move came and went: nothing is pending now
    slots.move(1, 0, 3)
    view = record.content_check(slots.fingerprints)
    assert view.dirty and record.dirty is not None and record.dirty.layers == (1,)
    assert "layer 1 slot 0: expert 0 by the record, holds expert 3" in (view.dirty_reason or "")
