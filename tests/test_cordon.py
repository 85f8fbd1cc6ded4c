"""The cordon (issue 23, item 6): no move begins after the operator's check, until uncordon.

The rule: a cordoned daemon answers every begin ``busy`` naming the cordon, after every
permanent refusal (a begin that would be refused is refused, never busy); recorded as events,
replayed and verified like every other transition; cleared by a daemon restart. The CLI's first
write (``layout-ledger cordon``/``uncordon``) over a real daemon's control socket; ``status``,
``fleet`` (and ``--ready-to-stop``) and ``metrics`` show it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_ledgers import execute, run_cli
from engine_ledgers import ENGINE, EngineLedgers
from ledger_support import SMALL, open_ledger, start

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.metrics import collect_metrics, exposition
from layout_ledger.core import errors
from layout_ledger.core import events as ev
from layout_ledger.core.layout import trivial_map
from layout_ledger.core.record import LayoutRecord
from layout_ledger.core.rules import begin_cause
from layout_ledger.history.checks import collect_verify
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire import protocol as msg
from layout_ledger.wire.service import LayoutService
from sglang_integration.testing.daemon_control import EngineStandIn, request, start_daemon

pytestmark = pytest.mark.timeout(180)

INITIAL = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)


def _record() -> LayoutRecord:
    record = LayoutRecord.in_memory(SMALL, INITIAL)
    record.attach("engine-a")
    return record


# --- the rule ---------------------------------------------------------------------------------


def test_a_cordoned_daemon_answers_a_lone_engines_begin_busy_naming_the_cordon():
    record = _record()
    service = LayoutService(record)
    reply = service.handle({"type": msg.CORDON, "reason": "drain for GPU 3"})
    assert reply["status"] == msg.OK
    assert reply["cordon"]["cordoned"] is True and reply["cordon"]["reason"] == "drain for GPU 3"
    begin = {"type": msg.BEGIN, "engine_id": "engine-a", "base_version": 0, "layers": [0]}
    busy = service.handle(begin)
    assert busy["status"] == msg.BUSY
    assert busy["reason"].startswith(
        f"this daemon is cordoned since {reply['cordon']['since']} (drain for GPU 3): no move "
        "may begin until `layout-ledger uncordon`"
    )
    assert begin_cause(busy["reason"]) == "cordoned"
    assert service.handle({"type": msg.UNCORDON}) == {
        "status": msg.OK,
        "cordon": {"cordoned": False, "since": None, "reason": None},
    }
    assert service.handle(begin) == {"status": msg.OK}


@pytest.mark.parametrize(
    ("setup", "request_fields", "refusal"),
    [
        ("dirty", {}, errors.LayoutDirty),
        ("none", {"engine_id": "engine-z"}, errors.EngineNotAttached),
        ("none", {"base_version": 7}, errors.StaleBaseVersion),
        ("none", {"layers": [99]}, errors.InvalidRequest),
        ("pending", {}, errors.MoveAlreadyPending),
        ("non_following", {}, errors.MovesDisabled),
    ],
)
def test_a_begin_that_would_be_refused_is_refused_not_busy_while_cordoned(
    setup, request_fields, refusal
):
    record = _record()
    if setup == "dirty":
        record.mark_content_dirty([0], "slot 1 holds expert 3, not expert 1")
    if setup == "pending":
        record.begin("engine-a", 0, [1])
    if setup == "non_following":
        assert not record.fetch(None).following  # an older engine fetched the weights
    record.cordon_moves("drain")
    fields = {"engine_id": "engine-a", "base_version": 0, "layers": [0], **request_fields}
    with pytest.raises(refusal):
        record.begin(fields["engine_id"], fields["base_version"], fields["layers"])


@pytest.mark.parametrize(
    "reason",
    ["", "   ", "two\nlines", "x" * 257, 7],
    ids=["empty", "blank", "two lines", "too long", "not text"],
)
def test_a_cordon_whose_reason_says_nothing_or_is_not_one_line_of_text_is_refused(reason):
    record = _record()
    with pytest.raises(errors.InvalidRequest, match="a cordon's reason must be"):
        record.cordon_moves(reason)
    assert record.cordon is None
    record.begin("engine-a", 0, [0])  # moves may still begin


def test_cordon_and_uncordon_are_recorded_once_and_a_bad_reason_is_refused_with_one_event(
    tmp_path,
):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    record = start(ledger)
    record.attach("engine-a")
    first = record.cordon_moves("drain")
    assert record.cordon_moves("another reason") == first  # already cordoned: unchanged
    with pytest.raises(errors.InvalidRequest):
        record.cordon_moves("two\nlines")
    with pytest.raises(errors.MoveBusy):
        record.begin("engine-a", 0, [0])
    assert record.uncordon() == first
    assert record.uncordon() is None  # not cordoned: nothing happens
    record.begin("engine-a", 0, [0])
    ledger.close()
    with LedgerReader(path) as reader, reader.connect() as conn:
        kinds = [
            row[0] for row in conn.exec_driver_sql("SELECT kind FROM events ORDER BY event_id")
        ]
    assert kinds[2:] == [
        ev.CORDON,
        "cordon_refused",
        ev.BEGIN_BUSY,
        ev.UNCORDON,
        ev.BEGIN,
        ev.END,
    ]
    with LedgerReader(path) as reader:
        report = collect_verify(reader)
    assert report.ok, report.first_inconsistency


def test_replay_derives_the_cordon_and_verify_names_a_begin_accepted_while_cordoned(
    tmp_path, capsys
):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    record = start(ledger)
    record.attach("engine-a")
    record.cordon_moves("drain")
    with LedgerReader(path) as reader:
        assert reader.state().cordon == record.cordon
    record.uncordon()
    record.begin("engine-a", 0, [0])
    ledger.close()
    with LedgerReader(path) as reader:
        assert reader.state().cordon is None
    # Drop the uncordon: the history now has a begin the rules would have answered busy.
    execute(path, "DELETE FROM events WHERE kind = 'uncordon'", foreign_keys=False)
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert "(begin by 'engine-a') was accepted while the daemon was cordoned" in out


def test_a_daemon_restart_clears_the_cordon(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    record = start(ledger)
    record.cordon_moves("drain")
    ledger.end_incarnation()
    start(ledger)
    ledger.close()
    with LedgerReader(path) as reader:
        assert reader.state().cordon is None
        assert reader.state(1).cordon is not None


def test_the_cordon_view_on_the_wire():
    view = msg.CordonView(True, "2026-01-01T00:00:00.000000+00:00", "drain")
    assert msg.CordonView.from_wire(view.to_wire()) == view
    assert msg.CordonView.from_wire(msg.CordonView.of(None).to_wire()).cordoned is False
    for bad in ({"cordoned": True, "since": None, "reason": "x"}, {"cordoned": "yes"}, []):
        with pytest.raises(msg.ProtocolViolation):
            msg.CordonView.from_wire(bad)


# --- the CLI, over a real daemon -----------------------------------------------------------


def test_cordon_over_a_real_daemons_socket_then_status_fleet_metrics_show_it(tmp_path, capsys):
    daemon = start_daemon(tmp_path)
    engine = EngineStandIn.start(daemon.socket_path, "engine-a")
    ledger = str(daemon.ledger_path)
    try:
        code, out, err = run_cli(capsys, "cordon", ledger, "--reason", "stop for GPU swap")
        assert (code, err) == (exit_codes.OK, "")
        assert out.startswith(f"{ledger} (socket {daemon.socket_path}): cordoned since ")
        assert "(stop for GPU swap; by " in out
        assert out.endswith(
            "every begin is answered busy until `layout-ledger uncordon`; a daemon restart "
            "clears it\n"
        )
        busy = engine.begin(0, [0])
        assert busy.outcome is msg.Outcome.BUSY and "this daemon is cordoned since" in busy.reason
        (status,) = json.loads(run_cli(capsys, "status", ledger, "--json")[1])["ledgers"]
        assert status["cordon"]["reason"].startswith("stop for GPU swap; by ")
        assert (status["state"], status["busy_begins"], status["refusals"]) == ("clean", 1, 0)
        _, out, _ = run_cli(capsys, "status", ledger)
        assert "\ncordon:              since " in out
        fleet = json.loads(run_cli(capsys, "fleet", ledger, "--json")[1])
        assert fleet["ledgers"][0]["state"] == "cordoned"
        assert fleet["verdict"]["outcome"] == "adopt"  # a cordon does not stop an engine's start
        text = exposition(collect_metrics([ledger])).decode()
        assert "sglang_expert_layout_cordoned{" in text and text.count("cordoned{") == 1
        line = next(x for x in text.splitlines() if x.startswith("sglang_expert_layout_cordoned{"))
        assert line.endswith(" 1.0")
        # By its socket, and twice: uncordon of an uncordoned daemon is fine.
        for _ in range(2):
            code, out, _ = run_cli(capsys, "uncordon", daemon.socket_path, "--json")
            assert code == exit_codes.OK
            (answer,) = json.loads(out)["daemons"]
            assert (answer["result"], answer["cordoned"]) == ("uncordoned", False)
        assert engine.begin(0, [0]).ok
        assert engine.abort().ok
    finally:
        engine.kill()
        daemon.kill()
    # The daemon is gone: nothing to cordon (exit 6); its restart would start uncordoned.
    code, out, _ = run_cli(capsys, "cordon", ledger)
    assert code == exit_codes.NOT_RUNNING
    assert "not running (not running, no clean end recorded); a daemon started now starts " in out


def test_cordon_of_a_daemon_without_a_record_is_nothing_to_do_and_a_dead_socket_is_exit_6(
    tmp_path, capsys
):
    daemon = start_daemon(tmp_path, record="none")
    try:
        code, out, _ = run_cli(capsys, "cordon", daemon.socket_path)
        assert code == exit_codes.OK
        assert "keeps no expert layout record, so no move begins there" in out
    finally:
        daemon.kill()
    code, out, _ = run_cli(capsys, "cordon", daemon.socket_path, "--json")
    assert code == exit_codes.NOT_RUNNING
    assert json.loads(out)["daemons"][0]["result"] == "not_running"


def test_cordon_fails_with_exit_1_on_a_daemon_that_does_not_know_cordons(tmp_path, capsys):
    # sglang's own daemon (no plugin) keeps a weight cache but knows no cordon: a stop script
    # must not go on as if no move could begin there (an older plugin answers the same way).
    daemon = start_daemon(tmp_path, record="no-plugin")
    try:
        for verb in ("cordon", "uncordon"):
            code, out, err = run_cli(capsys, verb, daemon.socket_path)
            assert (code, err) == (exit_codes.FAILED, "")
            assert out == (
                f"{daemon.socket_path}: this daemon does not know {verb} (sglang's own daemon, "
                f"or this plugin from before cordons): Unknown request type: "
                f"expert_layout_{verb}\n"
            )
        code, out, _ = run_cli(capsys, "cordon", daemon.socket_path, "--json")
        assert code == exit_codes.FAILED
        assert json.loads(out)["daemons"][0]["result"] == "older_daemon"
    finally:
        daemon.kill()


def test_a_cordon_request_with_a_bad_reason_is_refused_by_the_daemon(tmp_path):
    daemon = start_daemon(tmp_path)
    try:
        reply = request(daemon.socket_path, {"type": msg.CORDON, "reason": "a\x1b[2Jb"})
        assert reply["status"] == msg.REFUSED and "printable" in reply["reason"]
        assert request(daemon.socket_path, {"type": msg.QUERY})["status"] == msg.OK
    finally:
        daemon.kill()


# --- fleet --ready-to-stop ----------------------------------------------------------------


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "ledgers").mkdir()
    ledgers = EngineLedgers(tmp_path / "ledgers", 4)
    ledgers.commit_all(1)
    try:
        yield ledgers
    finally:
        ledgers.close()


def _ready(capsys, engine: EngineLedgers, engine_id: str = ENGINE) -> tuple[int, dict, str]:
    paths = list(map(str, engine.paths))
    code, out, _ = run_cli(capsys, "fleet", *paths, "--ready-to-stop", engine_id, "--json")
    text = run_cli(capsys, "fleet", *paths, "--ready-to-stop", engine_id)[1]
    return code, json.loads(out), text


def test_ready_to_stop_needs_every_rank_attached_cordoned_and_no_move_pending(engine, capsys):
    code, report, text = _ready(capsys, engine)
    assert (code, report["ready"]) == (exit_codes.NOT_READY, False)
    assert report["ranks"][0]["problems"] == [
        f"not cordoned (run `layout-ledger cordon {engine.paths[0]}`)"
    ]
    assert text.splitlines()[-1] == "not ready to stop engine 'engine-a': ranks 0-3 of 4 not ready"
    engine.begin(2)  # begun before the cordon: a cordon stops begins, not moves under way
    for record in engine.records:
        record.cordon_moves("drain")
    code, report, _ = _ready(capsys, engine)
    assert code == exit_codes.PENDING_OR_REFUSALS
    assert [rank["ready"] for rank in report["ranks"]] == [True, True, False, True]
    engine.records[2].abort(ENGINE)
    code, report, text = _ready(capsys, engine, "engine-")  # a unique prefix names it
    assert (code, report["ready"], report["engine_id"]) == (exit_codes.OK, True, ENGINE)
    assert text.splitlines()[-1] == (
        "ready to stop engine 'engine-a': on all 4 ranks it is attached, no move is pending and "
        "the daemon is cordoned"
    )
    code, report, _ = _ready(capsys, engine, "engine-b")
    assert code == exit_codes.NOT_READY
    assert report["ranks"][1]["problems"] == [
        "engine 'engine-b' is not attached (attached: 'engine-a')"
    ]


def test_ready_to_stop_refuses_a_prefix_that_names_several_attached_engines(engine, capsys):
    # A stop script for engine-b that typed a prefix must not be told engine-a is ready.
    engine.records[1].attach("engine-b")
    for record in engine.records:
        record.cordon_moves("drain")
    paths = list(map(str, engine.paths))
    code, out, err = run_cli(capsys, "fleet", *paths, "--ready-to-stop", "engine-")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        "layout-ledger fleet: error: --ready-to-stop 'engine-' matches 2 attached engines: "
        "'engine-a', 'engine-b'; give more of the id\n"
    )
    code, report, _ = _ready(capsys, engine, "engine-b")
    assert (code, report["engine_id"]) == (exit_codes.NOT_READY, "engine-b")


def test_fleet_wide_adds_attached_pending_since_last_commit_and_cordon(engine, capsys):
    engine.begin(3)
    engine.records[1].cordon_moves("drain")
    for argv in (["-o", "wide"], ["--wide"]):
        code, out, _ = run_cli(capsys, "fleet", *map(str, engine.paths), *argv)
        assert code == exit_codes.PENDING_OR_REFUSALS
        header, *rows = out.splitlines()
        assert header.split()[-6:] == [
            "state",
            "attached",
            "pending_since",
            "last_commit",
            "cordon",
            "ledger",
        ]
        cells = [row.split() for row in rows[:4]]
        assert [row[-6] for row in cells] == ["clean", "cordoned", "clean", "pending"]
        assert cells[0][-5] == "engine-a" and cells[0][-4] == "-" and cells[3][-4] != "-"
        assert cells[1][-2] != "-" and cells[0][-2] == "-"
