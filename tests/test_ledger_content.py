"""Content-verified layouts in the ledger: fingerprints recorded with the layout, content dirty
marks (an unfilled replica at load, content that moved without a commit), and repairs.

Every history here must replay and verify, and the views, the replay and the live record must
say the same after each transition (as ``test_ledger_one_rulebook`` asks of the others).
"""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3

import pytest
from content_support import Slots, expert_fingerprint, half_and_half
from ledger_support import SMALL, open_ledger, random_row, table_dump
from test_ledger_one_rulebook import _views

from layout_ledger.core import errors
from layout_ledger.core.layout import trivial_map
from layout_ledger.core.state import LayoutState
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader

ALL = SMALL.num_physical_slots  # one daemon holding all 12 slots (slots 8-11 replicate 0-3)


def _start(ledger, slots: Slots | None = None, first_slot: int = 0, count: int = ALL):
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = slots or Slots(initial, first_slot, count)
    record = ledger.start_incarnation(
        SMALL,
        initial,
        config_fingerprint="test",
        daemon_label="test-daemon",
        content=slots.fingerprints(),
    )
    return record, slots


def _as_views_show(state: LayoutState) -> dict:
    dirty, pending = state.dirty, state.pending
    return {
        "version": state.version,
        "digest": state.digest,
        "map": state.physical_to_logical_map,
        "dirty": None if dirty is None else (dirty.engine_id, dirty.layers, dirty.base_version),
        "pending": None
        if pending is None
        else (pending.engine_id, pending.layers, pending.base_version),
        "attached": list(state.attached),
        "non_following_fetch": state.non_following_fetch,
    }


def _agree(ledger, record, name: str) -> None:
    with LedgerReader(ledger.path) as reader:
        replayed = reader.state()
        report = collect_verify(reader)
    live = record.state()
    assert replayed == live, name
    assert _views(ledger.path, record.incarnation_id) == _as_views_show(live), name
    assert report.ok, (name, report.first_inconsistency)


def _slot_rows(path, version: int | None = None) -> list[tuple]:
    query = "SELECT layer, slot, version, logical_expert, fingerprint FROM ledger_slot_fingerprints"
    if version is not None:
        query += f" WHERE version = {version}"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(query + " ORDER BY version, layer, slot").fetchall()


def _dirty_by_a_mover(record, slots: Slots, layers=(0, 1)):
    """Engine A begins a move of ``layers``, moves slot 0's and 1's experts of the first one
    (a whole expert each), and dies: the daemon is dirty. The row the weights now hold."""
    if "A" not in record.attached:
        record.attach("A")
    record.begin("A", record.version, list(layers))
    row = list(record.physical_to_logical_map()[layers[0]])
    row[0], row[1] = row[1], row[0]
    slots.fill(layers[0], row)
    record.detach("A")
    return row


def test_the_start_records_every_slots_fingerprint_and_the_view_names_slot_version_and_expert(
    tmp_path,
):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, _ = _start(ledger, first_slot=6, count=6)  # the second of two EP ranks
    rows = _slot_rows(ledger.path)
    assert len(rows) == SMALL.num_layers * 6
    assert rows[0] == (0, 6, 0, 6, expert_fingerprint(0, 6))
    assert rows[-1] == (7, 11, 0, 3, expert_fingerprint(7, 3))
    assert record.check_loaded_content() is None
    _agree(ledger, record, "start")


@pytest.mark.parametrize("enforce", [True, False])
def test_a_load_whose_replicas_differ_refuses_fetch_and_begin_naming_layer_and_slots(
    tmp_path, enforce
):
    ledger = open_ledger(tmp_path / "l.sqlite")
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 0, ALL)
    slots.zero(5, 10)  # the replica of expert 2 in slot 10 was never filled
    record, _ = _start(ledger, slots)
    reason = record.check_loaded_content(enforce=enforce)
    assert reason is not None
    assert "layer 5: expert 2 in slots that differ (slot 2 " in reason
    assert "slot 10 zero-filled" in reason
    if not enforce:
        assert record.dirty is None
        _agree(ledger, record, "warned")
        return
    assert record.dirty is not None and record.dirty.layers == (5,)
    record.attach("A")
    with pytest.raises(errors.LayoutDirty, match="slot 10 zero-filled"):
        record.fetch({"engine_id": "A", "version": 0, "digest": record.digest})
    with pytest.raises(errors.LayoutDirty, match="slot 10 zero-filled"):
        record.begin("A", 0, [1])
    with pytest.raises(errors.NotRepairable, match="restart the daemon"):
        record.repair("A", {5: initial[5]}, {}, slots.fingerprints)
    _agree(ledger, record, "content dirty at load")
    view = _views(ledger.path, record.incarnation_id)
    assert view["dirty"] == (None, (5,), 0)


def test_a_commit_records_the_moved_layers_fingerprints(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    record.begin("A", 0, [3])
    row = list(record.physical_to_logical_map()[3])
    row[0], row[5] = row[5], row[0]
    slots.fill(3, row)
    record.commit("A", {3: row}, slots.fingerprints)
    assert record.dirty is None
    rows = _slot_rows(ledger.path, version=1)
    assert [(layer, slot, expert) for layer, slot, _, expert, _ in rows[:1]] == [(3, 0, 5)]
    assert [fingerprint for *_, fingerprint in rows] == list(slots.held[3])
    _agree(ledger, record, "commit")


def test_a_commit_whose_slots_hold_other_experts_marks_the_daemon_dirty_after_it(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    record.begin("A", 0, [2])
    row = list(record.physical_to_logical_map()[2])
    row[0], row[5] = row[5], row[0]
    slots.fill(2, row)
    slots.zero(2, 9)  # the move left slot 9 (a replica of expert 1) empty
    version, _ = record.commit("A", {2: row}, slots.fingerprints)
    assert version == 1
    assert record.dirty is not None and record.dirty.layers == (2,)
    assert "layer 2: slot 9 holds zero-filled, not expert 1" in record.dirty.reason
    _agree(ledger, record, "commit, then content dirty")


def test_content_that_moved_without_a_commit_marks_a_clean_daemon_dirty(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    view = record.content_check(slots.fingerprints)
    assert not view.dirty and view.recorded == view.current
    slots.move(4, 7, 2)  # an engine without the plugin moved expert 2 into slot 7
    view = record.content_check(slots.fingerprints)
    assert view.dirty and record.dirty is not None
    assert "layer 4 slot 7: expert 7 by the record, holds expert 2" in view.dirty_reason
    assert view.dirty_move is None
    _agree(ledger, record, "content check")


def test_the_content_check_skips_the_layers_a_move_is_changing(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    record.begin("A", 0, [1])
    slots.move(1, 0, 3)  # the move is under way
    assert not record.content_check(slots.fingerprints).dirty
    assert record.detach("A") is not None  # A died mid-move
    view = record.content_check(slots.fingerprints)
    assert view.dirty_move is not None and view.dirty_move.layers == (1,)
    _agree(ledger, record, "dirty by a mover, checked")


def test_a_repair_records_the_held_layout_as_a_new_version_and_clears_the_dirty_mark(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    record.begin("A", 0, [0])
    moved = [3, 1, 2, 0, 4, 5, 6, 7, 0, 1, 2, 3]
    slots.fill(0, moved)
    record.commit("A", {0: moved}, slots.fingerprints)
    held = _dirty_by_a_mover(record, slots, layers=(2, 6))
    _agree(ledger, record, "dirty by a mover")
    record.attach("B")
    rows = {2: held, 6: list(record.physical_to_logical_map()[6])}
    fingerprints = {layer: list(slots.held[layer]) for layer in rows}
    version, digest = record.repair("B", rows, fingerprints, slots.fingerprints)
    assert (version, digest, record.dirty) == (2, record.digest, None)
    assert record.physical_to_logical_map()[2] == held
    _agree(ledger, record, "repaired")
    assert [row[2:4] for row in _slot_rows(ledger.path, version=2)][:1] == [(2, held[0])]
    record.begin("B", 2, [5])  # a repaired daemon moves again
    _agree(ledger, record, "begin after the repair")


def _refusal_cases(slots: Slots, held: list[int], row6: list[int]):
    good = {2: held, 6: row6}

    def prints(layers=(2, 6)) -> dict:
        return {layer: list(slots.held[layer]) for layer in layers}

    def other_slot_moved() -> tuple:
        slots.move(4, 5, 0)
        return ("B", good, prints(), "content outside the pending layers moved")

    def half_written() -> tuple:
        slots.put(2, 7, half_and_half(2, 6, 7))
        return ("B", good, prints(), "slot 7 holds partial: parts 0-1 of expert 6, parts 2-3")

    return {
        "not attached": lambda: ("C", good, prints(), "not attached"),
        "rows of other layers": lambda: ("B", {2: held}, prints(), "commit exactly the pending"),
        "fingerprints not the daemon's": lambda: (
            "B",
            good,
            {2: [expert_fingerprint(2, 0)] * ALL, 6: prints()[6]},
            "layer 2 slot 0: the repair says",
        ),
        "rows naming other experts": lambda: (
            "B",
            {2: [held[1], held[0], *held[2:]], 6: row6},
            prints(),
            "layer 2 slot 0 holds expert",
        ),
        "a zero-filled slot": lambda: (
            slots.zero(6, 3),
            ("B", good, prints(), "layer 6 slot 3 holds zero-filled"),
        )[1],
        "a half-written slot": half_written,
        "content elsewhere moved": other_slot_moved,
    }


@pytest.mark.parametrize(
    "case",
    [
        "not attached",
        "rows of other layers",
        "fingerprints not the daemon's",
        "rows naming other experts",
        "a zero-filled slot",
        "a half-written slot",
        "content elsewhere moved",
    ],
)
def test_a_repair_is_refused_and_changes_nothing_unless_the_daemon_sees_the_same_content(
    tmp_path, case
):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    held = _dirty_by_a_mover(record, slots, layers=(2, 6))
    record.attach("B")
    row6 = list(record.physical_to_logical_map()[6])
    engine, rows, fingerprints, message = _refusal_cases(slots, held, row6)[case]()
    before = table_dump(ledger.path)
    with pytest.raises(errors.RequestRefused, match=message):
        record.repair(engine, rows, fingerprints, slots.fingerprints)
    after = table_dump(ledger.path)
    assert after["versions"] == before["versions"]
    assert [row[3] for row in after["events"][len(before["events"]) :]] == ["repair_refused"]
    assert record.dirty is not None and record.version == 0
    _agree(ledger, record, case)


def test_a_repair_of_a_daemon_that_is_not_dirty_or_records_no_content_is_refused(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("B")
    with pytest.raises(errors.NothingToRepair):
        record.repair("B", {0: [0] * ALL}, {}, slots.fingerprints)
    plain = open_ledger(tmp_path / "plain.sqlite")
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    no_content = plain.start_incarnation(SMALL, initial)
    _dirty_by_a_mover(no_content, Slots(initial, 0, ALL), layers=(1,))
    no_content.attach("B")
    with pytest.raises(errors.NoContentRecord, match="records no slot fingerprints"):
        no_content.repair("B", {1: initial[1]}, {1: []}, None)
    with pytest.raises(errors.NoContentRecord):
        no_content.content_check(Slots(initial, 0, ALL).fingerprints)
    # identical refusals in a row are one row, counted
    with pytest.raises(errors.NoContentRecord):
        no_content.repair("B", {1: initial[1]}, {1: []}, None)
    with contextlib.closing(sqlite3.connect(plain.path)) as conn:
        counts = conn.execute(
            "SELECT count FROM events WHERE kind = 'repair_refused' ORDER BY event_id"
        ).fetchall()
    assert counts == [(2,)]


def test_prune_keeps_the_fingerprints_of_every_kept_version(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    rng = random.Random(1)
    for _ in range(6):
        layer = rng.randrange(SMALL.num_layers)
        row = random_row(rng)
        record.begin("A", record.version, [layer])
        slots.fill(layer, row)
        record.commit("A", {layer: row}, slots.fingerprints)
    record.content_check(slots.fingerprints)
    assert record.dirty is None
    ledger.prune(2)
    with contextlib.closing(sqlite3.connect(ledger.path)) as conn:
        orphans = conn.execute(
            "SELECT count(*) FROM ledger_slot_fingerprints WHERE logical_expert IS NULL"
        ).fetchone()[0]
        current = conn.execute(
            "SELECT f.layer, f.fingerprints FROM slot_fingerprints f WHERE f.version = ("
            " SELECT max(g.version) FROM slot_fingerprints g WHERE g.layer = f.layer)"
        ).fetchall()
    assert orphans == 0
    assert {layer: tuple(json.loads(text)) for layer, text in current} == slots.held_tuples()
    _agree(ledger, record, "pruned")


def test_the_0004_downgrade_drops_the_fingerprints_and_restores_0003s_views(tmp_path):
    from alembic import command
    from sqlalchemy import create_engine

    from layout_ledger.store.migrate import alembic_config

    def migrate(path, action, revision: str) -> None:
        engine = create_engine(f"sqlite:///{path}")
        with engine.begin() as conn:
            action(alembic_config(conn), revision)
        engine.dispose()

    def objects(path) -> dict[str, str]:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE name LIKE 'ledger_%'")
            return {name: sql for name, sql in rows}

    older, path = tmp_path / "0003.sqlite", tmp_path / "l.sqlite"
    migrate(older, command.upgrade, "0003_event_counts_and_chain")
    ledger = open_ledger(path)
    _start(ledger)
    ledger.close()
    assert "ledger_slot_fingerprints" in objects(path)
    migrate(path, command.downgrade, "0003_event_counts_and_chain")
    assert objects(path) == objects(older)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert "slot_fingerprints" not in tables


def test_show_fingerprints_prints_each_slots_recorded_fingerprint_at_the_version(tmp_path, capsys):
    from cli_ledgers import run_cli

    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger, first_slot=6, count=6)
    record.attach("A")
    record.begin("A", 0, [1])
    row = list(record.physical_to_logical_map()[1])
    row[6], row[7] = row[7], row[6]
    slots.fill(1, row)
    record.commit("A", {1: row}, slots.fingerprints)
    ledger.close()
    path = str(ledger.path)
    code, out, _ = run_cli(
        capsys, "show", path, "--layers", "1", "--ep-size", "2", "--fingerprints"
    )
    assert code == 0
    cells = " ".join(f"{6 + i}={slots.held[1][i][:12]}" for i in range(6))
    assert out.splitlines()[1:] == [
        "layer=1: ep0=[0,1,2,3,4,5] ep1=[7,6,0,1,2,3]",
        "slot fingerprints at version 1 (the daemon's own slots; the first 12 of 64 hex digits; "
        "- none recorded)",
        f"layer=1: {cells}",
    ]
    assert cells.startswith(f"6={expert_fingerprint(1, 7)[:12]} 7={expert_fingerprint(1, 6)[:12]}")
    code, out, _ = run_cli(
        capsys, "show", path, "--version", "0", "--layers", "1", "--json", "--fingerprints"
    )
    shown = json.loads(out)["layers"][0]["fingerprints"]
    assert shown[0] == {"slot": 6, "fingerprint": expert_fingerprint(1, 6)}
    code, out, _ = run_cli(capsys, "show", path, "--json")
    assert "fingerprints" not in json.loads(out)["layers"][0]


def _readme_content_queries() -> dict[str, str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    queries = {}
    for block in re.findall(r"```sql\n(.*?)```", text, flags=re.S):
        first, _, rest = block.partition("\n")
        match = re.fullmatch(r"-- content: (\S+)", first.strip())
        if match:
            queries[match.group(1)] = rest
    return queries


def test_the_readmes_content_queries_name_a_slots_bytes_and_replicas_that_differ(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 0, ALL)
    slots.zero(3, 9)  # the replica of expert 1 in slot 9 of layer 3, never filled
    record, _ = _start(ledger, slots)
    record.attach("A")
    record.begin("A", 0, [3])
    row = list(initial[3])
    row[5], row[6] = row[6], row[5]
    slots.fill(3, row)
    slots.zero(3, 9)
    record.commit("A", {3: row}, slots.fingerprints)
    ledger.close()
    queries = _readme_content_queries()
    assert set(queries) == {"slot-bytes-at-version", "replicas-differ"}
    with contextlib.closing(sqlite3.connect(f"file:{ledger.path}?mode=ro", uri=True)) as conn:
        at_version = conn.execute(queries["slot-bytes-at-version"]).fetchall()
        differ = conn.execute(queries["replicas-differ"]).fetchall()
    assert at_version == [(1, 6, expert_fingerprint(3, 6))]
    assert differ == [(1, 3, 0, 1, "1,9", 2), (1, 3, 1, 1, "1,9", 2)]


def _racing(record, slots: Slots, race):
    """A fingerprinter that reads the slots, then lets ``race`` run (a move begun, done and
    committed, or begun only) before the check takes the record's lock: the check's
    fingerprints are older than the record it compares them with."""
    calls = []

    def fingerprints_of(layers=None):
        found = slots.fingerprints(layers)
        if not calls:
            calls.append(layers)
            race()
        return found

    return fingerprints_of


def _move_and_commit(record, slots: Slots, engine: str = "A", layer: int = 0) -> None:
    if engine not in record.attached:
        record.attach(engine)
    record.begin(engine, record.version, [layer])
    row = list(record.physical_to_logical_map()[layer])
    row[0], row[1] = row[1], row[0]
    slots.fill(layer, row)
    record.commit(engine, {layer: row}, slots.fingerprints)


def test_a_content_check_racing_a_commit_never_marks_a_clean_daemon_dirty(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    view = record.content_check(_racing(record, slots, lambda: _move_and_commit(record, slots)))
    assert record.dirty is None and not view.dirty
    assert view.state.version == 1 and view.recorded == view.current  # read again at version 1
    _agree(ledger, record, "a check raced a commit")


def test_a_content_check_racing_a_begin_never_marks_dirty_from_the_moving_layers(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")

    def begin_and_move() -> None:
        record.begin("A", 0, [3])
        slots.move(3, 0, 5)  # under way when the check compares

    view = record.content_check(_racing(record, slots, begin_and_move))
    assert record.dirty is None and not view.dirty
    record.abort("A")
    slots.move(3, 0, 0)
    _agree(ledger, record, "a check raced a begin")


def test_a_content_check_that_keeps_losing_races_compares_under_the_lock(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)

    def always_racing(layers=None):
        found = slots.fingerprints(layers)
        if not record.lock._is_owned():  # type: ignore[attr-defined]
            _move_and_commit(record, slots)
        return found

    view = record.content_check(always_racing)
    assert record.dirty is None and not view.dirty and view.recorded == view.current
    slots.move(5, 2, 0)  # and a real change is still found
    assert record.content_check(slots.fingerprints).dirty


@pytest.mark.parametrize("copies", ["the only copy", "every copy"])
def test_a_load_whose_zero_filled_slot_is_an_experts_only_or_every_copy_is_refused(
    tmp_path, copies
):
    ledger = open_ledger(tmp_path / "l.sqlite")
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 0, ALL)
    if copies == "the only copy":
        slots.zero(1, 5)  # expert 5 has one slot: nothing to compare it with
        named = "layer 1: expert 5 in slot 5 is zero-filled"
    else:
        slots.zero(1, 2)
        slots.zero(1, 10)  # both copies of expert 2: they agree, and hold nothing
        named = "layer 1: expert 2 in slots 2, 10 is zero-filled"
    record, _ = _start(ledger, slots)
    reason = record.check_loaded_content()
    assert reason is not None and named in reason, reason
    assert record.dirty is not None and record.dirty.layers == (1,)
    record.attach("A")
    with pytest.raises(errors.LayoutDirty, match="zero-filled"):
        record.fetch({"engine_id": "A", "version": 0, "digest": record.digest})
    _agree(ledger, record, "an empty only copy at load")


# --- forged repairs: what the daemon checks itself -------------------------------------------


def _two_rank_dirty(tmp_path):
    """EP rank 0 of 2 (slots 0-5) left mid-move of layers (0, 2), then B attached to repair."""
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger, first_slot=0, count=6)
    record.attach("A")
    record.begin("A", 0, [0, 2])
    record.detach("A")
    record.attach("B")
    return ledger, record, slots


def _repair_prints(slots: Slots, layers=(0, 2)) -> dict:
    return {layer: list(slots.held[layer]) for layer in layers}


def _refused_changing_nothing(ledger, record, message, *request) -> None:
    before = table_dump(ledger.path)
    with pytest.raises(errors.RequestRefused, match=message):
        *positional, carried = request if len(request) == 5 else (*request, None)
        record.repair(*positional, expected_fingerprints=carried)
    assert table_dump(ledger.path)["versions"] == before["versions"]
    assert record.dirty is not None and record.version == 0


def test_a_repair_naming_an_expert_the_daemon_never_held_needs_its_carried_fingerprint(tmp_path):
    ledger, record, slots = _two_rank_dirty(tmp_path)
    initial = record.physical_to_logical_map()
    slots.move(0, 0, 6)  # expert 6 (held only by rank 1) moved into slot 0
    row0 = list(initial[0])
    row0[0], row0[6] = 6, 0
    rows = {0: row0, 2: list(initial[2])}
    _refused_changing_nothing(
        ledger,
        record,
        "no fingerprint of expert 6 .*expected_fingerprints",
        "B",
        rows,
        _repair_prints(slots),
        slots.fingerprints,
    )
    forged = {0: {6: expert_fingerprint(0, 7)}}  # another expert's content, named expert 6
    _refused_changing_nothing(
        ledger,
        record,
        "layer 0 slot 0 .*expert 6.*parts 0-3 differ",
        "B",
        rows,
        _repair_prints(slots),
        slots.fingerprints,
        forged,
    )
    carried = {0: {6: expert_fingerprint(0, 6)}}
    version, _ = record.repair(
        "B", rows, _repair_prints(slots), slots.fingerprints, expected_fingerprints=carried
    )
    assert version == 1 and record.dirty is None
    assert record.known.fingerprint_of(0, 6) == expert_fingerprint(0, 6)
    _agree(ledger, record, "repaired with a carried fingerprint")


def test_a_repair_of_a_partial_slot_is_refused_whatever_expert_it_names(tmp_path):
    ledger, record, slots = _two_rank_dirty(tmp_path)
    initial = record.physical_to_logical_map()
    slots.put(0, 0, half_and_half(0, 0, 2))  # parts 0-1 of expert 0, parts 2-3 of expert 2
    row0 = list(initial[0])
    row0[0], row0[6] = 6, 0
    carried = {0: {6: half_and_half(0, 0, 2)}}  # a carried "fingerprint" that is a part mix
    _refused_changing_nothing(
        ledger,
        record,
        "layer 0 slot 0 holds partial: parts 0-1 of expert 0, parts 2-3 of expert 2",
        "B",
        {0: row0, 2: list(initial[2])},
        _repair_prints(slots),
        slots.fingerprints,
        carried,
    )
    _agree(ledger, record, "a partial slot refused")


def test_a_repair_whose_row_leaves_an_expert_without_a_slot_is_refused(tmp_path):
    ledger, record, slots = _two_rank_dirty(tmp_path)
    initial = record.physical_to_logical_map()
    row0 = list(initial[0])
    row0[6] = 7  # rank 1's slot 6 (expert 6's only copy) named expert 7: no slot holds expert 6
    _refused_changing_nothing(
        ledger,
        record,
        "row of layer 0 leaves experts \\[6\\] without a slot",
        "B",
        {0: row0, 2: list(initial[2])},
        _repair_prints(slots),
        slots.fingerprints,
    )


@pytest.mark.parametrize(
    "shape",
    ["a float layer key", "a tuple row", "a tuple of fingerprints", "a float expert key"],
)
def test_a_repair_in_a_shape_the_protocol_does_not_name_is_refused(tmp_path, shape):
    ledger, record, slots = _two_rank_dirty(tmp_path)
    initial = record.physical_to_logical_map()
    rows: dict = {0: list(initial[0]), 2: list(initial[2])}
    prints: dict = _repair_prints(slots)
    carried: dict | None = None
    if shape == "a float layer key":
        rows = {0.0: rows[0], 2: rows[2]}
        message = "rows key 0.0 \\(float\\) is not an int layer"
    elif shape == "a tuple row":
        rows[2] = tuple(rows[2])
        message = "row of layer 2 must be a list of ints, got tuple"
    elif shape == "a tuple of fingerprints":
        prints[2] = tuple(prints[2])
        message = "fingerprints of layer 2 must be a list"
    else:
        carried = {0: {6.0: expert_fingerprint(0, 6)}}
        message = "key 6.0 is not a logical expert id"
    _refused_changing_nothing(
        ledger, record, message, "B", rows, prints, slots.fingerprints, carried
    )


# --- tied experts: identical bytes are the expected content -------------------------------------


def _tied_slots(first_slot: int = 0, count: int = ALL) -> Slots:
    """Layer 3's experts 4 and 5 share their bytes (a checkpoint that shares tensors)."""
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, first_slot, count)
    for index, expert in enumerate(initial[3][first_slot : first_slot + count]):
        if expert == 5:
            slots.put(3, first_slot + index, expert_fingerprint(3, 4))
    return slots


def test_tied_experts_load_clean_and_are_known_as_tied(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, _ = _start(ledger, _tied_slots())
    assert record.check_loaded_content() is None and record.dirty is None
    assert record.known.conflicts == []
    assert record.known.tied() == {3: [(4, 5)]}
    assert record.known.identify(3, expert_fingerprint(3, 4)).text == "experts 4/5 (tied)"


def test_a_commit_swapping_tied_experts_slots_keeps_the_daemon_clean(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger, _tied_slots())
    record.attach("A")
    record.begin("A", 0, [3])
    row = list(record.physical_to_logical_map()[3])
    row[4], row[5] = 5, 4  # the bytes are the same either way: nothing to move
    record.commit("A", {3: row}, slots.fingerprints)
    assert record.dirty is None, record.dirty
    assert not record.content_check(slots.fingerprints).dirty
    _agree(ledger, record, "tied experts swapped")


def test_status_shows_the_tied_experts_the_load_recorded(tmp_path, capsys):
    from cli_ledgers import run_cli

    ledger = open_ledger(tmp_path / "l.sqlite")
    _start(ledger, _tied_slots())
    ledger.close()
    _, out, _ = run_cli(capsys, "status", str(ledger.path))
    assert "tied experts:" in out and "layer 3: 4/5 (the same bytes" in out, out
    _, out, _ = run_cli(capsys, "status", str(ledger.path), "--json")
    assert json.loads(out)["ledgers"][0]["tied_experts"] == {"3": [[4, 5]]}
