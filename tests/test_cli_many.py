"""Many ledgers per call (issue 23, item 3): ``status`` and ``backup`` take ``fleet``'s PATH...
forms (files, directories, the daemons' template), and a retired ledger stops being counted.

Machine output has one shape whatever names the ledgers: one ledger is a list of one (the human
text of one file stays the one-ledger form).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cli_ledgers import build, run_cli
from engine_ledgers import EngineLedgers
from ledger_support import open_ledger, start

from layout_ledger.cli import exit_codes
from layout_ledger.cli.commands.metrics import collect_metrics, exposition

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def engine(tmp_path: Path):
    (tmp_path / "ledgers").mkdir()
    ledgers = EngineLedgers(tmp_path / "ledgers", 3)
    ledgers.commit_all(2)
    try:
        yield ledgers
    finally:
        ledgers.close()


def test_status_of_a_directory_a_template_and_files_gives_one_report_each(engine, capsys):
    directory = engine.paths[0].parent
    template = directory / "rank-{device_uuid}.sqlite"
    engine.leave_mid_move(1)  # rank 1 dirty
    for argv in ([str(directory)], [str(template)], list(map(str, engine.paths))):
        code, out, _ = run_cli(capsys, "status", *argv, "--json")
        assert code == exit_codes.DIRTY
        report = json.loads(out)
        assert [item["path"] for item in report["ledgers"]] == list(map(str, engine.paths))
        assert [item["state"] for item in report["ledgers"]] == ["clean", "dirty", "clean"]
        assert report["state"] == "dirty"
    code, out, _ = run_cli(capsys, "status", str(directory))
    blocks = out.split("\n\n")
    assert len(blocks) == 4 and blocks[1].startswith(f"ledger:              {engine.paths[1]}\n")
    assert blocks[-1] == "3 ledgers: 2 clean, 1 dirty; worst: dirty\n"
    # One file: the same shape, a list of one (a script parses one shape whatever it named).
    code, out, _ = run_cli(capsys, "status", str(engine.paths[0]), "--json")
    assert code == exit_codes.OK
    assert sorted(json.loads(out)) == ["ledgers", "state"]
    assert [item["path"] for item in json.loads(out)["ledgers"]] == [str(engine.paths[0])]


def _shape(value: object) -> object:
    """The keys of every object in ``value``, nested (lists by their first item), not values."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "{path}", "--json"],
        ["history", "{path}", "--json"],
        ["history", "{path}", "--last", "2", "--nl"],
        ["history", "{path}", "--last", "2", "--csv"],
        ["backup", "{path}", "{out}", "--json"],
    ],
    ids=["status --json", "history --json", "history --nl", "history --csv", "backup --json"],
)
def test_machine_output_has_one_shape_whether_a_file_a_directory_or_a_template_names_one_ledger(
    tmp_path, capsys, argv
):
    (tmp_path / "ledgers").mkdir()
    path = build("clean", tmp_path / "ledgers" / "rank-GPU-0.sqlite")
    expected = exit_codes.NOT_RUNNING if argv[0] == "status" else exit_codes.OK
    shapes = []
    for n, named in enumerate([path, path.parent, path.parent / "rank-{device_uuid}.sqlite"]):
        into = tmp_path / f"copies-{n}"
        into.mkdir()
        filled = [{"{path}": str(named), "{out}": str(into)}.get(arg, arg) for arg in argv]
        code, out, err = run_cli(capsys, *filled)
        assert (code, err) == (expected, "")
        if "--csv" in argv:
            shapes.append(out.splitlines()[0])  # the header: the columns
        elif "--nl" in argv:
            shapes.append(_shape(json.loads(out.splitlines()[0])))
        else:
            shapes.append(_shape(json.loads(out)))
    assert shapes[0] == shapes[1] == shapes[2]


def test_status_of_many_reports_an_unreadable_one_and_exits_2_when_nothing_is_worse(
    engine, tmp_path, capsys
):
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    code, out, err = run_cli(capsys, "status", str(engine.paths[0]), str(broken), "--json")
    assert code == exit_codes.UNUSABLE
    assert [item["state"] for item in json.loads(out)["ledgers"]] == ["clean", "unreadable"]
    assert err == (
        f"layout-ledger status: error: cannot read ledger {broken}: {broken} is not an SQLite "
        "database\n"
    )


def test_backup_of_many_ledgers_writes_one_file_each_into_a_directory(engine, tmp_path, capsys):
    into = tmp_path / "backups"
    into.mkdir()
    directory = engine.paths[0].parent
    code, out, err = run_cli(capsys, "backup", str(directory), str(into), "--json")
    assert (code, err) == (exit_codes.OK, "")
    report = json.loads(out)
    assert sorted(os.listdir(into)) == [path.name for path in engine.paths]
    assert [item["output"] for item in report["backups"]] == [
        str(into / path.name) for path in engine.paths
    ]
    assert report["failures"] == []
    for path in engine.paths:
        assert stat.S_IMODE((into / path.name).stat().st_mode) == 0o600
        assert run_cli(capsys, "verify", str(into / path.name))[0] == exit_codes.OK
    # Again into the same directory: nothing is replaced, each one says so.
    code, out, err = run_cli(capsys, "backup", str(directory), str(into))
    assert code == exit_codes.FAILED
    assert err.count("\n") == 3 and "already exists; a backup never replaces a file" in err
    # Many ledgers need a directory.
    code, _, err = run_cli(capsys, "backup", *map(str, engine.paths), str(tmp_path / "x.sqlite"))
    assert code == exit_codes.FAILED
    assert "backing up 3 ledgers needs DEST to be a directory" in err


def test_two_ledgers_of_one_name_are_refused_before_any_copy(engine, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    EngineLedgers(other, 1).close()
    into = tmp_path / "backups"
    into.mkdir()
    code, _, err = run_cli(
        capsys, "backup", str(engine.paths[0]), str(other / "rank-00.sqlite"), str(into)
    )
    assert code == exit_codes.FAILED
    assert "have the same name, so their copies would be one file" in err
    assert os.listdir(into) == []


# --- retire -----------------------------------------------------------------------------------


def test_a_retired_ledger_is_shown_but_not_counted_and_unretire_undoes_it(engine, capsys):
    paths = list(map(str, engine.paths))
    engine.ledgers.pop(2).close()  # rank 2's GPU is gone: its daemon is not running
    code, out, _ = run_cli(capsys, "fleet", *paths, "--json")
    assert code == exit_codes.INCONSISTENT  # two ranks at version 2, one not running
    code, out, err = run_cli(capsys, "retire", paths[2], "--reason", "GPU 2 replaced")
    assert (code, err) == (exit_codes.OK, "")
    assert out.startswith(f"retired {paths[2]} (incarnation 1): fleet, metrics and the alerts")
    code, out, _ = run_cli(capsys, "fleet", *paths, "--json")
    report = json.loads(out)
    assert (code, report["verdict"]["outcome"]) == (exit_codes.OK, "adopt")
    assert report["ledgers"][2]["state"] == "retired"
    assert report["ledgers"][2]["retired"]["reason"] == "GPU 2 replaced"
    code, status = run_cli(capsys, "status", paths[2], "--json")[:2]
    assert (code, json.loads(status)["ledgers"][0]["state"]) == (exit_codes.OK, "retired")
    text = exposition(collect_metrics(engine.paths)).decode()
    lines = [line for line in text.splitlines() if paths[2] in line]
    assert sorted(line.split("{")[0] for line in lines) == [
        "sglang_expert_layout_ledger_readable",
        "sglang_expert_layout_ledger_retired",
    ]
    assert run_cli(capsys, "retire", paths[2])[1].endswith("already retired; nothing changed\n")
    code, out, _ = run_cli(capsys, "unretire", paths[2], "--json")
    assert code == exit_codes.OK
    assert json.loads(out)["ledgers"][0]["result"] == "unretired"
    assert run_cli(capsys, "fleet", *paths)[0] == exit_codes.INCONSISTENT
    note = json.loads(Path(paths[2] + ".retired").read_text())
    assert [step["action"] for step in note["steps"]] == ["retire", "unretire"]
    assert stat.S_IMODE(Path(paths[2] + ".retired").stat().st_mode) == 0o600


def test_a_running_daemons_ledger_cannot_be_retired_and_a_new_incarnation_ends_a_retirement(
    engine, capsys
):
    paths = list(map(str, engine.paths))
    code, out, err = run_cli(capsys, "retire", paths[0])
    assert (code, out) == (exit_codes.FAILED, "")
    assert f"the daemon of {paths[0]} is running: a ledger is retired only when" in err
    assert not Path(paths[0] + ".retired").exists()
    engine.ledgers[0].end_incarnation()
    assert run_cli(capsys, "retire", paths[0])[0] == exit_codes.OK
    (status,) = json.loads(run_cli(capsys, "status", paths[0], "--json")[1])["ledgers"]
    assert status["state"] == "retired"
    engine.records[0] = engine._start(0)  # the GPU is back: a daemon starts on the ledger
    (status,) = json.loads(run_cli(capsys, "status", paths[0], "--json")[1])["ledgers"]
    assert (status["state"], status["retired"]) == ("clean", None)


def test_the_exit_code_of_many_statuses_is_the_worst_in_the_documented_order(
    engine, tmp_path, capsys
):
    # dirty (3), pending (4), not_running (6), refusals (4), unreadable (2), clean (0): each
    # ledger set below drops the worst of the one before, and the next state decides.
    engine.leave_mid_move(0)
    engine.begin(1)
    engine.records[2].record_refusal("attach", "engine-x", "engine 'engine-x' is already attached")
    stopped = build("clean", tmp_path / "stopped.sqlite")  # its daemon died: not_running
    broken = tmp_path / "broken.sqlite"
    broken.write_text("hello")
    by_state = {
        "dirty": engine.paths[0],
        "pending": engine.paths[1],
        "not_running": stopped,
        "refusals": engine.paths[2],
        "unreadable": broken,
    }
    expected = {
        "dirty": exit_codes.DIRTY,
        "pending": exit_codes.PENDING_OR_REFUSALS,
        "not_running": exit_codes.NOT_RUNNING,
        "refusals": exit_codes.PENDING_OR_REFUSALS,
        "unreadable": exit_codes.UNUSABLE,
    }
    clean = open_ledger(tmp_path / "clean.sqlite")
    try:
        start(clean)
        order = list(by_state)
        for worst in range(len(order) + 1):
            paths = [*(str(by_state[state]) for state in order[worst:]), str(clean.path)]
            code, out, _ = run_cli(capsys, "status", *paths, "--json")
            state = order[worst] if worst < len(order) else "clean"
            assert (code, json.loads(out)["state"]) == (expected.get(state, exit_codes.OK), state)
    finally:
        clean.close()
