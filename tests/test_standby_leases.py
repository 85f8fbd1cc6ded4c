"""Roles and leases (docs/protocol.md "Roles and leases"): a standby attached without a lease
does not count for the one-mover rule; a lease is busy while a move is pending and refused at a
dirty daemon; a lease holder makes begins busy; a standby keeps its lease while its own move is
pending; a standby's EOF never dirties; the role and the leases survive a replay and are checked
by ``verify``; status, fleet and metrics show them."""

from __future__ import annotations

import json
import random
import sqlite3

import pytest
from cli_ledgers import build, execute, run_cli
from ledger_support import move, open_ledger, refusals_added, start, table_dump

from layout_ledger.cli import exit_codes
from layout_ledger.core import errors
from layout_ledger.core import events as ev
from layout_ledger.core.rules import begin_cause
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store.replay import read_state
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.service import LayoutService


@pytest.fixture
def ledger(tmp_path):
    ledger = open_ledger(tmp_path / "l.sqlite")
    yield ledger
    ledger.close()


@pytest.fixture
def record(ledger):
    record = start(ledger)
    record.attach("A")
    record.attach("C", "standby")
    return record


def _kinds(path) -> list[str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return [row[0] for row in conn.execute("SELECT kind FROM events ORDER BY event_id")]


def test_a_standby_without_a_lease_does_not_count_for_the_one_mover_rule(record):
    rng = random.Random(1)
    assert move(record, "A", [0, 1], rng) == 1
    assert move(record, "A", [2], rng) == 2


def test_a_lease_holder_makes_begins_busy_until_it_releases(ledger, record):
    assert record.lease("C") is True
    before = table_dump(ledger.path)
    with pytest.raises(errors.MoveBusy, match=r"other engines are attached to this daemon") as exc:
        record.begin("A", 0, [0])
    assert "C (standby with a lease)" in str(exc.value)
    assert begin_cause(str(exc.value)) == "busy_other_engine"
    assert refusals_added(ledger.path, before) == ["begin_busy"]
    assert record.release("C") is True
    record.begin("A", 0, [0])


def test_a_lease_is_busy_while_a_move_is_pending(ledger, record):
    record.begin("A", 0, [3])
    before = table_dump(ledger.path)
    with pytest.raises(errors.MoveBusy, match=r"engine 'A' has a move of layers \[3\]"):
        record.lease("C")
    assert refusals_added(ledger.path, before) == ["lease_busy"]
    record.abort("A")
    assert record.lease("C") is True


def test_a_lease_is_refused_at_a_dirty_daemon(ledger, record):
    record.begin("A", 0, [3])
    record.detach("A")
    assert record.dirty is not None
    before = table_dump(ledger.path)
    with pytest.raises(errors.LayoutDirty):
        record.lease("C")
    assert refusals_added(ledger.path, before) == ["lease_refused"]


def test_a_lease_is_refused_to_an_engine_not_attached_as_a_standby(record):
    with pytest.raises(errors.NotStandby):
        record.lease("A")
    with pytest.raises(errors.EngineNotAttached):
        record.lease("B")


def test_a_standby_without_a_lease_may_not_begin(record):
    with pytest.raises(errors.MoveBusy) as exc:
        record.begin("C", 0, [0])
    assert begin_cause(str(exc.value)) == "busy_standby_without_lease"


def test_a_standby_holding_the_only_lease_moves_alone(record):
    record.lease("C")
    record.detach("A")
    assert move(record, "C", [1], random.Random(2)) == 1


def test_a_standbys_eof_never_dirties_the_daemon(ledger, record):
    record.begin("A", 0, [2])
    assert record.detach("C") is None  # while A's move is pending, too
    record.attach("C2", "standby")
    assert record.detach("C2") is None
    assert record.dirty is None
    record.abort("A")
    record.attach("C3", "standby")
    record.lease("C3")
    assert record.detach("C3") is None  # with its lease: the lease ends with the attachment
    assert record.dirty is None and record.state().leases == ()
    assert _kinds(ledger.path).count("dirty") == 0


def test_a_standby_keeps_its_lease_until_its_own_pending_move_commits_or_aborts(ledger, record):
    record.lease("C")
    record.detach("A")
    record.begin("C", 0, [1])  # the lease is what let this move begin
    before = table_dump(ledger.path)
    with pytest.raises(errors.MoveAlreadyPending, match="before releasing its lease"):
        record.release("C")
    assert refusals_added(ledger.path, before) == ["release_refused"]
    assert record.state().leases == ("C",)
    record.abort("C")
    assert record.release("C") is True and record.state().leases == ()


def test_release_of_a_lease_never_taken_is_ok_and_changes_nothing(ledger, record):
    before = table_dump(ledger.path)
    assert record.release("C") is False
    assert record.release("A") is False
    assert table_dump(ledger.path) == before


def test_an_invalid_role_is_refused_with_one_event(ledger):
    record = start(ledger)
    before = table_dump(ledger.path)
    with pytest.raises(errors.InvalidRequest, match="role must be one of active, standby"):
        record.attach("X", "leader")
    assert refusals_added(ledger.path, before) == ["attach_refused"]


def test_the_role_and_the_leases_survive_a_replay_of_the_events(ledger, record):
    rng = random.Random(3)
    record.lease("C")
    record.release("C")
    move(record, "A", [0], rng)
    record.lease("C")
    with LedgerReader(ledger.path) as reader, reader.connect() as conn:
        derived = read_state(conn, record.incarnation_id)
    assert derived.standbys == ("C",) and derived.leases == ("C",)
    assert derived.attached == ("A", "C")
    with sqlite3.connect(ledger.path) as conn:
        roles = conn.execute(
            "SELECT engine_id, role FROM ledger_attachments ORDER BY attached_at"
        ).fetchall()
    assert roles == [("A", "active"), ("C", "standby")]
    kinds = _kinds(ledger.path)
    assert [k for k in kinds if k in (ev.LEASE, ev.RELEASE)] == ["lease", "release", "lease"]


def test_a_daemon_restart_ends_the_incarnation_with_its_standby_events(tmp_path):
    path = build("standby", tmp_path / "l.sqlite")
    ledger = open_ledger(path)  # the next start replays the unended incarnation
    try:
        record = start(ledger)
        assert record.incarnation_id == 2 and record.state().standbys == ()
    finally:
        ledger.close()


def test_verify_names_a_lease_granted_to_an_active_engine(tmp_path, capsys):
    path = build("standby", tmp_path / "l.sqlite")
    execute(path, "UPDATE events SET reason = NULL WHERE kind = 'attach' AND event_id = 3")
    code, _out, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    # Read as active, engine-c would have made engine-a's first begin busy.
    assert "event #4 (begin by 'engine-a') was accepted while ['engine-c'] were attached" in err


def test_verify_names_a_begin_accepted_while_a_standby_held_its_lease(tmp_path, capsys):
    path = build("standby", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE kind = 'release'")
    code, _out, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert "(begin by 'engine-a') was accepted while ['engine-c'] were attached too" in err


def test_history_knows_the_new_kinds(tmp_path, capsys):
    path = build("standby", tmp_path / "l.sqlite")
    code, out, _ = run_cli(capsys, "history", str(path), "--kind", "lease", "--json")
    assert code == exit_codes.OK
    events = json.loads(out)["events"]
    assert [event["kind"] for event in events] == ["lease", "lease"]
    code, _, _ = run_cli(capsys, "history", str(path), "--kind", "release")
    assert code == exit_codes.OK


def test_status_shows_each_engines_role_and_lease(tmp_path, capsys):
    path = build("standby", tmp_path / "l.sqlite")
    _, out, _ = run_cli(capsys, "status", str(path))
    assert "roles:               engine-a active (lease), engine-c standby (lease)\n" in out
    _code, out, _ = run_cli(capsys, "status", str(path), "--json")
    (report,) = json.loads(out)["ledgers"]
    assert (report["standbys"], report["leases"]) == (["engine-c"], ["engine-c"])


def test_fleet_says_which_engine_may_move(ledger, record, capsys):
    def verdict() -> dict:
        _, out, _ = run_cli(capsys, "fleet", str(ledger.path), "--json")
        return json.loads(out)["verdict"]

    found = verdict()  # the daemon runs (this process holds its ledger's writer lock)
    assert found["mover"] == "A"
    assert "standbys without a lease (not counted): C" in found["moves"]
    record.lease("C")
    found = verdict()
    assert found["mover"] is None
    assert found["moves"].startswith("no engine may move: A, C (standby, serving) hold leases")
    record.release("C")
    record.detach("A")
    assert verdict()["moves"].startswith("no engine holds a lease")


def test_metrics_label_attached_engines_by_role_and_count_leases(tmp_path, capsys):
    pytest.importorskip("prometheus_client")
    path = build("standby", tmp_path / "l.sqlite")
    code, out, _ = run_cli(capsys, "metrics", str(path))
    assert code == exit_codes.OK
    lines = out.splitlines()

    def value(name: str, *labels: str) -> float:
        found = [
            line
            for line in lines
            if line.startswith(name + "{") and all(label in line for label in labels)
        ]
        assert len(found) == 1, (name, labels, found)
        return float(found[0].rsplit(" ", 1)[1])

    assert value("sglang_expert_layout_attached_engines", 'role="active"') == 1
    assert value("sglang_expert_layout_attached_engines", 'role="standby"') == 1
    assert value("sglang_expert_layout_standby_leases") == 1
    assert value("sglang_expert_layout_lease_holders") == 2


def test_the_service_answers_attach_with_the_role_and_lease_and_release_with_ok(record):
    service = LayoutService(record)
    reply = service.handle({"type": msg.ATTACH, "engine_id": "S", "role": "standby"})
    assert reply["status"] == "ok" and msg.reply_role(reply) == "standby"
    assert "S" in reply["layout"]["standbys"] and reply["layout"]["leases"] == []
    reply = service.handle({"type": msg.ATTACH, "engine_id": "B"})
    assert msg.reply_role(reply) == "active"
    granted = {"status": "ok", "version": 0, "digest": record.digest}
    assert service.handle(msg.LeaseRequest("S").to_wire()) == granted
    assert service.handle(msg.LeaseRequest("S").to_wire()) == granted  # held: no change
    assert service.handle(msg.LeaseRequest("B").to_wire())["status"] == "refused"
    assert service.handle(msg.ReleaseRequest("S").to_wire()) == {"status": "ok"}
    service.handle({"type": msg.ABORT, "engine_id": "A"})
    record.detach("B")
    assert service.handle(msg.BeginRequest("A", 0, [0]).to_wire()) == {"status": "ok"}
    assert service.handle(msg.LeaseRequest("S").to_wire())["status"] == "busy"
    assert LayoutService(None).handle(msg.LeaseRequest("S").to_wire())["status"] == "refused"
