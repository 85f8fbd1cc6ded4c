"""The record's state machine on a real ledger file: what each change writes, what it refuses."""

from __future__ import annotations

import contextlib
import json
import math
import random

import pytest
from ledger_support import (
    SMALL,
    move,
    open_ledger,
    random_row,
    refusals_added,
    start,
    table_dump,
)

from layout_ledger.core import errors
from layout_ledger.core.layout import Geometry, layout_digest, row_json, trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.history.reader import LedgerReader


@pytest.fixture
def ledger(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    yield ledger
    ledger.close()


@pytest.fixture
def record(ledger):
    record = start(ledger)
    record.attach("A")
    return record


def _on_disk(ledger):
    with LedgerReader(ledger.path) as reader:
        return reader.state()


def test_the_digest_is_sha256_of_compact_json_as_the_protocol_defines():
    import hashlib

    layout = [[0, 1, 2], [2, 1, 0]]
    expected = hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()
    assert layout_digest(layout) == expected
    record = LayoutRecord.in_memory(Geometry(2, 3, 3), layout)
    assert record.digest == expected
    assert row_json([10, 0, 255]) == "[10,0,255]"


def test_version_zero_is_the_initial_map_with_its_digest(ledger):
    record = start(ledger)
    state = _on_disk(ledger)
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    assert (state.version, state.physical_to_logical_map) == (0, initial)
    assert state.digest == layout_digest(initial) == record.digest


def test_commit_stores_only_the_moved_layers_bumps_the_version_and_digests_the_whole_map(
    ledger, record
):
    rng = random.Random(3)
    record.begin("A", 0, [5, 2])
    rows = {2: random_row(rng), 5: random_row(rng)}
    version, digest = record.commit("A", rows)
    expected = trivial_map(8, 12, 8)
    expected[2], expected[5] = rows[2], rows[5]
    assert (version, digest) == (1, layout_digest(expected))
    dump = table_dump(ledger.path)
    assert [(r[2], r[3]) for r in dump["layout_rows"] if r[3] == 1] == [(2, 1), (5, 1)]
    state = _on_disk(ledger)
    assert (state.version, state.digest, state.physical_to_logical_map) == (1, digest, expected)
    assert state.pending is None


def test_begin_marks_the_move_pending_on_disk_and_abort_clears_it_without_a_change(ledger, record):
    record.begin("A", 0, [3, 1])
    pending = _on_disk(ledger).pending
    assert (pending.engine_id, pending.layers, pending.base_version) == ("A", (1, 3), 0)
    record.abort("A")
    state = _on_disk(ledger)
    assert (state.pending, state.version) == (None, 0)


def test_detach_during_a_pending_move_records_dirty_with_engine_layers_and_base_version(
    ledger, record
):
    move(record, "A", [0], random.Random(1))
    record.begin("A", 1, [4, 6])
    mark = record.detach("A")
    state = _on_disk(ledger)
    assert state.dirty == mark
    assert (mark.move.engine_id, mark.move.layers, mark.move.base_version) == ("A", (4, 6), 1)
    assert state.pending is None and state.attached == ()
    assert "restart the daemon" in state.dirty.reason


def test_detach_without_a_pending_move_is_not_dirty(ledger, record):
    move(record, "A", [0], random.Random(1))
    assert record.detach("A") is None
    assert _on_disk(ledger).dirty is None


def test_state_rebuilt_from_rows_equals_the_live_record_after_every_transition(ledger):
    record = start(ledger)
    rng = random.Random(7)
    steps = [
        lambda: record.attach("A"),
        lambda: record.begin("A", record.version, [1, 2, 3]),
        lambda: record.commit("A", {1: random_row(rng), 2: random_row(rng), 3: random_row(rng)}),
        lambda: record.attach("B"),
        lambda: record.detach("A"),
        lambda: record.begin("B", record.version, [0]),
        lambda: record.abort("B"),
        lambda: record.fetch({"engine_id": None, "version": 1, "digest": record.digest}),
        lambda: record.begin("B", record.version, [7]),
        lambda: record.detach("B"),
    ]
    for step in steps:
        with contextlib.suppress(errors.RequestRefused):
            step()
        assert _on_disk(ledger) == record.state()


BAD_BEGINS = [
    ("not attached", "Z", 0, [1], errors.EngineNotAttached, "engine 'Z' is not attached"),
    (
        "stale base",
        "A",
        5,
        [1],
        errors.StaleBaseVersion,
        "base_version 5 is not the current version 0",
    ),
    ("base not int", "A", "0", [1], errors.InvalidRequest, "base_version must be an int, got str"),
    (
        "base NaN",
        "A",
        math.nan,
        [1],
        errors.InvalidRequest,
        "base_version must be an int, got float",
    ),
    ("empty layers", "A", 0, [], errors.InvalidRequest, "layers is empty"),
    ("duplicate", "A", 0, [1, 1], errors.InvalidRequest, "layer 1 appears twice in layers"),
    ("negative", "A", 0, [-1], errors.InvalidRequest, "layer -1 is outside [0, 8)"),
    ("out of range", "A", 0, [8], errors.InvalidRequest, "layer 8 is outside [0, 8)"),
    ("float layer", "A", 0, [1.0], errors.InvalidRequest, "layer 1.0 (float) is not an int"),
    ("bool layer", "A", 0, [True], errors.InvalidRequest, "layer True (bool) is not an int"),
    ("NaN layer", "A", 0, [math.nan], errors.InvalidRequest, "layer nan (float) is not an int"),
    (
        "huge list",
        "A",
        0,
        list(range(10**6)),
        errors.InvalidRequest,
        "layers lists 1000000 entries",
    ),
    ("layers not a list", "A", 0, "0,1", errors.InvalidRequest, "layers must be a list of ints"),
    ("engine not str", 7, 0, [1], errors.InvalidRequest, "engine_id must be a non-empty string"),
    ("engine empty", "", 0, [1], errors.InvalidRequest, "engine_id must be a non-empty string"),
]


@pytest.mark.parametrize(
    ("engine_id", "base", "layers", "error", "message"),
    [case[1:] for case in BAD_BEGINS],
    ids=[case[0] for case in BAD_BEGINS],
)
def test_a_bad_begin_raises_a_ledger_error_saying_what_is_wrong_and_leaves_the_file_unchanged(
    ledger, record, engine_id, base, layers, error, message
):
    before = table_dump(ledger.path)
    with pytest.raises(
        error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        record.begin(engine_id, base, layers)
    assert refusals_added(ledger.path, before) == ["begin_refused"]
    assert record.pending is None


def _good_row():
    return [*range(8), 0, 1, 2, 3]


BAD_COMMITS = [
    ("wrong length", {1: [0] * 11}, "row of layer 1 has 11 slots; this layout has 12"),
    (
        "expert too big",
        {1: [*_good_row()[:11], 8]},
        "row of layer 1 slot 11 holds expert 8, outside [0, 8)",
    ),
    ("negative expert", {1: [-1, *_good_row()[1:]]}, "row of layer 1 slot 0 holds expert -1"),
    ("NaN expert", {1: [math.nan, *_good_row()[1:]]}, "row of layer 1 slot 0 holds nan (float)"),
    ("str expert", {1: ["3", *_good_row()[1:]]}, "row of layer 1 slot 0 holds '3' (str)"),
    (
        "other layers",
        {2: _good_row()},
        "rows cover layers [2] but the pending move is of layers [1]",
    ),
    ("extra layer", {1: _good_row(), 2: _good_row()}, "rows cover layers [1, 2]"),
    ("str key", {"1": _good_row()}, "rows key '1' (str) is not an int layer"),
    ("not a dict", [_good_row()], "rows must be a dict"),
    ("row not list", {1: "0,1,2"}, "row of layer 1 must be a list of ints"),
]


@pytest.mark.parametrize(
    ("rows", "message"), [case[1:] for case in BAD_COMMITS], ids=[case[0] for case in BAD_COMMITS]
)
def test_a_bad_commit_is_refused_leaves_the_file_unchanged_and_the_move_pending(
    ledger, record, rows, message
):
    record.begin("A", 0, [1])
    before = table_dump(ledger.path)
    with pytest.raises(errors.InvalidRequest) as info:
        record.commit("A", rows)
    assert message in str(info.value)
    assert refusals_added(ledger.path, before) == ["commit_refused"]
    assert _on_disk(ledger).pending.layers == (1,)


def test_commit_or_abort_without_begin_and_by_another_engine_are_refused_unchanged(ledger, record):
    before = table_dump(ledger.path)
    with pytest.raises(
        errors.NoPendingMove, match="engine 'A' has no move pending; send expert_layout_begin"
    ):
        record.commit("A", {1: _good_row()})
    with pytest.raises(errors.NoPendingMove):
        record.abort("A")
    assert refusals_added(ledger.path, before) == ["commit_refused", "abort_refused"]
    record.begin("A", 0, [1])
    record.attach("B")
    before = table_dump(ledger.path)
    with pytest.raises(errors.NoPendingMove, match="engine 'A' has the pending move"):
        record.commit("B", {1: _good_row()})
    assert refusals_added(ledger.path, before) == ["commit_refused"]


def test_begin_order_refuses_before_it_reports_busy(ledger, record):
    record.attach("B")
    with pytest.raises(errors.MoveBusy, match=r"other engines are attached to this daemon \(B\)"):
        record.begin("A", 0, [1])
    with pytest.raises(errors.StaleBaseVersion):
        record.begin("A", 3, [1])
    with pytest.raises(errors.InvalidRequest):
        record.begin("A", 0, [99])


def test_a_second_pending_move_of_the_same_engine_is_refused(ledger, record):
    record.begin("A", 0, [1])
    with pytest.raises(
        errors.MoveAlreadyPending, match="already has a move of layers \\[1\\] pending"
    ):
        record.begin("A", 0, [2])


def test_attach_refuses_an_engine_id_already_attached(ledger, record):
    before = table_dump(ledger.path)
    with pytest.raises(errors.EngineAlreadyAttached, match="engine 'A' is already attached"):
        record.attach("A")
    assert refusals_added(ledger.path, before) == ["attach_refused"]


def test_a_dirty_record_refuses_begin_commit_and_fetch(ledger, record):
    record.begin("A", 0, [1])
    record.detach("A")
    record.attach("B")
    with pytest.raises(errors.LayoutDirty):
        record.begin("B", 0, [1])
    with pytest.raises(errors.LayoutDirty):
        record.fetch({"engine_id": "B", "version": 0, "digest": record.digest})


def test_a_start_map_with_the_wrong_shape_or_values_is_refused(ledger):
    with pytest.raises(errors.InvalidRequest, match="the map has 7 layers; expected 8"):
        ledger.start_incarnation(SMALL, trivial_map(7, 12, 8))
    bad = trivial_map(8, 12, 8)
    bad[3][4] = 9
    with pytest.raises(
        errors.InvalidRequest, match="layer 3 slot 4 holds expert 9, outside \\[0, 8\\)"
    ):
        ledger.start_incarnation(SMALL, bad)
    assert ledger.record is None


def test_reconstructing_the_current_map_costs_one_seek_per_layer_whatever_the_history(
    ledger, record
):
    """O(layers): one statement whose plan seeks the layer/version index once per layer and never
    scans layout_rows, so its cost does not grow with the number of versions."""
    from layout_ledger.store.rows import _ROWS_AT

    rng = random.Random(0)
    for _ in range(200):
        move(record, "A", [rng.randrange(8)], rng)
    with LedgerReader(ledger.path) as reader, reader.connect() as conn:
        sql = str(_ROWS_AT.compile(compile_kwargs={"literal_binds": False}))
        plan = conn.exec_driver_sql(
            "EXPLAIN QUERY PLAN " + sql.replace(":n", "8").replace(":i", "1").replace(":v", "150")
        ).all()
        details = [row[-1] for row in plan]
        assert any(
            "SEARCH layout_rows USING INDEX" in d and "layer=? AND version<?" in d for d in details
        ), details
        assert not any(d.startswith("SCAN layout_rows") for d in details), details
    statements = []
    from sqlalchemy import event

    with LedgerReader(ledger.path) as reader:
        event.listen(reader._engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        assert reader.state() == record.state()
    assert sum("FROM layout_rows" in s for s in statements) == 1
