"""Retention: prune keeps the current map, every event and the last N versions; WAL bounded."""

from __future__ import annotations

import logging
import random
import sqlite3

import pytest
from ledger_support import move, open_ledger, start, table_dump

from layout_ledger.core.errors import LedgerError
from layout_ledger.core.layout import layout_digest
from layout_ledger.history.reader import LedgerReader
from layout_ledger.store import maintenance
from layout_ledger.store.rows import map_at


def _kept_versions_verify(path, incarnation_id):
    """Every version the rows still hold rebuilds to the digest recorded when it was committed."""
    with LedgerReader(path) as reader, reader.connect() as conn:
        from layout_ledger.store import rows as r

        inc = r.incarnation(conn, incarnation_id)
        floor = r.reconstructible_from(conn, incarnation_id)
        current, _ = r.current_version(conn, incarnation_id)
        recorded = dict(
            conn.exec_driver_sql(
                "SELECT version, digest FROM versions WHERE incarnation_id = ?", (incarnation_id,)
            ).all()
        )
        for version in range(floor, current + 1):
            assert layout_digest(map_at(conn, inc, version)) == recorded[version], version
        return floor, current


def _attached(path, **retention):
    """A ledger with this retention (the default without any), its record, engine A attached."""
    ledger = open_ledger(path, **retention)
    record = start(ledger)
    record.attach("A")
    return ledger, record


def _attached_without_retention(path, monkeypatch, **limits):
    """A ledger that never prunes, engine A attached, the maintenance's limits set for the test."""
    for name, value in limits.items():
        monkeypatch.setattr(maintenance, name, value)
    return _attached(path, keep_versions=10_000, prune_every=10_000)


def test_prune_keeps_the_current_map_every_event_and_the_last_n_versions(tmp_path, monkeypatch):
    path = tmp_path / "l.sqlite"
    ledger, record = _attached_without_retention(path, monkeypatch)
    rng = random.Random(5)
    for _ in range(40):
        move(record, "A", rng.sample(range(8), 3), rng)
    before_state = LedgerReader(path).state()
    before = table_dump(path)
    (report,) = ledger.prune(keep_versions=10)
    after = table_dump(path)
    assert report.keep_from_version == 31
    assert report.rows_removed == len(before["layout_rows"]) - len(after["layout_rows"]) > 0
    assert after["events"][: len(before["events"])] == before["events"]
    assert after["events"][-1][3] == "prune"
    assert after["versions"] == before["versions"]
    assert LedgerReader(path).state() == before_state
    assert _kept_versions_verify(path, record.incarnation_id) == (31, 40)
    with LedgerReader(path) as reader, reader.connect() as conn:
        from layout_ledger.store import rows as r

        with pytest.raises(
            LedgerError, match="version 30 is not among them \\(older versions were pruned\\)"
        ):
            map_at(conn, r.incarnation(conn, 1), 30)
    ledger.close()


def test_prune_refuses_while_a_move_is_pending_and_changes_nothing(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger, record = _attached(path)
    rng = random.Random(1)
    for _ in range(5):
        move(record, "A", [0], rng)
    record.begin("A", record.version, [1])
    before = table_dump(path)
    with pytest.raises(
        LedgerError, match=r"has a move pending \(engine 'A', layers \[1\]\); prune after"
    ):
        ledger.prune(keep_versions=1)
    assert table_dump(path) == before
    ledger.close()


def test_the_daemon_prunes_by_itself_so_a_long_run_stays_bounded(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger, record = _attached(path, keep_versions=5, prune_every=10)
    rng = random.Random(2)
    for _ in range(200):
        move(record, "A", list(range(8)), rng)
    assert ledger.maintenance.wait_idle(timeout=30)
    rows = table_dump(path)["layout_rows"]
    # At most keep_versions + prune_every versions of all 8 layers are ever held.
    assert len(rows) <= (5 + 10) * 8
    floor, current = _kept_versions_verify(path, record.incarnation_id)
    # The thread prunes behind the commits, so the floor trails by up to prune_every versions.
    assert current == 200 and 200 - (5 + 10) < floor <= 196
    ledger.close()


def test_the_daemons_retention_prunes_in_short_steps_whatever_prune_every(tmp_path, monkeypatch):
    """Each retention transaction (one prune event) drops at most PRUNE_STEP_VERSIONS versions,
    so a large --expert-layout-prune-every never holds the writer's lock for long."""
    from layout_ledger.store import ledger as ledger_module

    monkeypatch.setattr(ledger_module, "PRUNE_STEP_VERSIONS", 4)
    path = tmp_path / "l.sqlite"
    ledger, record = _attached(path, keep_versions=3, prune_every=30)
    rng = random.Random(7)
    for _ in range(30):
        move(record, "A", [0, 1], rng)
    assert ledger.maintenance.wait_idle(timeout=30)
    floor, current = _kept_versions_verify(path, record.incarnation_id)
    assert (floor, current) == (28, 30)
    with sqlite3.connect(path) as conn:
        bases = [b for (b,) in conn.execute("SELECT base_version FROM events WHERE kind = 'prune'")]
    assert bases == [4, 8, 12, 16, 20, 24, 28]
    ledger.close()


def test_a_restarted_daemon_prunes_earlier_incarnations_too(tmp_path):
    path = tmp_path / "l.sqlite"
    ledger, record = _attached(path, keep_versions=3, prune_every=1000)
    rng = random.Random(3)
    for _ in range(20):
        move(record, "A", [2], rng)
    ledger.close()
    ledger = open_ledger(path, keep_versions=3, prune_every=1000)
    start(ledger)
    assert _kept_versions_verify(path, 1) == (18, 20)
    ledger.close()


def test_a_long_lived_reader_cannot_starve_the_wal_unnoticed(tmp_path, monkeypatch, caplog):
    path = tmp_path / "l.sqlite"
    ledger, record = _attached_without_retention(
        path, monkeypatch, WAL_WARN_BYTES=64 * 1024, PIN_REPORT_SECONDS=0.0
    )
    rng = random.Random(4)
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM events").fetchone()  # holds a snapshot
    for _ in range(30):
        move(record, "A", list(range(8)), rng)
    with caplog.at_level(logging.WARNING, logger="layout_ledger.store.maintenance"):
        result = ledger.checkpoint(truncate=True)
    assert result.busy or result.checkpointed_frames < result.wal_frames
    assert "a reader has held one snapshot open for a long time" in caplog.text
    reader.rollback()
    reader.close()
    result = ledger.checkpoint(truncate=True)
    assert not result.busy and result.wal_bytes == 0
    ledger.close()


def test_a_reader_holding_a_snapshot_never_makes_the_writer_wait_for_a_checkpoint(
    tmp_path, monkeypatch, caplog
):
    """A TRUNCATE checkpoint gives up at once while a reader pins the WAL (SQLite's busy
    timeout is 0 for it) instead of waiting out the 5 s busy timeout with the writer's lock
    held, and the daemon's maintenance does not even try while the pin lasts; the pin is
    reported once, and again when it is released."""
    import time

    path = tmp_path / "l.sqlite"
    ledger, record = _attached_without_retention(
        path, monkeypatch, WAL_WARN_BYTES=16 * 1024, WAL_RESTART_BYTES=0, PIN_REPORT_SECONDS=0.0
    )
    rng = random.Random(5)
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM events").fetchone()  # holds a snapshot
    took = []
    with caplog.at_level(logging.INFO, logger="layout_ledger.store.maintenance"):
        for _ in range(40):
            move(record, "A", list(range(8)), rng)
            ledger.maintenance.wait_idle(30)
            started = time.monotonic()
            result = ledger.checkpoint(truncate=True)
            took.append(time.monotonic() - started)
            assert result.busy
        reader.rollback()
        reader.close()
        move(record, "A", [0], rng)
        ledger.maintenance.wait_idle(30)
        # The release is reported at the first complete checkpoint after it, and a PASSIVE
        # checkpoint beside a commit in flight is not complete: append until an append wakes
        # the maintenance thread, then write nothing until it is idle.
        for _ in range(2 * maintenance.CHECKPOINT_EVERY):
            record.record_refusal("begin", "B", "wake the maintenance thread")
            if not ledger.maintenance.wait_idle(0):
                break
        ledger.maintenance.wait_idle(30)
    assert max(took) < 1.0, took  # the busy timeout is 5 s
    pinned = [r.getMessage() for r in caplog.records if "held one snapshot" in r.getMessage()]
    assert 1 <= len(pinned) <= 3  # once, then only when the WAL has doubled
    assert any("let go" in r.getMessage() for r in caplog.records)
    ledger.close()


def test_busy_writers_and_short_readers_are_never_reported_as_a_pinned_wal(
    tmp_path, monkeypatch, caplog
):
    """Short reads (status, a metrics scrape) racing a stream of commits make many checkpoints
    find a reader in the WAL; others succeed between them, so no reader holds it and nothing is
    reported, while the WAL stays bounded."""
    import threading
    import time

    path = tmp_path / "l.sqlite"
    ledger, record = _attached_without_retention(
        path,
        monkeypatch,
        WAL_WARN_BYTES=96 * 1024,
        WAL_RESTART_BYTES=32 * 1024,
        CHECKPOINT_EVERY=2,
        PIN_REPORT_SECONDS=2.0,
    )
    rng = random.Random(6)
    stop = threading.Event()

    def short_reads():
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        while not stop.is_set():
            conn.execute("SELECT count(*) FROM versions").fetchone()
        conn.close()

    readers = [threading.Thread(target=short_reads) for _ in range(2)]
    for thread in readers:
        thread.start()
    with caplog.at_level(logging.WARNING, logger="layout_ledger.store.maintenance"):
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            move(record, "A", list(range(8)), rng)
        stop.set()
        for thread in readers:
            thread.join()
        ledger.maintenance.wait_idle(30)
    assert "held one snapshot" not in caplog.text
    ledger.close()
