"""``layout-ledger prune`` and ``upgrade``: what they change, what they refuse, and when."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from alembic import command
from cli_ledgers import build, execute, query, run_cli
from sqlalchemy import create_engine

from layout_ledger.cli import exit_codes
from layout_ledger.store.connections import WriterLock
from layout_ledger.store.ledger import Ledger
from layout_ledger.store.migrate import alembic_config
from layout_ledger.store.schema import SCHEMA_HEAD


def dump(path: Path) -> dict[str, list[tuple]]:
    return {
        table: query(path, f"SELECT * FROM {table} ORDER BY 1")
        for table in ("alembic_version", "incarnations", "versions", "layout_rows", "events")
    }


def revision(path: Path) -> str:
    return str(query(path, "SELECT version_num FROM alembic_version")[0][0])


# --- prune --------------------------------------------------------------------------------


def test_prune_reports_what_it_removed_and_keeps_the_kept_versions_whole(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    _, before, _ = run_cli(capsys, "show", str(path), "--version", "2", "--json")
    code, out, err = run_cli(capsys, "prune", str(path), "--keep", "2")
    assert (code, err) == (exit_codes.OK, "")
    *lines, vacuumed = out.splitlines()
    assert lines == [
        "incarnation 1: nothing to remove; holds versions 0..0",
        # layers 0, 1 and 2 each lose their version-0 row; version 2 builds on v1/v1/v2/v0.
        "incarnation 2: removed 3 layout rows older than version 2; holds versions 2..3",
        "removed 3 layout rows in all (every event kept)",
    ]
    # issue 23: the freed pages go back to the filesystem (VACUUM, no daemon running)
    assert re.fullmatch(r"VACUUM: file and -wal (\d+) -> (\d+) bytes \((\d+) freed\)", vacuumed)
    _, after, _ = run_cli(capsys, "show", str(path), "--version", "2", "--json")
    assert after == before
    code, _, err = run_cli(capsys, "show", str(path), "--version", "1")
    assert code == exit_codes.FAILED
    assert "version 1 is not among them (older versions were pruned)" in err
    assert run_cli(capsys, "verify", str(path))[0] == exit_codes.OK
    _, out, _ = run_cli(capsys, "history", str(path), "--kind", "prune", "--json")
    (event,) = json.loads(out)["events"]
    assert (event["base_version"], event["new_version"]) == (2, 3)


def test_prune_json_counts_rows_per_incarnation_and_a_second_prune_removes_nothing(
    tmp_path, capsys
):
    path = build("clean", tmp_path / "l.sqlite")
    _, out, _ = run_cli(capsys, "prune", str(path), "--keep", "1", "--incarnation", "2", "--json")
    pruned = json.loads(out)
    sizes = {key: pruned.pop(key) for key in ("bytes_before", "bytes_after")}
    assert sizes["bytes_after"] < sizes["bytes_before"]  # issue 23: VACUUM gave space back
    assert pruned == {
        "path": str(path),
        "keep": 1,
        "dry_run": False,
        "vacuumed": True,
        "rows_removed": 5,
        "incarnations": [
            {
                "incarnation_id": 2,
                "rows_removed": 5,
                "reconstructible_from": 3,
                "current_version": 3,
            }
        ],
    }
    _, out, _ = run_cli(capsys, "prune", str(path), "--keep", "1", "--json")
    assert json.loads(out)["rows_removed"] == 0


def test_prune_refuses_while_a_move_is_pending_and_changes_nothing(tmp_path, capsys):
    path = build("mid_move", tmp_path / "l.sqlite")
    before = dump(path)
    code, out, err = run_cli(capsys, "prune", str(path), "--keep", "1")
    assert (code, out) == (exit_codes.FAILED, "")
    assert err == (
        "layout-ledger prune: error: incarnation 1 has a move pending (engine 'engine-a', "
        "layers [0, 1]); prune after it commits or aborts\n"
    )
    assert dump(path) == before


def _assert_refused_as_owned(capsys, path: Path, *argv: str) -> None:
    before = dump(path)
    code, out, err = run_cli(capsys, *argv)
    assert (code, out) == (exit_codes.FAILED, "")
    verb = argv[0]
    # Said to the person at the CLI: what they can do, not the advice a second daemon gets.
    assert err.startswith(
        f"layout-ledger {verb}: error: {verb} refused: the ledger {path} is in use by its running "
        f"daemon (its writer lock: pid={os.getpid()} since="
    )
    assert f"and {verb} writes the file only while no daemon does; " in err
    assert ("stop that daemon (`layout-ledger status LEDGER` shows its pid)" in err) == (
        verb == "prune"
    )
    assert "give this one its own ledger path" not in err and err.count("\n") == 1
    assert dump(path) == before


def test_prune_fails_at_once_while_a_daemon_owns_the_ledger(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    daemon = Ledger.open(path)  # holds the one-writer lock, as a running daemon does
    try:
        _assert_refused_as_owned(capsys, path, "prune", str(path), "--keep", "1")
        assert run_cli(capsys, "status", str(path))[0] == exit_codes.OK  # reading works
    finally:
        daemon.close()


@pytest.mark.parametrize("verb", ["prune", "upgrade"])
def test_the_writing_commands_never_create_a_ledger(tmp_path, capsys, verb):
    path = tmp_path / "missing.sqlite"
    argv = [verb, str(path)] + (["--keep", "1"] if verb == "prune" else [])
    code, _, err = run_cli(capsys, *argv)
    assert code == exit_codes.UNUSABLE
    assert err == (
        f"layout-ledger {verb}: error: ledger {path} does not exist; check the path: "
        "`layout-ledger fleet` given no PATH lists the daemons' ledgers here\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- upgrade ------------------------------------------------------------------------------


@pytest.fixture
def older_ledger(tmp_path: Path) -> Path:
    """A ledger with history, taken back to the first schema revision (no forensic views)."""
    path = build("dirty", tmp_path / "l.sqlite")
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0001_initial")
    engine.dispose()
    assert revision(path) == "0001_initial"
    return path


def test_read_commands_send_an_older_ledger_to_upgrade(older_ledger, capsys):
    code, out, err = run_cli(capsys, "status", str(older_ledger))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err == (
        f"layout-ledger status: error: ledger {older_ledger} has the older schema revision "
        f"'0001_initial'; run `layout-ledger upgrade {older_ledger}` (or restart its daemon, "
        f"which upgrades it)\n"
    )


def test_prune_sends_an_older_ledger_to_upgrade_instead_of_upgrading_it(older_ledger, capsys):
    code, out, err = run_cli(capsys, "prune", str(older_ledger), "--keep", "1")
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert "run `layout-ledger upgrade" in err
    assert revision(older_ledger) == "0001_initial"


def test_upgrade_brings_an_older_ledger_to_head_keeping_its_history(older_ledger, capsys):
    before = dump(older_ledger)
    code, out, err = run_cli(capsys, "upgrade", str(older_ledger))
    assert (code, err) == (exit_codes.OK, "")
    assert out == (f"upgraded ledger {older_ledger} from schema 0001_initial to {SCHEMA_HEAD}\n")
    after = dump(older_ledger)
    assert after.pop("alembic_version") == [(SCHEMA_HEAD,)]
    before.pop("alembic_version")
    # Later revisions add columns to events (count, last_at, chain), incarnations (where it
    # ran, 0004: empty for the rows an older ledger holds) and versions (0007's fingerprints
    # digest): every row keeps its own.
    width = len(before["events"][0])
    assert [row[:width] for row in after.pop("events")] == before.pop("events")
    width = len(before["incarnations"][0])
    incarnations = after.pop("incarnations")
    assert [row[:width] for row in incarnations] == before.pop("incarnations")
    assert all(value is None for row in incarnations for value in row[width:])
    # 0007 adds versions.fingerprints_digest: NULL for the rows of older code.
    width = len(before["versions"][0])
    versions = after.pop("versions")
    assert [row[:width] for row in versions] == before.pop("versions")
    assert all(value is None for row in versions for value in row[width:])
    assert after == before
    assert run_cli(capsys, "status", str(older_ledger))[0] == exit_codes.DIRTY
    assert run_cli(capsys, "verify", str(older_ledger))[0] == exit_codes.OK
    code, out, _ = run_cli(capsys, "upgrade", str(older_ledger), "--json")
    assert json.loads(out) == {
        "path": str(older_ledger),
        "from_revision": SCHEMA_HEAD,
        "to_revision": SCHEMA_HEAD,
        "upgraded": False,
    }


def test_upgrade_fails_at_once_while_a_daemon_owns_the_older_ledger(older_ledger, capsys):
    daemon = WriterLock(older_ledger)  # what a daemon holds for as long as it runs
    try:
        _assert_refused_as_owned(capsys, older_ledger, "upgrade", str(older_ledger))
    finally:
        daemon.release()
    assert revision(older_ledger) == "0001_initial"


def test_upgrade_refuses_a_ledger_newer_than_this_code_and_changes_nothing(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE alembic_version SET version_num = '0099_from_the_future'")
    before = dump(path)
    code, out, err = run_cli(capsys, "upgrade", str(path))
    assert (code, out) == (exit_codes.UNUSABLE, "")
    assert err == (
        f"layout-ledger upgrade: error: ledger {path} has schema revision "
        f"'0099_from_the_future', newer than this code knows (newest known: '{SCHEMA_HEAD}'); "
        f"upgrade the sglang-expert-layout-ledger package\n"
    )
    assert dump(path) == before


def test_upgrade_fails_at_once_while_a_daemon_owns_a_ledger_already_at_head(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    daemon = Ledger.open(path)  # holds the one-writer lock, as a running daemon does
    try:
        _assert_refused_as_owned(capsys, path, "upgrade", str(path))
        _assert_refused_as_owned(capsys, path, "upgrade", str(path), "--json")
    finally:
        daemon.close()
    assert run_cli(capsys, "upgrade", str(path))[0] == exit_codes.OK
