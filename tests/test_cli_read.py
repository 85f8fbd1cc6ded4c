"""The read commands' exact output, exit codes and --json, against ledgers built by the ledger.

Every ledger here was written through ``Ledger``/``LayoutRecord`` with a fixed clock
(tests/cli_ledgers.py), by a process that then died like a killed daemon.
"""

from __future__ import annotations

import datetime
import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from cli_ledgers import EPOCH, MOVES, at, build, map_after, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands import status as status_command
from layout_ledger.cli.time_text import ago
from layout_ledger.core.layout import layout_digest, trivial_map
from layout_ledger.history.reader import LedgerReader
from layout_ledger.wire.protocol import LayoutView

INITIAL = trivial_map(4, 6, 4)
# status's clock in these tests: a day after the ledgers' clock began (no refusal is recent).
STATUS_NOW = EPOCH + datetime.timedelta(days=1)


@pytest.fixture(autouse=True)
def status_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_command, "_utc_now", lambda: STATUS_NOW)


def when(second: int) -> str:
    """The ledger's time ``second`` as status shows it: the time, and how long ago."""
    return f"{at(second)}; {ago(at(second), STATUS_NOW)}"


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("ledgers")
    return {
        kind: build(kind, directory / f"{kind}.sqlite")
        for kind in ("clean", "dirty", "mid_move", "refusals")
    }


# --- status -------------------------------------------------------------------------------


def test_status_of_a_killed_daemons_clean_ledger_shows_every_field_and_exits_6(ledgers, capsys):
    path = ledgers["clean"]
    code, out, err = run_cli(capsys, "status", str(path))
    assert (code, err) == (exit_codes.NOT_RUNNING, "")
    assert out == (
        f"ledger:              {path}\n"
        f"incarnation:         2 of 2 (started {when(4)}, not running, no clean end recorded)\n"
        "daemon:              not recorded\n"
        "device:              not recorded\n"
        "software:            not recorded\n"
        "config fingerprint:  fp\n"
        "geometry:            4 layers x 6 physical slots, 4 logical experts\n"
        "version:             3\n"
        f"digest:              {layout_digest(map_after(MOVES, 3))}\n"
        "history held:        versions 0..3\n"
        "dirty:               no\n"
        "pending move:        none\n"
        "attached:            engine-a\n"
        "non-following fetch: no\n"
        "refusals:            0\n"
        "busy begins:         1 (answered busy, not refused)\n"
        f"last event:          {at(16)} commit engine-a; {ago(at(16), STATUS_NOW)}\n"
        "state:               not_running\n"
    )


def test_status_of_a_dirty_ledger_names_engine_layers_and_base_version_and_exits_3(ledgers, capsys):
    path = ledgers["dirty"]
    code, out, err = run_cli(capsys, "status", str(path))
    assert (code, err) == (exit_codes.DIRTY, "")
    moved = [list(row) for row in INITIAL]
    moved[1] = [3, 2, 1, 0, 0, 1]
    assert out == (
        f"ledger:              {path}\n"
        f"incarnation:         1 of 1 (started {when(0)}, not running, no clean end recorded)\n"
        "daemon:              not recorded\n"
        "device:              not recorded\n"
        "software:            not recorded\n"
        "config fingerprint:  fp\n"
        "geometry:            4 layers x 6 physical slots, 4 logical experts\n"
        "version:             1\n"
        f"digest:              {layout_digest(moved)}\n"
        "history held:        versions 0..1\n"
        f"dirty:               yes, since {when(5)}: engine 'engine-a' detached while its move "
        "of layers [2, 3] from version 1 was pending, so the weights of those layers may be "
        "half-moved; restart the daemon (it reloads the weights from disk) and the engines "
        "that use it\n"
        "pending move:        none\n"
        "attached:            none\n"
        "non-following fetch: no\n"
        "refusals:            2 (none in the last 10 minutes)\n"
        f"last event:          {at(7)} begin_refused engine-b; {ago(at(7), STATUS_NOW)}\n"
        "state:               dirty\n"
    )


def test_status_of_a_ledger_mid_move_shows_the_pending_move_and_exits_4(ledgers, capsys):
    path = ledgers["mid_move"]
    code, out, err = run_cli(capsys, "status", str(path))
    assert (code, err) == (exit_codes.PENDING_OR_REFUSALS, "")
    moved = [list(row) for row in INITIAL]
    moved[0] = [1, 0, 2, 3, 0, 1]
    assert out == (
        f"ledger:              {path}\n"
        f"incarnation:         1 of 1 (started {when(0)}, not running, no clean end recorded)\n"
        "daemon:              not recorded\n"
        "device:              not recorded\n"
        "software:            not recorded\n"
        "config fingerprint:  fp\n"
        "geometry:            4 layers x 6 physical slots, 4 logical experts\n"
        "version:             1\n"
        f"digest:              {layout_digest(moved)}\n"
        "history held:        versions 0..1\n"
        "dirty:               no\n"
        f"pending move:        engine 'engine-a', layers 0-1, from version 1, since {when(4)}\n"
        "attached:            engine-a\n"
        "non-following fetch: no\n"
        "refusals:            0\n"
        f"last event:          {at(4)} begin engine-a; {ago(at(4), STATUS_NOW)}\n"
        "state:               pending\n"
    )


def test_status_of_old_refusals_of_a_killed_daemon_says_it_is_not_running(ledgers, capsys):
    # Its one refusal is long past (REFUSALS_WINDOW): not a state; its daemon is dead: exit 6.
    # A recent refusal's exit 4 is tests/test_cli_health.py's.
    code, out, _ = run_cli(capsys, "status", str(ledgers["refusals"]))
    assert code == exit_codes.NOT_RUNNING
    assert "refusals:            1 (none in the last 10 minutes)\n" in out
    assert out.endswith("state:               not_running\n")


@pytest.mark.parametrize("kind", ["clean", "dirty", "mid_move", "refusals"])
def test_status_json_carries_the_protocol_layout_state_without_the_map(ledgers, capsys, kind):
    code, out, _ = run_cli(capsys, "status", str(ledgers[kind]), "--json")
    assert out == json.dumps(json.loads(out), sort_keys=True, indent=2) + "\n"
    (status,) = json.loads(out)["ledgers"]
    with LedgerReader(ledgers[kind]) as reader:
        state = reader.state()
    protocol = LayoutView.of(state).to_wire()
    del protocol["physical_to_logical_map"]
    assert {key: status[key] for key in protocol} == protocol
    assert status["incarnation_id"] == state.incarnation_id
    assert status["state"] in ("clean", "dirty", "pending", "not_running", "refusals")
    assert (
        code
        == {
            "clean": exit_codes.OK,
            "dirty": exit_codes.DIRTY,
            "pending": exit_codes.PENDING_OR_REFUSALS,
            "not_running": exit_codes.NOT_RUNNING,
            "refusals": exit_codes.PENDING_OR_REFUSALS,
        }[status["state"]]
    )


def test_status_json_of_the_dirty_ledger_holds_the_dirty_move(ledgers, capsys):
    _, out, _ = run_cli(capsys, "status", str(ledgers["dirty"]), "--json")
    (status,) = json.loads(out)["ledgers"]
    assert status["dirty_move"] == {
        "engine_id": "engine-a",
        "layers": [2, 3],
        "base_version": 1,
        "at": at(5),
    }
    assert status["refusals"] == 2
    assert status["last_event"]["kind"] == "begin_refused"


def test_status_of_an_earlier_incarnation_shows_how_it_ended(ledgers, capsys):
    code, out, _ = run_cli(capsys, "status", str(ledgers["clean"]), "--incarnation", "1")
    assert code == exit_codes.OK
    assert f"incarnation:         1 of 2 (started {at(0)}, ended {when(3)} (clean))\n" in out
    assert "attached:            none\n" in out


# --- history ------------------------------------------------------------------------------

START_DIGEST = layout_digest(INITIAL)[:12]


def _digest(count: int) -> str:
    return layout_digest(map_after(MOVES, count))[:12]


def clean_history() -> list[str]:
    return [
        f"{at(0)}  inc=1  #1  start layers=0-3 version=0 digest={START_DIGEST}  (test-daemon)",
        f"{at(1)}  inc=1  #2  attach engine=engine-old version=0",
        f"{at(2)}  inc=1  #3  detach engine=engine-old  (attach connection closed (EOF))",
        f"{at(3)}  inc=1  #4  end  (clean: daemon shut down)",
        f"{at(4)}  inc=2  #5  start layers=0-3 version=0 digest={START_DIGEST}  (test-daemon)",
        f"{at(5)}  inc=2  #6  attach engine=engine-a version=0",
        f"{at(6)}  inc=2  #7  begin engine=engine-a layers=0-1 base=0",
        f"{at(7)}  inc=2  #8  commit engine=engine-a layers=0-1 base=0 version=1 "
        f"digest={_digest(1)}",
        f"{at(8)}  inc=2  #9  begin engine=engine-a layers=2 base=1",
        f"{at(9)}  inc=2  #10  commit engine=engine-a layers=2 base=1 version=2 "
        f"digest={_digest(2)}",
        f"{at(10)}  inc=2  #11  attach engine=engine-b version=2",
        f"{at(11)}  inc=2  #12  begin_busy engine=engine-a version=2  (engine-b is attached)",
        f"{at(12)}  inc=2  #13  detach engine=engine-b  (attach connection closed (EOF))",
        f"{at(13)}  inc=2  #14  begin engine=engine-a layers=1 base=2",
        f"{at(14)}  inc=2  #15  abort engine=engine-a layers=1 base=2",
        f"{at(15)}  inc=2  #16  begin engine=engine-a layers=0,3 base=2",
        f"{at(16)}  inc=2  #17  commit engine=engine-a layers=0,3 base=2 version=3 "
        f"digest={_digest(3)}",
    ]


def test_history_prints_every_event_in_order_one_line_each(ledgers, capsys):
    code, out, err = run_cli(capsys, "history", str(ledgers["clean"]))
    assert (code, err) == (exit_codes.OK, "")
    assert out.splitlines() == clean_history()


@pytest.mark.parametrize(
    ("filters", "event_ids"),
    [
        (["--incarnation", "1"], [1, 2, 3, 4]),
        (["--engine", "engine-b"], [11, 13]),
        (["--layers", "3"], [1, 5, 16, 17]),
        (["--layers", "1-2"], [1, 5, 7, 8, 9, 10, 14, 15]),
        (["--kind", "commit", "--kind", "abort"], [8, 10, 15, 17]),
        (["--since", at(10), "--until", at(13)], [11, 12, 13]),
        (["--since", "2026-01-01T00:00:15"], [16, 17]),
        (["--until", "2026-01-01T01:00:01+01:00"], [1]),
        (["--last", "2"], [16, 17]),
        (["--engine", "engine-a", "--kind", "begin", "--layers", "0"], [7, 16]),
    ],
)
def test_history_filters_by_incarnation_engine_layer_kind_and_time(
    ledgers, capsys, filters, event_ids
):
    code, out, _ = run_cli(capsys, "history", str(ledgers["clean"]), *filters)
    assert code == exit_codes.OK
    expected = clean_history()
    assert out.splitlines() == [expected[event_id - 1] for event_id in event_ids]


def test_history_with_no_match_says_so_and_exits_0(ledgers, capsys):
    code, out, _ = run_cli(capsys, "history", str(ledgers["clean"]), "--engine", "nobody")
    assert (code, out) == (exit_codes.OK, "no events match\n")


def test_history_json_is_the_ledger_events_view_row_for_row(ledgers, capsys):
    path = ledgers["dirty"]
    _, out, _ = run_cli(capsys, "history", str(path), "--json")
    history = json.loads(out)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(row) for row in conn.execute("SELECT * FROM ledger_events ORDER BY 1")]
    finally:
        conn.close()
    for row in rows:
        row["layers"] = None if row["layers"] is None else json.loads(row["layers"])
    # One shape whatever names the ledgers: each event names its ledger and rank.
    assert [(event.pop("ledger"), event.pop("rank")) for event in history["events"]] == [
        (str(path), 0)
    ] * len(rows)
    assert history["events"] == rows
    assert [event["kind"] for event in rows] == [
        "start",
        "attach",
        "begin",
        "commit",
        "begin",
        "detach",
        "dirty",
        "fetch_refused",
        "begin_refused",
    ]


def test_history_of_a_missing_incarnation_fails_naming_it(ledgers, capsys):
    code, out, err = run_cli(capsys, "history", str(ledgers["clean"]), "--incarnation", "7")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == "layout-ledger history: error: the ledger has no incarnation 7\n"


# --- show ---------------------------------------------------------------------------------


def test_show_prints_the_current_map_per_ep_rank_like_sglang(ledgers, capsys):
    code, out, _ = run_cli(capsys, "show", str(ledgers["clean"]), "--ep-size", "2")
    assert code == exit_codes.OK
    assert out == (
        "physical_to_logical_map num_layers=4 num_physical_experts=6 ep_size=2\n"
        "layer=0: ep0=[1,0,2] ep1=[3,1,0]\n"
        "layer=1: ep0=[0,1,3] ep1=[2,0,1]\n"
        "layer=2: ep0=[3,2,1] ep1=[0,0,1]\n"
        "layer=3: ep0=[2,3,0] ep1=[1,0,1]\n"
    )


def test_show_an_older_version_and_some_layers(ledgers, capsys):
    argv = ["show", str(ledgers["clean"]), "--version", "1", "--layers", "0,2-3", "--ep-size", "3"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == exit_codes.OK
    assert out == (
        "physical_to_logical_map num_layers=4 num_physical_experts=6 ep_size=3\n"
        "layer=0: ep0=[1,0] ep1=[2,3] ep2=[0,1]\n"
        "layer=2: ep0=[0,1] ep1=[2,3] ep2=[0,1]\n"
        "layer=3: ep0=[0,1] ep1=[2,3] ep2=[0,1]\n"
    )


@pytest.mark.parametrize("command", ["show", "plot", "export"])
def test_an_ep_size_that_does_not_divide_the_slots_is_refused_alike_by_show_plot_and_export(
    ledgers, tmp_path, capsys, command
):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [command, str(ledgers["clean"]), "--ep-size", "4"]
    if command == "plot":
        argv += ["-o", str(tmp_path / "out.png")]
    if command == "export":
        argv += ["-o", str(tmp_path / "out.json"), "--check", "--model-path", str(model)]
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger {command}: error: --ep-size 4 does not divide the 6 physical slots per "
        "layer; pass the EP size the engines run with\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_show_of_a_ledger_mid_move_prints_the_last_committed_map(ledgers, capsys):
    code, out, _ = run_cli(capsys, "show", str(ledgers["mid_move"]), "--ep-size", "2")
    assert code == exit_codes.OK
    assert out == (
        "physical_to_logical_map num_layers=4 num_physical_experts=6 ep_size=2\n"
        "layer=0: ep0=[1,0,2] ep1=[3,0,1]\n"
        "layer=1: ep0=[0,1,2] ep1=[3,0,1]\n"
        "layer=2: ep0=[0,1,2] ep1=[3,0,1]\n"
        "layer=3: ep0=[0,1,2] ep1=[3,0,1]\n"
    )


def test_history_of_the_dirty_ledger_ends_with_the_dirty_mark_and_the_refusals(ledgers, capsys):
    code, out, _ = run_cli(capsys, "history", str(ledgers["dirty"]), "--last", "4")
    assert code == exit_codes.OK
    reason = (
        "engine 'engine-a' detached while its move of layers [2, 3] from version 1 was pending, "
        "so the weights of those layers may be half-moved; restart the daemon (it reloads the "
        "weights from disk) and the engines that use it"
    )
    assert out.splitlines() == [
        f"{at(5)}  inc=1  #6  detach engine=engine-a  (attach connection closed (EOF))",
        f"{at(5)}  inc=1  #7  dirty engine=engine-a layers=2-3 base=1  ({reason})",
        f"{at(6)}  inc=1  #8  fetch_refused engine=engine-b version=1  (dirty)",
        f"{at(7)}  inc=1  #9  begin_refused engine=engine-b version=1  (dirty)",
    ]


def test_show_json_holds_each_layers_slots_and_the_versions_digest(ledgers, capsys):
    _, out, _ = run_cli(capsys, "show", str(ledgers["clean"]), "--version", "2", "--json")
    shown = json.loads(out)
    assert shown["version"] == 2
    assert shown["digest"] == layout_digest(map_after(MOVES, 2))
    assert [layer["slots"] for layer in shown["layers"]] == map_after(MOVES, 2)
    assert [layer["layer"] for layer in shown["layers"]] == [0, 1, 2, 3]
    assert (shown["num_layers"], shown["num_physical_slots"], shown["ep_size"]) == (4, 6, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--version", "4"],
            "incarnation 2 holds versions 0..3; version 4 is not among them",
        ),
        (["--layers", "2,4"], "layer 4 does not exist: this ledger's maps have layers 0..3"),
        (["--incarnation", "3"], "the ledger has no incarnation 3"),
    ],
)
def test_show_of_something_the_ledger_does_not_hold_fails_with_exit_1(
    ledgers, capsys, argv, message
):
    code, out, err = run_cli(capsys, "show", str(ledgers["clean"]), *argv)
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == f"layout-ledger show: error: {message}\n"


# --- diff ---------------------------------------------------------------------------------


def test_diff_counts_changed_slots_per_layer_and_in_total(ledgers, capsys):
    code, out, _ = run_cli(capsys, "diff", str(ledgers["clean"]), "1", "3")
    assert code == exit_codes.OK
    assert out == (
        f"incarnation 2: version 1 (digest {_digest(1)}) -> version 3 (digest {_digest(3)})\n"
        "changed_physical_slots=10/24\n"
        "layer=0: changed=2/6\n"
        "layer=2: changed=4/6\n"
        "layer=3: changed=4/6\n"
    )


def test_diff_with_slots_lists_each_changed_slot(ledgers, capsys):
    code, out, _ = run_cli(capsys, "diff", str(ledgers["clean"]), "2", "3", "--slots")
    assert code == exit_codes.OK
    assert out.splitlines()[1:] == [
        "changed_physical_slots=6/24",
        "layer=0: changed=2/6",
        "  slot 4: 0 -> 1",
        "  slot 5: 1 -> 0",
        "layer=3: changed=4/6",
        "  slot 0: 0 -> 2",
        "  slot 1: 1 -> 3",
        "  slot 2: 2 -> 0",
        "  slot 3: 3 -> 1",
    ]


def test_diff_of_a_version_with_itself_has_no_changed_layer(ledgers, capsys):
    _, out, _ = run_cli(capsys, "diff", str(ledgers["clean"]), "2", "2")
    assert out.splitlines()[1:] == ["changed_physical_slots=0/24", "changed_layers=[]"]


def test_diff_json_totals_equal_the_sum_of_its_layers(ledgers, capsys):
    _, out, _ = run_cli(capsys, "diff", str(ledgers["clean"]), "0", "3", "--json")
    diff = json.loads(out)
    before, after = INITIAL, map_after(MOVES, 3)
    expected = [
        {
            "layer": layer,
            "changed": sum(a != b for a, b in zip(before[layer], after[layer], strict=True)),
            "slots": [
                {"slot": slot, "from": a, "to": b}
                for slot, (a, b) in enumerate(zip(before[layer], after[layer], strict=True))
                if a != b
            ],
        }
        for layer in range(4)
        if before[layer] != after[layer]
    ]
    assert diff["changed_layers"] == expected
    assert diff["changed_slots"] == sum(layer["changed"] for layer in expected) == 14
    assert diff["total_slots"] == 24


# --- export -------------------------------------------------------------------------------


def test_export_writes_an_init_expert_location_file_of_the_version(ledgers, capsys, tmp_path):
    output = tmp_path / "layout.json"
    code, out, _ = run_cli(
        capsys, "export", str(ledgers["clean"]), "--version", "2", "-o", str(output)
    )
    assert code == exit_codes.OK
    assert out == (
        f"wrote {output}: incarnation 2 version 2 (digest {_digest(2)}), 4 layers x 6 physical "
        f"slots\nstart an engine with it: --init-expert-location {output}\n"
    )
    assert output.read_text() == (
        '{\n  "physical_to_logical_map": [\n'
        "    [1,0,2,3,0,1],\n"
        "    [0,1,3,2,0,1],\n"
        "    [3,2,1,0,0,1],\n"
        "    [0,1,2,3,0,1]\n"
        "  ]\n}\n"
    )
    # sglang passes every key of the file to init_by_mapping as a keyword: only this one.
    assert json.loads(output.read_text()) == {"physical_to_logical_map": map_after(MOVES, 2)}


def test_export_json_names_the_version_and_digest_exported(ledgers, capsys, tmp_path):
    output = tmp_path / "current.json"
    argv = ["export", str(ledgers["dirty"]), "-o", str(output), "--json", "--force"]
    _, out, _ = run_cli(capsys, *argv)
    exported = json.loads(out)
    the_map = json.loads(output.read_text())["physical_to_logical_map"]
    assert exported["digest"] == layout_digest(the_map)
    assert (exported["version"], exported["dirty"], exported["check"]) == (1, True, None)
    assert exported["dirty_reason"].startswith("engine 'engine-a' detached while its move")


def test_export_refuses_a_dirty_ledger_naming_why_and_the_runbooks_section_unless_forced(
    ledgers, capsys, tmp_path
):
    output = tmp_path / "dirty.json"
    code, out, err = run_cli(capsys, "export", str(ledgers["dirty"]), "-o", str(output))
    assert (code, out) == (exit_codes.DIRTY, "")
    assert err.startswith(
        f"layout-ledger export: error: incarnation 1 of {ledgers['dirty']} is dirty (engine "
        "'engine-a' detached while its move"
    )
    assert err.endswith(
        "so no engine should start from it: restart the daemons first (docs/operations.md, "
        '"... because a daemon is dirty"), or pass --force to export it anyway\n'
    )
    assert not output.exists()
    code, out, _ = run_cli(capsys, "export", str(ledgers["dirty"]), "-o", str(output), "--force")
    assert code == exit_codes.OK
    assert out.splitlines()[2].startswith("note: this incarnation is dirty")


def test_export_refuses_a_file_name_sglang_would_parse_as_inline_json(ledgers, capsys, tmp_path):
    output = tmp_path / "layout.txt"
    code, _, err = run_cli(capsys, "export", str(ledgers["clean"]), "-o", str(output))
    assert code == exit_codes.FAILED
    assert "name the output file *.json" in err
    assert not output.exists()


def test_export_refuses_a_ledger_mid_move_unless_forced_and_then_says_a_move_is_pending(
    ledgers, capsys, tmp_path
):
    output = tmp_path / "pending.json"
    code, out, err = run_cli(capsys, "export", str(ledgers["mid_move"]), "-o", str(output))
    assert (code, out) == (exit_codes.PENDING_OR_REFUSALS, "")
    assert err == (
        f"layout-ledger export: error: incarnation 1 of {ledgers['mid_move']} has a move pending "
        f"(engine 'engine-a', layers 0-1, from version 1, since {at(4)}), which changes the "
        "layout this file would hold: wait for it to commit, then export again "
        '(docs/operations.md, "... because a move is pending, or stuck"), or pass --force to '
        "export it anyway\n"
    )
    assert not output.exists()
    code, out, _ = run_cli(capsys, "export", str(ledgers["mid_move"]), "-o", str(output), "--force")
    assert code == exit_codes.OK
    assert out.splitlines()[2:] == [
        f"note: a move is pending (engine 'engine-a', layers 0-1, from version 1, since "
        f"{at(4)}); the file holds the last committed layout, which that move changes when it "
        "commits"
    ]
    argv = ["-o", str(output), "--json", "--force"]
    _, out, _ = run_cli(capsys, "export", str(ledgers["mid_move"]), *argv)
    exported = json.loads(out)
    assert exported["pending"] == {"engine_id": "engine-a", "layers": [0, 1], "base_version": 1}
    _, out, _ = run_cli(capsys, "export", str(ledgers["clean"]), *argv)
    assert json.loads(out)["pending"] is None


def test_export_never_replaces_an_existing_file_unless_forced(ledgers, capsys, tmp_path):
    output = tmp_path / "layout.json"
    output.write_text("an earlier export\n")
    code, out, err = run_cli(capsys, "export", str(ledgers["clean"]), "-o", str(output))
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger export: error: {output} already exists; nothing was written: export "
        "never replaces a file: remove it, name another, or pass --force to replace it\n"
    )
    assert output.read_text() == "an earlier export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout.json"]
    code, _, _ = run_cli(capsys, "export", str(ledgers["clean"]), "-o", str(output), "--force")
    assert code == exit_codes.OK
    assert json.loads(output.read_text())["physical_to_logical_map"] == map_after(MOVES, 3)


def test_export_check_that_fails_writes_nothing_and_keeps_an_earlier_file(
    ledgers, capsys, tmp_path
):
    output = tmp_path / "layout.json"
    output.write_text("an earlier export\n")
    no_model = tmp_path / "no-model"
    no_model.mkdir()
    argv = ["export", str(ledgers["clean"]), "-o", str(output), "--check", "--force"]
    code, out, err = run_cli(capsys, *argv, "--model-path", str(no_model))
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger export: error: --model-path {no_model} has no config.json; pass the "
        "model's directory, the one that holds its config.json\n"
    )
    assert output.read_text() == "an earlier export\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout.json", "no-model"]


def test_export_syncs_the_file_and_then_its_directory_to_disk(
    ledgers, capsys, tmp_path, monkeypatch
):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("directory" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code, _, _ = run_cli(capsys, "export", str(ledgers["clean"]), "-o", str(tmp_path / "x.json"))
    assert code == exit_codes.OK
    assert synced == ["file", "directory"]


# --- read-only ------------------------------------------------------------------------------


def test_read_commands_change_neither_the_ledger_nor_its_wal(tmp_path, capsys):
    path = build("dirty", tmp_path / "l.sqlite")
    files = [path, path.with_name(path.name + "-wal")]
    before = [f.read_bytes() for f in files]
    for argv in (
        ["status"],
        ["history"],
        ["show", "--version", "0"],
        ["diff", "0", "1"],
        ["export", "-o", str(tmp_path / "x.json")],
        ["verify"],
        ["plot", "-o", str(tmp_path / "x.png"), "--moves"],
    ):
        code, _, err = run_cli(capsys, argv[0], str(path), *argv[1:])
        assert code in (exit_codes.OK, exit_codes.DIRTY), err
    assert [f.read_bytes() for f in files] == before
