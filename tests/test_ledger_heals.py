"""Heals and reloads in the ledger: the rules of ``LayoutRecord.heal`` and ``.reload`` on a real
SQLite file, replayed by the reader and checked by ``verify``.

The slots are ``content_support.Slots`` (fingerprints per slot, as the other ledger tests use)
and the reload is ``CheckpointSlots``: what a reload from the checkpoint leaves (each slot the
checkpoint expert its map names). The model-backed daemons reload through sglang's own loader
(tests/test_model_heal.py); here every rule of the record is checked on its own.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping, Sequence

import pytest
from alembic import command
from content_support import Slots, expert_fingerprint
from ledger_support import SMALL, open_ledger
from sqlalchemy import create_engine
from test_ledger_content import _agree, _dirty_by_a_mover, _start

from layout_ledger.core import errors
from layout_ledger.core.layout import layout_digest
from layout_ledger.core.reloads import ReloadFailed, ReloadReport
from layout_ledger.store.migrate import alembic_config


class CheckpointSlots:
    """A reload from the checkpoint: each slot asked for gets the expert the map names (or,
    ``wrong``, another one: a checkpoint whose weights changed)."""

    def __init__(self, slots: Slots, wrong: bool = False, fail: BaseException | None = None):
        self.slots, self.wrong, self.fail = slots, wrong, fail
        self.calls: list[dict[int, list[int]]] = []

    def __call__(
        self, physical_to_logical_map: Sequence[Sequence[int]], slots: Mapping[int, Sequence[int]]
    ) -> ReloadReport:
        self.calls.append({layer: list(chosen) for layer, chosen in slots.items()})
        if self.fail is not None:
            raise self.fail
        for layer, chosen in slots.items():
            for slot in chosen:
                expert = int(physical_to_logical_map[layer][slot])
                if self.wrong:
                    expert = (expert + 1) % SMALL.num_logical_experts
                self.slots.move(layer, slot, expert)
        layers = tuple(sorted(slots))
        return ReloadReport(
            layers, sum(map(len, slots.values())), 100, 0.01, self.slots.fingerprints(layers)
        )


def _new_map(record) -> list[list[int]]:
    the_map = [list(row) for row in record.physical_to_logical_map()]
    the_map[2][0], the_map[2][1] = the_map[2][1], the_map[2][0]
    the_map[5][3] = 7
    return the_map


def _kinds(ledger, record) -> list[str]:
    with ledger.transaction("reading") as conn:
        rows = conn.exec_driver_sql(
            "SELECT kind FROM events WHERE incarnation_id = ? ORDER BY event_id",
            (record.incarnation_id,),
        ).fetchall()
    return [str(kind) for (kind,) in rows]


def test_a_reload_jumps_from_base_version_to_version_and_replays_and_verifies(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    reloader = CheckpointSlots(slots)
    record.attach("E")
    new_map = _new_map(record)
    version, digest, report = record.reload(
        "E",
        base_version=0,
        version=7,
        digest=layout_digest(new_map),
        physical_to_logical_map=new_map,
        reloader=reloader,
    )
    assert (version, digest) == (7, layout_digest(new_map))
    assert reloader.calls == [{2: [0, 1], 5: [3]}]  # only the slots whose expert differs
    assert report is not None and report.slots == 3
    assert record.physical_to_logical_map() == new_map
    assert record.dirty is None and record.pending is None
    assert _kinds(ledger, record)[-3:] == ["attach", "begin", "reload"]
    _agree(ledger, record, "after the reload")
    record.attach("F")  # the next move goes on from the jumped version
    record.detach("E")
    record.begin("F", 7, [1])
    record.commit("F", {1: new_map[1]}, slots.fingerprints)
    assert record.version == 8
    _agree(ledger, record, "after a commit on the jumped version")
    ledger.close()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"digest": "0" * 64}, "digest is not the layout digest of physical_to_logical_map"),
        ({"version": 0}, "version must be an int above base_version 0, got 0"),
        ({"base_version": 3}, "base_version 3 is not the current version 0"),
        ({"engine_id": "G"}, "engine 'G' is not attached"),
        ({"physical_to_logical_map": [[0]]}, "the map has 1 layers; expected 8"),
    ],
)
def test_a_refused_reload_changes_nothing_and_appends_only_reload_refused(tmp_path, change, reason):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    reloader = CheckpointSlots(slots)
    record.attach("E")
    new_map = _new_map(record)
    fields = {
        "engine_id": "E",
        "base_version": 0,
        "version": 1,
        "digest": layout_digest(new_map),
        "physical_to_logical_map": new_map,
    }
    fields.update(change)
    before, kinds = record.state(), _kinds(ledger, record)
    with pytest.raises(errors.RequestRefused, match=reason):
        record.reload(fields.pop("engine_id"), **fields, reloader=reloader)
    assert record.state() == before
    assert _kinds(ledger, record) == [*kinds, "reload_refused"]
    assert reloader.calls == []
    _agree(ledger, record, "after a refused reload")


def test_a_reload_beside_another_engine_is_refused_by_the_one_mover_rule(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("E")
    record.attach("other")
    new_map = _new_map(record)
    with pytest.raises(errors.ReloadRefused, match=r"other engines are attached.*\(other\)"):
        record.reload(
            "E",
            base_version=0,
            version=1,
            digest=layout_digest(new_map),
            physical_to_logical_map=new_map,
            reloader=CheckpointSlots(slots),
        )
    assert record.version == 0


def test_a_reload_killed_midway_is_never_clean_at_the_next_start(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("E")
    new_map = _new_map(record)
    with pytest.raises(KeyboardInterrupt):  # the process dies inside the reload
        record.reload(
            "E",
            base_version=0,
            version=3,
            digest=layout_digest(new_map),
            physical_to_logical_map=new_map,
            reloader=CheckpointSlots(slots, fail=KeyboardInterrupt()),
        )
    ledger.close()
    ledger = open_ledger(tmp_path / "l.sqlite")
    _start(ledger)
    with ledger.transaction("reading") as conn:
        (end_state, reason) = conn.exec_driver_sql(
            "SELECT i.end_state, e.reason FROM incarnations i JOIN events e "
            "ON e.incarnation_id = i.incarnation_id AND e.kind = 'end' WHERE i.incarnation_id = 1"
        ).one()
    assert end_state != "clean"
    assert "engine 'E'" in reason and "pending" in reason  # the reload's intent (its begin)
    ledger.close()


def test_a_reload_that_fails_after_it_began_leaves_the_daemon_dirty_for_its_layers(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("E")
    new_map = _new_map(record)
    with pytest.raises(ReloadFailed, match="the reload failed: file gone"):
        record.reload(
            "E",
            base_version=0,
            version=3,
            digest=layout_digest(new_map),
            physical_to_logical_map=new_map,
            reloader=CheckpointSlots(slots, fail=ReloadFailed("file gone")),
        )
    assert record.version == 0 and record.pending is None
    assert record.dirty is not None and record.dirty.layers == (2, 5)
    assert _kinds(ledger, record)[-3:] == ["begin", "abort", "content_dirty"]
    _agree(ledger, record, "after a failed reload")


def test_a_heal_is_clean_only_when_every_reloaded_slot_holds_what_the_record_names(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    _dirty_by_a_mover(record, slots)
    slots.zero(1, 4)
    version, digest = record.version, record.digest
    with pytest.raises(errors.HealFailed, match="slots still differ from the record"):
        record.heal(CheckpointSlots(slots, wrong=True))
    assert record.dirty is not None
    _agree(ledger, record, "after a failed heal")
    reloader = CheckpointSlots(slots)
    report = record.heal(reloader)
    assert reloader.calls[-1] == {layer: list(range(12)) for layer in (0, 1)}
    assert report.slots == 24
    assert record.dirty is None
    assert (record.version, record.digest) == (version, digest)
    assert slots.fingerprints().layers[1][4] == expert_fingerprint(1, 4)
    assert _kinds(ledger, record)[-3:] == ["dirty", "heal_failed", "heal"]
    _agree(ledger, record, "after the heal")


def test_a_heal_of_a_clean_daemon_is_refused_and_changes_nothing(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    before = record.state()
    with pytest.raises(errors.HealRefused, match="it is not dirty"):
        record.heal(CheckpointSlots(slots))
    assert record.state() == before
    assert _kinds(ledger, record)[-1] == "heal_refused"
    _agree(ledger, record, "after a refused heal")


def test_a_heal_killed_midway_leaves_the_daemon_dirty_at_the_next_start(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    _dirty_by_a_mover(record, slots)
    with pytest.raises(KeyboardInterrupt):
        record.heal(CheckpointSlots(slots, fail=KeyboardInterrupt()))
    ledger.close()
    ledger = open_ledger(tmp_path / "l.sqlite")
    _start(ledger)
    with ledger.transaction("reading") as conn:
        (end_state,) = conn.exec_driver_sql(
            "SELECT end_state FROM incarnations WHERE incarnation_id = 1"
        ).one()
    assert end_state == "dirty"
    ledger.close()


def test_the_downgrade_to_0008_refuses_a_ledger_holding_heal_or_reload_events(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    record, slots = _start(ledger)
    _dirty_by_a_mover(record, slots)
    record.heal(CheckpointSlots(slots))
    ledger.close()
    engine = create_engine(f"sqlite:///{path}")
    with (
        pytest.raises(errors.SchemaDowngradeRefused, match="1 heal or reload events"),
        engine.begin() as conn,
    ):
        command.downgrade(alembic_config(conn), "0008_restored_layouts")
    engine.dispose()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            ("0010_checkpoint_changes",)
        ]


class BlockedSlots(CheckpointSlots):
    """A reload from a checkpoint whose file blocks until ``release`` is set (a stalled mount)."""

    def __init__(self, slots: Slots) -> None:
        super().__init__(slots)
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, physical_to_logical_map, slots):
        self.entered.set()
        assert self.release.wait(30)
        return super().__call__(physical_to_logical_map, slots)


def _within(seconds: float, call):
    """``call()`` on a thread; its result, or a failure when it does not return in time (a held
    lock)."""
    box: list = []

    def run():
        try:
            box.append(("ok", call()))
        except Exception as exc:
            box.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"{call} did not return within {seconds} s: a lock is held"
    return box[0]


def test_a_heal_holds_no_lock_while_it_reads_and_refuses_what_could_race_it(tmp_path):
    """Issue 40, 1: while a heal's read blocks, the record answers (state, fetch refused) and
    refuses a second heal and a repair; the heal records its end when the read returns."""
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    _dirty_by_a_mover(record, slots)
    record.attach("R")
    blocked = BlockedSlots(slots)
    healer = threading.Thread(target=record.heal, args=(blocked,), daemon=True)
    healer.start()
    assert blocked.entered.wait(10)
    kind, state = _within(2, record.state)
    assert kind == "ok" and state.dirty is not None
    assert state.reloading is not None and state.reloading.describe() == (
        "a heal of layers [0, 1] from the checkpoint is running"
    )
    kind, refused = _within(2, lambda: record.fetch({"engine_id": None, "version": 0}))
    assert kind == "raised" and isinstance(refused, errors.LayoutDirty)
    kind, refused = _within(2, lambda: record.heal(CheckpointSlots(slots)))
    assert kind == "raised" and str(refused) == (
        "a heal of layers [0, 1] from the checkpoint is running now; wait for its end (a heal "
        "or heal_failed event, or the reload's reply)"
    )
    kind, refused = _within(2, lambda: record.repair("R", {}, {}, slots.fingerprints))
    assert kind == "raised" and isinstance(refused, errors.NotRepairable)
    assert "its slots are being rewritten" in str(refused)
    blocked.release.set()
    healer.join(10)
    assert record.dirty is None and record.reloading is None
    assert _kinds(ledger, record)[-4:] == [
        "fetch_refused",
        "heal_refused",
        "repair_refused",
        "heal",
    ]
    _agree(ledger, record, "after a heal that blocked")


def test_a_heal_is_refused_while_a_move_is_pending(tmp_path):
    """A daemon marked dirty by its content while another move is pending: the heal is refused,
    the mark stays, and that move can never commit (it would commit over unknown slots)."""
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("A")
    record.begin("A", 0, [2])
    slots.zero(0, 3)  # content that moved outside the pending layer, without a commit
    record.content_check(slots.fingerprints)
    assert record.dirty is not None and record.pending is not None
    with pytest.raises(errors.HealRefused, match="engine 'A' has a move pending; abort it"):
        record.heal(CheckpointSlots(slots))
    assert record.dirty is not None
    with pytest.raises(errors.LayoutDirty):
        record.commit("A", {2: record.physical_to_logical_map()[2]}, slots.fingerprints)
    assert record.version == 0
    assert _kinds(ledger, record)[-3:] == ["content_dirty", "heal_refused", "commit_refused"]
    _agree(ledger, record, "after a heal refused under a pending move")


def test_a_reloading_engine_can_neither_commit_nor_abort_its_move_before_the_reload_ends(
    tmp_path,
):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record, slots = _start(ledger)
    record.attach("E")
    new_map = _new_map(record)
    blocked = BlockedSlots(slots)
    reloading = threading.Thread(
        target=record.reload,
        args=("E",),
        kwargs={
            "base_version": 0,
            "version": 4,
            "digest": layout_digest(new_map),
            "physical_to_logical_map": new_map,
            "reloader": blocked,
        },
        daemon=True,
    )
    reloading.start()
    assert blocked.entered.wait(10)
    kind, state = _within(2, record.state)
    assert kind == "ok" and state.pending is not None and state.pending.engine_id == "E"
    for verb, call in (
        ("commit", lambda: record.commit("E", {2: new_map[2], 5: new_map[5]}, slots.fingerprints)),
        ("abort", lambda: record.abort("E")),
    ):
        kind, refused = _within(2, call)
        assert kind == "raised" and str(refused) == (
            "a reload for engine 'E' of layers [2, 5] from the checkpoint is running; its move "
            f"ends with the reload's reply, not with expert_layout_{verb}"
        )
    blocked.release.set()
    reloading.join(10)
    assert (record.version, record.pending, record.dirty) == (4, None, None)
    assert _kinds(ledger, record)[-4:] == ["begin", "commit_refused", "abort_refused", "reload"]
    _agree(ledger, record, "after a reload that blocked")


def _content_marked(service, slots: Slots) -> None:
    """A slot of layer 0 changes without a commit; a content check marks the daemon dirty."""
    slots.zero(0, 3)
    reply = service.handle({"type": "expert_layout_content_check"})
    assert reply["status"] == "ok" and reply["content"]["dirty"], reply


def test_auto_heal_of_a_content_mark_waits_after_a_non_following_fetch(tmp_path):
    """An engine that does not follow the layout fetched the weights, and the daemon cannot tell
    when it exits: it may be routing with the slots, so a content mark is not healed by itself
    (the same daemon without that fetch heals at once)."""
    from layout_ledger.wire.healing import HEAL_AUTO, Healing
    from layout_ledger.wire.service import LayoutService

    outcomes = []
    for fetched in (False, True):
        ledger = open_ledger(tmp_path / f"l{int(fetched)}.sqlite")
        record, slots = _start(ledger)
        healing = Healing(HEAL_AUTO, CheckpointSlots(slots))
        service = LayoutService(record, slots, healing)
        if fetched:
            assert service.check_fetch({"type": "fetch_state"}) is None  # served, non-following
            assert record.non_following_fetch
        _content_marked(service, slots)
        healing.wait(10)
        outcomes.append((record.dirty is not None, _kinds(ledger, record)[-1]))
        ledger.close()
    assert outcomes == [(False, "heal"), (True, "content_dirty")]
