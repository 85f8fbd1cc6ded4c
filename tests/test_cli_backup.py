"""``layout-ledger backup``: a consistent single-file copy through SQLite's backup API, while the
daemon writes; a plain ``cp`` of a live ledger loses what its ``-wal`` holds."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import stat

import pytest
from cli_ledgers import build, committing_writer, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.store.schema import SCHEMA_HEAD
from sglang_integration.testing.daemon_control import EngineStandIn, start_daemon

pytestmark = pytest.mark.timeout(240)


def test_cp_of_a_live_ledger_loses_its_wal_and_backup_keeps_it(tmp_path, capsys):
    daemon = start_daemon(tmp_path / "daemon")
    engine = EngineStandIn.start(daemon.socket_path, "engine-a")
    try:
        assert engine.begin(0, [0]).ok
        assert engine.commit({0: [1, 0, 2, 3, 4, 5, 6, 7, 0, 1]}).ok
        live = str(daemon.ledger_path)
        copied = tmp_path / "cp.sqlite"
        shutil.copyfile(live, copied)  # what `cp` does: the main file only
        code, _, err = run_cli(capsys, "status", str(copied))
        assert code == exit_codes.UNUSABLE
        assert "is an empty SQLite file" in err
        backups = tmp_path / "backups"
        backups.mkdir()
        code, out, err = run_cli(capsys, "backup", live, str(backups / "l.sqlite"))
        assert (code, err) == (exit_codes.OK, "")
        assert out.startswith(f"backed up {live} to {backups / 'l.sqlite'}: ")
        assert os.listdir(backups) == ["l.sqlite"]  # one file: no -wal beside it
        assert stat.S_IMODE((backups / "l.sqlite").stat().st_mode) == 0o600
        assert run_cli(capsys, "verify", str(backups / "l.sqlite"))[0] == exit_codes.OK
        _, out, _ = run_cli(capsys, "status", str(backups / "l.sqlite"), "--json")
        assert json.loads(out)["ledgers"][0]["version"] == 1
    finally:
        engine.kill()
        daemon.kill()


def test_backups_taken_while_a_writer_commits_each_verify(tmp_path, capsys):
    path = tmp_path / "live.sqlite"
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    commits = context.Value("i", 0)
    writer = context.Process(target=committing_writer, args=(str(path), ready, stop, commits))
    writer.start()
    versions = set()
    try:
        assert ready.wait(120), "the writer process did not start"
        for n in range(6):
            copy = tmp_path / f"copy-{n}.sqlite"
            code, out, err = run_cli(capsys, "backup", str(path), str(copy), "--json")
            assert (code, err) == (exit_codes.OK, ""), err
            assert json.loads(out)["backups"][0]["output"] == str(copy)
            code, _, err = run_cli(capsys, "verify", str(copy))
            assert code == exit_codes.OK, err
            (status,) = json.loads(run_cli(capsys, "status", str(copy), "--json")[1])["ledgers"]
            versions.add(status["version"])
    finally:
        stop.set()
        writer.join(60)
    assert len(versions) > 1  # the copies were taken while commits went on


def test_backup_json_names_what_the_copy_holds(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    code, out, _ = run_cli(capsys, "backup", str(path), str(tmp_path / "b.sqlite"), "--json")
    assert code == exit_codes.OK
    # One shape whatever names the ledger: the copy of one is a list of one.
    assert json.loads(out)["directory"] == str(tmp_path)
    assert json.loads(out)["failures"] == []
    (result,) = json.loads(out)["backups"]
    chain = [
        line for line in run_cli(capsys, "verify", str(path))[1].splitlines() if "head" in line
    ]
    assert result == {
        "path": str(path),
        "output": str(tmp_path / "b.sqlite"),
        "schema_revision": SCHEMA_HEAD,
        "bytes": (tmp_path / "b.sqlite").stat().st_size,
        "incarnations": 2,
        "events": 17,
        "chain_head": chain[0].rsplit(" ", 1)[1],
    }


def test_backup_into_a_directory_uses_the_ledgers_name_and_never_replaces_a_file(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    into = tmp_path / "backups"
    into.mkdir()
    assert run_cli(capsys, "backup", str(path), str(into))[0] == exit_codes.OK
    assert os.listdir(into) == ["l.sqlite"]
    before = (into / "l.sqlite").read_bytes()
    code, out, err = run_cli(capsys, "backup", str(path), str(into))
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        f"layout-ledger backup: error: {into / 'l.sqlite'} already exists; a backup never "
        "replaces a file: remove it or name another\n"
    )
    assert (into / "l.sqlite").read_bytes() == before


def test_backup_of_something_that_is_no_ledger_is_refused(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    code, out, err = run_cli(capsys, "backup", str(text), str(tmp_path / "b.sqlite"))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err == f"layout-ledger backup: error: {text} is not an SQLite database\n"
    assert not (tmp_path / "b.sqlite").exists()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_backup_into_an_unwritable_directory_is_one_error_line_exit_1(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    if os.geteuid() == 0:  # root writes into a mode-0500 directory: take one no one can write
        into = "/sys/"
    else:
        locked = tmp_path / "read-only"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        into = f"{locked}/"
    code, out, err = run_cli(capsys, "backup", str(path), into)
    assert (code, out) == (exit_codes.FAILED, "")
    assert err.startswith(f"layout-ledger backup: error: cannot write the backup {into}l.sqlite")
    assert err.count("\n") == 1 and "Traceback" not in err
