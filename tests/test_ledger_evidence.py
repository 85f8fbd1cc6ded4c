"""The ledger keeps its evidence: a chained event log, counted refusals, prunes that verify.

Every ledger here is a real one (the ledger's own writer), edited afterwards with plain
``sqlite3`` the way a bad hand edit or an attacker who can write the file would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import sqlite3
from pathlib import Path

import pytest
from cli_ledgers import build, execute, run_cli
from ledger_support import SMALL, move, open_ledger, random_row, start

from layout_ledger.cli import exit_codes
from layout_ledger.core import errors
from layout_ledger.core.layout import row_json
from layout_ledger.history.reader import LedgerReader


def _chain_head(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT chain FROM events ORDER BY event_id DESC").fetchone()[0]


def _verify(capsys, path: Path) -> tuple[int, str]:
    code, _out, err = run_cli(capsys, "verify", str(path))
    return code, err


# --- tamper evidence -----------------------------------------------------------------------


def _rewrite_a_slot_consistently(path: Path) -> None:
    """Change one slot of version 3 and every digest that depends on it, so that the rows,
    versions and events agree again: only the chain can tell."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (row_id, slots) = conn.execute(
            "SELECT row_id, slots FROM layout_rows WHERE incarnation_id = 2 AND version = 3 "
            "AND layer = 3"
        ).fetchone()
        row = json.loads(slots)
        row[0], row[1] = row[1], row[0]
        conn.execute("UPDATE layout_rows SET slots = ? WHERE row_id = ?", (row_json(row), row_id))
        rows = [
            slots
            for (slots,) in conn.execute(
                "SELECT slots FROM ledger_current_layout WHERE incarnation_id = 2 ORDER BY layer"
            )
        ]
        digest = hashlib.sha256(("[" + ",".join(rows) + "]").encode()).hexdigest()
        conn.execute(
            "UPDATE versions SET digest = ? WHERE incarnation_id = 2 AND version = 3", (digest,)
        )
        conn.execute(
            "UPDATE events SET digest_after = ? WHERE incarnation_id = 2 AND new_version = 3 "
            "AND kind = 'commit'",
            (digest,),
        )
        conn.commit()


def test_a_consistent_rewrite_of_a_slot_and_its_digests_fails_verify_through_the_chain(
    tmp_path, capsys
):
    path = build("clean", tmp_path / "l.sqlite")
    assert _verify(capsys, path)[0] == exit_codes.OK
    _rewrite_a_slot_consistently(path)
    code, err = _verify(capsys, path)
    assert code == exit_codes.INCONSISTENT
    assert "chain: event #17's chain value does not follow from the rows before it" in err


def test_deleting_a_dirty_mark_and_its_detach_fails_verify(tmp_path, capsys):
    path = build("dirty", tmp_path / "l.sqlite")
    execute(path, "DELETE FROM events WHERE kind IN ('detach', 'dirty')")
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.INCONSISTENT
    assert "chain: INCONSISTENT: event #8's chain value does not follow" in out


def test_the_daemon_logs_the_chain_head_with_each_commit(tmp_path, caplog):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record = start(ledger)
    record.attach("A")
    with caplog.at_level(logging.INFO, logger="layout_ledger.store.ledger"):
        move(record, "A", [1], random.Random(1))
        head_after_first = _chain_head(ledger.path)
        move(record, "A", [2], random.Random(2))
    ledger.close()
    logged = [r.getMessage() for r in caplog.records if "event chain head" in r.getMessage()]
    assert len(logged) == 2
    assert logged[0].endswith(
        f"version 1 committed; event chain head {head_after_first} (event #4)"
    )


def test_an_upgraded_older_ledger_gets_its_chain_and_verifies(tmp_path, capsys):
    from sqlalchemy import create_engine

    from layout_ledger.store.migrate import alembic_config

    path = build("clean", tmp_path / "l.sqlite")
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        from alembic import command

        command.downgrade(alembic_config(conn), "0002_forensic_views")
    engine.dispose()
    assert run_cli(capsys, "upgrade", str(path))[0] == exit_codes.OK
    code, out, _ = run_cli(capsys, "verify", str(path))
    assert code == exit_codes.OK, out
    assert f"chain: ok: 17 events chained, head {_chain_head(path)}\n" in out


# --- refusals cannot fill the disk ---------------------------------------------------------


def _file_and_wal_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_identical_refusals_are_one_row_with_a_count_and_status_counts_every_one(tmp_path, capsys):
    ledger = open_ledger(tmp_path / "l.sqlite")
    record = start(ledger)
    record.attach("A")
    ledger.checkpoint(truncate=True)
    before = _file_and_wal_bytes(ledger.path)
    for _ in range(1000):
        with contextlib.suppress(errors.RequestRefused):
            record.begin("intruder", 0, [1])
    with contextlib.suppress(errors.RequestRefused):
        record.begin("other-intruder", 0, [1])
    with contextlib.suppress(errors.RequestRefused):
        record.begin("intruder", 0, [1])
    ledger.maintenance.wait_idle(30)
    grown = _file_and_wal_bytes(ledger.path) - before
    with contextlib.closing(sqlite3.connect(f"file:{ledger.path}?mode=ro", uri=True)) as conn:
        refusals = conn.execute(
            "SELECT engine_id, count, at < last_at FROM ledger_events "
            "WHERE kind = 'begin_refused' ORDER BY event_id"
        ).fetchall()
    assert refusals == [("intruder", 1000, 1), ("other-intruder", 1, None), ("intruder", 1, None)]
    # Each refusal is a durable transaction (a WAL frame or two); checkpoints on the WAL's size
    # keep the file from taking them all (~8 MiB without).
    assert grown < 4 * 1024 * 1024, grown
    _code, out, _ = run_cli(capsys, "status", str(ledger.path), "--json")
    assert json.loads(out)["ledgers"][0]["refusals"] == 1002
    _, out, _ = run_cli(capsys, "history", str(ledger.path), "--kind", "begin_refused")
    assert " x1000 until " in out.splitlines()[0]
    assert run_cli(capsys, "verify", str(ledger.path))[0] == exit_codes.OK
    ledger.close()


# --- prune never destroys evidence ---------------------------------------------------------


def test_prune_refuses_a_ledger_that_fails_verification_and_deletes_nothing(tmp_path, capsys):
    path = build("clean", tmp_path / "l.sqlite")
    execute(
        path,
        "UPDATE layout_rows SET slots = '[3,2,1,0,1,0]' "
        "WHERE incarnation_id = 2 AND layer = 2 AND version = 2",
    )
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows_before = conn.execute("SELECT count(*) FROM layout_rows").fetchone()[0]
    code, out, err = run_cli(capsys, "prune", str(path), "--keep", "1")
    assert (code, out) == (exit_codes.INCONSISTENT, "")
    assert err.startswith(
        "layout-ledger prune: error: prune refused, the ledger fails verification (first: "
        "incarnation 2 digests: version 2 records digest "
    )
    assert "nothing was removed" in err
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM layout_rows").fetchone()[0] == rows_before
    assert _verify(capsys, path)[0] == exit_codes.INCONSISTENT


def test_the_daemons_retention_skips_rows_that_are_not_what_it_recorded(tmp_path, caplog):
    ledger = open_ledger(tmp_path / "l.sqlite", keep_versions=2, prune_every=1000)
    record = start(ledger)
    record.attach("A")
    rng = random.Random(3)
    for _ in range(5):
        move(record, "A", [0], rng)
    forged = row_json(random_row(random.Random(99), SMALL))
    execute(
        ledger.path,
        f"UPDATE layout_rows SET slots = '{forged}' "
        "WHERE incarnation_id = 1 AND layer = 0 AND version = 2",
    )
    with caplog.at_level(logging.ERROR, logger="layout_ledger.store.ledger"):
        ledger._prune_live_incarnation()
    assert "retention skipped, the rows it would delete are not what the ledger recorded" in (
        caplog.text
    )
    with LedgerReader(ledger.path) as reader, reader.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM layout_rows").scalar() == 8 + 5
    ledger.close()


@pytest.mark.parametrize("where", ["clean", "dirty"])
def test_prune_still_works_on_a_ledger_that_verifies(tmp_path, capsys, where):
    path = build(where, tmp_path / "l.sqlite")
    code, _, err = run_cli(capsys, "prune", str(path), "--keep", "1")
    assert (code, err) == (exit_codes.OK, "")
