"""The ledger file: WAL, durability settings, 0600, refusals, one writer, many readers."""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time

import pytest
from ledger_support import SMALL, move, open_ledger, start

from layout_ledger.core.errors import LedgerFileError, LedgerLocked
from layout_ledger.history.reader import LedgerReader

HOLD_WRITER = """
import sys, time
from layout_ledger.store.ledger import Ledger
ledger = Ledger.open(sys.argv[1])
print("open", flush=True)
time.sleep(600)
"""


def test_new_ledger_is_wal_full_sync_foreign_keys_and_mode_0600(tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = open_ledger(path)
    try:
        pragmas = {
            name: ledger._conn.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        }
        ledger._conn.rollback()
        assert pragmas == {
            "journal_mode": "wal",
            "synchronous": 2,
            "foreign_keys": 1,
            "busy_timeout": 5000,
        }
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(f"{path}.lock").st_mode) == 0o600
    finally:
        ledger.close()


def test_new_ledger_is_0600_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        ledger = open_ledger(tmp_path / "l.sqlite")
        ledger.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "l.sqlite").st_mode) == 0o600


def test_writers_take_the_write_lock_when_the_transaction_begins(tmp_path):
    """BEGIN IMMEDIATE: a second connection cannot write once the writer's transaction began."""
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    try:
        with ledger.transaction("testing") as conn:
            conn.exec_driver_sql("SELECT 1")
            other = sqlite3.connect(path, timeout=0)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            other.close()
    finally:
        ledger.close()


def test_a_symlinked_ledger_path_is_refused(tmp_path):
    real = tmp_path / "real.sqlite"
    open_ledger(real).close()
    link = tmp_path / "link.sqlite"
    link.symlink_to(real)
    with pytest.raises(LedgerFileError, match="is a symlink; refusing to follow it"):
        open_ledger(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file owned by another user")
def test_a_ledger_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "l.sqlite"
    open_ledger(path).close()
    os.chown(path, 12345, 12345)
    with pytest.raises(LedgerFileError, match="owned by uid 12345 but this process runs as uid 0"):
        open_ledger(path)


def test_a_file_that_is_not_sqlite_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"this is not a database\n" * 100)
    before = path.read_bytes()
    with pytest.raises(
        LedgerFileError, match=r"not a usable SQLite database|not an SQLite database"
    ):
        open_ledger(path)
    assert path.read_bytes() == before


def test_a_missing_directory_gives_a_clear_error(tmp_path):
    with pytest.raises(LedgerFileError, match="does not exist"):
        open_ledger(tmp_path / "nope" / "l.sqlite")


def _hold_writer(path):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_a_second_writer_process_fails_at_once_naming_the_file(tmp_path):
    path = tmp_path / "l.sqlite"
    holder = _hold_writer(path)
    try:
        started = time.monotonic()
        with pytest.raises(LedgerLocked) as info:
            open_ledger(path)
        assert time.monotonic() - started < 1.0
        assert str(info.value).startswith(f"ledger {path} is owned by another daemon")
        assert f"pid={holder.pid}" in str(info.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_writer_lock_is_released_by_the_kernel_when_the_owner_is_sigkilled(tmp_path):
    path = tmp_path / "l.sqlite"
    holder = _hold_writer(path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    ledger = open_ledger(path)
    ledger.close()


def test_readers_read_while_the_writer_holds_a_write_transaction(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger = open_ledger(path)
    try:
        record = start(ledger)
        record.attach("A")
        import random

        move(record, "A", [0, 1], random.Random(1))
        with ledger.transaction("testing") as conn:
            conn.exec_driver_sql("SELECT 1")
            readers = [LedgerReader(path) for _ in range(3)]
            states = [reader.state() for reader in readers]
            shell = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            version = shell.execute(
                "SELECT current_version FROM ledger_incarnations ORDER BY incarnation_id DESC"
            ).fetchone()[0]
            shell.close()
            for reader in readers:
                reader.close()
        assert [state.version for state in states] == [1, 1, 1]
        assert version == 1
    finally:
        ledger.close()


def test_a_read_only_opener_never_creates_or_changes_the_file(tmp_path):
    path = tmp_path / "l.sqlite"
    with pytest.raises(LedgerFileError, match="does not exist"):
        LedgerReader(path)
    assert not path.exists()
    ledger = open_ledger(path)
    start(ledger, SMALL)
    ledger.close()
    before = path.read_bytes()
    with LedgerReader(path) as reader:
        assert reader.state().version == 0
    assert path.read_bytes() == before


def test_another_applications_sqlite_file_is_refused_without_being_changed(tmp_path):
    path = tmp_path / "app.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('keep me')")
    before = path.read_bytes()
    with pytest.raises(
        LedgerFileError, match=r"holds tables \(notes\) but is not an expert layout"
    ):
        open_ledger(path)
    assert path.read_bytes() == before
    assert not (tmp_path / "app.sqlite.lock").exists()
    assert not (tmp_path / "app.sqlite-wal").exists()


def test_a_commit_is_fsynced_before_it_returns_and_other_events_are_written_unsynced(tmp_path):
    """``synchronous=FULL`` (the WAL fsynced at COMMIT) for every transaction that records a
    version; ``NORMAL`` (written, fsynced with the next version or checkpoint) for the rest."""
    import random

    ledger = open_ledger(tmp_path / "l.sqlite")
    record = start(ledger)
    statements: list[str] = []
    ledger._writer.driver().set_trace_callback(statements.append)
    record.attach("A")
    record.begin("A", 0, [1])
    attach_and_begin = list(statements)
    statements.clear()
    record.commit("A", {1: [rng % 8 for rng in range(12)]})
    commit = list(statements)
    ledger._writer.driver().set_trace_callback(None)
    assert attach_and_begin.count("PRAGMA synchronous=NORMAL") == 2
    assert attach_and_begin[-1] == "PRAGMA synchronous=FULL"
    assert not any("synchronous" in statement for statement in commit)
    assert ledger._writer.driver().execute("PRAGMA synchronous").fetchone()[0] == 2
    move(record, "A", [2], random.Random(1))
    ledger.close()
