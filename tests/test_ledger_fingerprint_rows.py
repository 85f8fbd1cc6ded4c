"""Slot fingerprint rows are evidence: ``verify`` checks them, the event chain covers them,
damaged ones are exit 5, and ``show --fingerprints`` never shows another version's rows.

Each test writes a real ledger through the record (a start and one commit that moves layer 1 at
EP rank 1 of 2), closes it, damages it with sqlite3 the way a person or a bad disk would, and
runs the ``layout-ledger`` commands on it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from cli_ledgers import run_cli
from content_support import Slots, expert_fingerprint
from ledger_support import SMALL, open_ledger

from layout_ledger.cli import exit_codes
from layout_ledger.core.layout import trivial_map
from layout_ledger.store import chain


def _ledger(directory: Path) -> Path:
    initial = trivial_map(SMALL.num_layers, SMALL.num_physical_slots, SMALL.num_logical_experts)
    slots = Slots(initial, 6, 6)
    ledger = open_ledger(directory / "l.sqlite")
    record = ledger.start_incarnation(
        SMALL, initial, config_fingerprint="t", daemon_label="d", content=slots.fingerprints()
    )
    record.attach("A")
    record.begin("A", 0, [1])
    row = list(initial[1])
    row[6], row[7] = row[7], row[6]
    slots.fill(1, row)
    record.commit("A", {1: row}, slots.fingerprints)
    ledger.close()
    return Path(ledger.path)


def _execute(path: Path, sql: str, *params: object) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(sql, params)
        conn.commit()


def _verify(capsys, path: Path) -> tuple[int, str]:
    code, _, err = run_cli(capsys, "verify", str(path))
    return code, err


def test_a_clean_ledgers_fingerprint_rows_verify_and_their_digests_are_chained(tmp_path, capsys):
    path = _ledger(tmp_path)
    code, out, err = run_cli(capsys, "verify", str(path))
    assert (code, err) == (exit_codes.OK, "")
    assert "incarnation 1 fingerprints: ok: 9 slot fingerprint rows well formed; 2 version " in out
    with contextlib.closing(sqlite3.connect(path)) as conn:
        digests = conn.execute(
            "SELECT fingerprints_digest FROM versions ORDER BY version"
        ).fetchall()
    assert all(digest is not None for (digest,) in digests)


_DAMAGE = {
    "an edited fingerprint": (
        "UPDATE slot_fingerprints SET fingerprints = replace(fingerprints, substr(fingerprints, "
        "3, 1), CASE substr(fingerprints, 3, 1) WHEN 'a' THEN 'b' ELSE 'a' END) "
        "WHERE layer = 1 AND version = 1",
        "version 1's slot fingerprint rows do not give the fingerprints digest",
    ),
    "a row that is not JSON": (
        "UPDATE slot_fingerprints SET fingerprints = '[not json' WHERE layer = 2 AND version = 0",
        "(layer 2, version 0) is not a JSON list of 64-hex-digit fingerprints",
    ),
    "version 1's rows deleted": (
        "DELETE FROM slot_fingerprints WHERE version = 1",
        "version 1 wrote layer 1's row but its slot fingerprints are not held beside it",
    ),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_verify_finds_damaged_fingerprint_rows_exit_5(tmp_path, capsys, damage):
    path = _ledger(tmp_path)
    sql, named = _DAMAGE[damage]
    _execute(path, sql)
    code, err = _verify(capsys, path)
    assert code == exit_codes.INCONSISTENT
    assert "incarnation 1 fingerprints: " in err and named in err, err


def test_an_edit_with_its_digest_recomputed_still_breaks_the_event_chain(tmp_path, capsys):
    path = _ledger(tmp_path)
    forged = [expert_fingerprint(1, 0)] * 6
    text = "[" + ",".join(f'"{value}"' for value in forged) + "]"
    _execute(path, "UPDATE slot_fingerprints SET fingerprints = ? WHERE version = 1", text)
    digest = chain.fingerprints_digest([(1, 6, text)])
    _execute(path, "UPDATE versions SET fingerprints_digest = ? WHERE version = 1", digest)
    code, err = _verify(capsys, path)
    assert code == exit_codes.INCONSISTENT
    assert "chain: event #4's chain value does not follow" in err, err


def test_show_fingerprints_never_shows_another_versions_rows_for_deleted_or_damaged_ones(
    tmp_path, capsys
):
    path = _ledger(tmp_path)
    _execute(path, "DELETE FROM slot_fingerprints WHERE version = 1")
    code, out, err = run_cli(capsys, "show", str(path), "--layers", "1", "--fingerprints")
    assert code == exit_codes.INCONSISTENT and out == ""
    assert "version 1 wrote layer 1's row but no slot fingerprints beside it" in err
    code, out, _ = run_cli(  # layer 2 was not moved: version 0's rows are its rows at version 1
        capsys, "show", str(path), "--version", "0", "--layers", "2", "--fingerprints"
    )
    assert code == exit_codes.OK and expert_fingerprint(2, 6)[:12] in out
    _execute(path, "UPDATE slot_fingerprints SET fingerprints = '[not json' WHERE layer = 2")
    code, _, err = run_cli(capsys, "show", str(path), "--version", "0", "--fingerprints")
    assert code == exit_codes.INCONSISTENT and "is not a JSON list of fingerprints" in err


def test_a_ledger_written_before_fingerprint_digests_verifies_as_before(tmp_path, capsys):
    """Rows of older code: no digest, chain links without it (recomputed so here)."""
    path = _ledger(tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE versions SET fingerprints_digest = NULL")
        previous = chain.GENESIS
        rows = conn.execute(
            f"SELECT event_id, {', '.join(chain.FIELDS)} FROM events ORDER BY event_id"
        ).fetchall()
        for event_id, *fields in rows:
            previous = chain.link(previous, fields)
            conn.execute("UPDATE events SET chain = ? WHERE event_id = ?", (previous, event_id))
        conn.commit()
    code, err = _verify(capsys, path)
    assert (code, err) == (exit_codes.OK, "")
    _execute(path, "DELETE FROM slot_fingerprints WHERE version = 1")  # still found without one
    code, err = _verify(capsys, path)
    assert code == exit_codes.INCONSISTENT and "version 1 wrote layer 1's row" in err
