"""``layout-ledger verify``: passes on what the ledger writes, names the first inconsistency else.

Each broken ledger is a real one (built by the ledger, tests/cli_ledgers.py) changed afterwards
with plain ``sqlite3``, the way a bug, a bad hand edit or a damaged disk would change it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from cli_ledgers import MOVES, build, execute, map_after, run_cli

from layout_ledger.cli import exit_codes
from layout_ledger.core.layout import layout_digest
from layout_ledger.store.schema import SCHEMA_HEAD


@pytest.mark.parametrize("kind", ["clean", "dirty", "mid_move", "refusals", "standby"])
def test_verify_passes_on_every_history_the_ledger_writes(tmp_path, capsys, kind):
    path = build(kind, tmp_path / "l.sqlite")
    code, out, err = run_cli(capsys, "verify", str(path))
    assert (code, err) == (exit_codes.OK, "")
    assert out.endswith("verified: no inconsistency\n")


def test_verify_of_a_clean_ledger_reports_each_check(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    _, out, _ = run_cli(capsys, "verify", str(path))
    assert out == (
        f"ledger {path} (schema {SCHEMA_HEAD})\n"
        "integrity_check: ok\n"
        "foreign_key_check: ok\n"
        "incarnation 1 version_chain: ok: versions 0..0 without gaps\n"
        "incarnation 1 digests: ok: digests of versions 0..0 recomputed from the rows match\n"
        "incarnation 1 fingerprints: ok: no slot fingerprints recorded\n"
        "incarnation 1 events: ok: 4 events consistent\n"
        "incarnation 1 contents: ok: not restored from this ledger\n"
        "incarnation 2 version_chain: ok: versions 0..3 without gaps\n"
        "incarnation 2 digests: ok: digests of versions 0..3 recomputed from the rows match\n"
        "incarnation 2 fingerprints: ok: no slot fingerprints recorded\n"
        "incarnation 2 events: ok: 13 events consistent\n"
        "incarnation 2 contents: ok: not restored from this ledger\n"
        f"chain: ok: 17 events chained, head {_chain_head(path)}\n"
        "verified: no inconsistency\n"
    )


def _chain_head(path: Path) -> str:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT chain FROM events ORDER BY event_id DESC").fetchone()[0]


def _first_inconsistency(capsys, path: Path) -> str:
    code, out, err = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    prefix = "layout-ledger verify: error: inconsistent: "
    assert err.startswith(prefix) and err.count("\n") == 1
    first = err[len(prefix) : -1]
    assert out.splitlines()[-1].endswith(f"inconsistent; first: {first}")
    return first


def test_a_recorded_digest_that_the_rows_do_not_give_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE versions SET digest = 'f00d' || substr(digest, 5) WHERE version = 2")
    right = layout_digest(map_after(MOVES, 2))
    assert _first_inconsistency(capsys, path) == (
        f"incarnation 2 digests: version 2 records digest f00d{right[4:12]} but its rows give "
        f"{right[:12]}"
    )


def test_a_changed_row_is_found_through_the_digest_of_its_version(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(
        path,
        "UPDATE layout_rows SET slots = '[3,2,1,0,1,0]' "
        "WHERE incarnation_id = 2 AND layer = 2 AND version = 2",
    )
    first = _first_inconsistency(capsys, path)
    assert first.startswith("incarnation 2 digests: version 2 records digest ")


def test_a_row_outside_the_geometry_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE layout_rows SET slots = '[0,1,2,9,0,1]' WHERE version = 1 AND layer = 1")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 digests: the row of incarnation 2 layer 1 version 1 slot 3 holds expert "
        "9, outside [0, 4)"
    )


def test_a_row_of_a_version_the_ledger_does_not_hold_fails_the_foreign_key_check(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(
        path,
        "INSERT INTO layout_rows (incarnation_id, layer, version, slots) "
        "VALUES (2, 1, 9, '[0,1,2,3,0,1]')",
        foreign_keys=False,
    )
    first = _first_inconsistency(capsys, path)
    assert first == (
        "foreign_key_check: 1 rows point at missing parents; first: layout_rows rowid 14 -> "
        "versions"
    )
    _, out, _ = run_cli(capsys, "verify", str(path))
    assert (
        "incarnation 2 digests: INCONSISTENT: incarnation 2 has a row of layer 1 at version 9, "
        "which has no versions row\n"
    ) in out


def test_a_gap_in_the_version_chain_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM versions WHERE incarnation_id = 2 AND version = 2")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 version_chain: version 2 is missing before version 3"
    )


def test_a_commit_without_its_begin_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE event_id = 9")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 events: event #10 (commit by 'engine-a') has no begin before it"
    )


def test_a_commit_of_other_layers_than_its_begin_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "UPDATE events SET layers = '[1]' WHERE event_id = 9")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 events: event #10 (commit by 'engine-a') of layers [2] from version 1 "
        "does not match the pending begin by 'engine-a' of layers [1] from version 1"
    )


def test_a_dirty_mark_without_a_detach_during_the_move_is_named(tmp_path, capsys):
    path = build("dirty", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE kind = 'detach'")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 1 events: event #7 (dirty by 'engine-a') does not follow a detach of that "
        "engine during its pending move"
    )


def test_a_detach_during_a_pending_move_without_a_dirty_mark_is_named(tmp_path, capsys):
    path = build("dirty", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE kind = 'dirty'")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 1 events: event #8 (fetch_refused by 'engine-b') follows engine "
        "'engine-a''s detach during its pending move, where a dirty mark must be"
    )


def test_a_begin_accepted_while_another_engine_was_attached_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE event_id = 13")  # engine-b's detach
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 events: event #14 (begin by 'engine-a') was accepted while "
        "['engine-b'] were attached too"
    )


def test_a_version_without_a_commit_is_named(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE event_id IN (16, 17)")
    assert _first_inconsistency(capsys, path) == (
        "incarnation 2 events: the commits reach version 2 but the ledger holds versions up to 3"
    )


def test_a_damaged_index_fails_sqlites_integrity_check(tmp_path, capsys):
    built = build("clean", tmp_path / "built.sqlite")
    path = tmp_path / "l.sqlite"
    source, copy = sqlite3.connect(built), sqlite3.connect(path)
    try:
        source.backup(copy)
        copy.execute("PRAGMA journal_mode=DELETE")
        root = copy.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'ix_events_engine'"
        ).fetchone()[0]
        page_size = copy.execute("PRAGMA page_size").fetchone()[0]
    finally:
        source.close()
        copy.close()
    with open(path, "r+b") as handle:
        handle.seek((root - 1) * page_size)
        page = bytearray(handle.read(page_size))
        at = page.index(b"engine-a")
        page[at + 7] = ord("z")  # one index key now names another engine than its row
        handle.seek((root - 1) * page_size)
        handle.write(page)
    first = _first_inconsistency(capsys, path)
    assert (
        first.startswith("integrity_check: row ") and "missing from index ix_events_engine" in first
    )


def test_verify_json_lists_every_check_and_the_first_inconsistency(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE event_id = 9")
    code, out, _ = run_cli(capsys, "verify", str(path), "--json")
    report = json.loads(out)
    assert code == exit_codes.INCONSISTENT
    assert report["ok"] is False
    assert [(c["check"], c["incarnation_id"], c["ok"]) for c in report["checks"]] == [
        ("integrity_check", None, True),
        ("foreign_key_check", None, True),
        ("version_chain", 1, True),
        ("digests", 1, True),
        ("fingerprints", 1, True),
        ("events", 1, True),
        ("contents", 1, True),
        ("version_chain", 2, True),
        ("digests", 2, True),
        ("fingerprints", 2, True),
        ("events", 2, False),
        ("contents", 2, True),
        ("chain", None, False),
    ]
    assert report["first_inconsistency"] == (
        "incarnation 2 events: event #10 (commit by 'engine-a') has no begin before it"
    )
