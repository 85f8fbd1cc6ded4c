"""Keeping a daemon's ledger bounded off the request path: WAL checkpoints and retention.

A commit's durability is its own fsync of the WAL; copying the WAL back into the database (a
checkpoint) and pruning old rows are bookkeeping that must never delay a request. One background
thread per ledger (``Maintenance``) does both, woken after appends (retention only for a
ledger opened with one), and ``WalPin`` reports a reader that keeps the WAL from being reset.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from layout_ledger.core.errors import LedgerError, LedgerStorageError
from layout_ledger.store import files

logger = logging.getLogger(__name__)

# A WAL past this size that no checkpoint could reset for PIN_REPORT_SECONDS means a reader
# holds an old snapshot.
WAL_WARN_BYTES = 32 * 1024 * 1024
PIN_REPORT_SECONDS = 30.0
# Past this size a PASSIVE checkpoint is followed by a RESTART one: under a steady stream of
# appends a PASSIVE checkpoint rarely finishes between two of them, so the writer never
# restarts the WAL (it must find every frame copied when it begins) and the file would only
# grow. The RESTART pass copies what the PASSIVE one left (a few appends) and makes the next
# append start the WAL again. (RESTART, not TRUNCATE: truncating the file and growing it again
# slows the next commits down in the filesystem.)
WAL_RESTART_BYTES = 2 * 1024 * 1024
# Wake the thread for a checkpoint every this many appends (an all-layer commit of a
# DeepSeek-V3-sized map is ~25 WAL pages, so this keeps the WAL near SQLite's own 1000 pages),
# and every WAKE_EVERY_WHEN_LARGE appends while the WAL is over WAL_WAKE_BYTES (a flood of
# refusals appends small transactions that a count alone would let pile up).
CHECKPOINT_EVERY = 32
WAL_WAKE_BYTES = 4 * 1024 * 1024
WAKE_EVERY_WHEN_LARGE = 8
IDLE_WAKE_SECONDS = 60.0


@dataclass(frozen=True)
class CheckpointResult:
    busy: bool
    wal_frames: int
    checkpointed_frames: int
    wal_bytes: int

    @property
    def complete(self) -> bool:
        return not self.busy and self.checkpointed_frames >= self.wal_frames


def wal_bytes(path: Path) -> int:
    """The size of the ledger's ``-wal`` file now (0 when there is none)."""
    wal = files.companion(path, "-wal")
    return wal.stat().st_size if wal.exists() else 0


@contextlib.contextmanager
def _no_waiting(conn: sqlite3.Connection) -> Iterator[None]:
    """SQLite's busy timeout at 0 for the block (a blocked checkpoint gives up at once)."""
    (saved,) = conn.execute("PRAGMA busy_timeout").fetchone()
    conn.execute("PRAGMA busy_timeout=0")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(saved)}")


def checkpoint(conn: sqlite3.Connection, path: Path, mode: str = "PASSIVE") -> CheckpointResult:
    """Run a checkpoint on ``conn`` (outside any transaction); it never waits for anyone.

    ``mode``: PASSIVE, RESTART (the writer starts the WAL from its beginning, reusing the file's
    blocks) or TRUNCATE (the file emptied as well).
    """
    try:
        with _no_waiting(conn):
            # fetchall: a statement left unfinished would hold a read lock on the WAL and keep
            # the next writer from restarting it, so the file would grow however often we
            # checkpoint.
            (row,) = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
    except sqlite3.Error as exc:
        raise LedgerStorageError(f"checkpointing ledger {path} failed: {exc}") from exc
    return CheckpointResult(bool(row[0]), int(row[1]), int(row[2]), wal_bytes(path))


class WalPin:
    """Reports a reader that keeps the WAL from being reset, and how far it grew meanwhile.

    A checkpoint that finds a reader in the WAL is not a pin by itself: short reads (``status``,
    a metrics scrape) make many fail while others succeed between them. A pin is a WAL of at
    least ``WAL_WARN_BYTES`` that no checkpoint has managed to reset for ``PIN_REPORT_SECONDS``:
    reported once, again each time the WAL doubles, and once when the reader lets go.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last_reset = time.monotonic()
        self._reported = 0

    def observe(self, result: CheckpointResult) -> None:
        now = time.monotonic()
        if result.complete:
            if self._reported:
                logger.info(
                    "expert layout ledger %s: the reader that held the WAL let go after %.0f s; "
                    "the WAL is reset",
                    self.path,
                    now - self.last_reset,
                )
            self.last_reset, self._reported = now, 0
            return
        held = now - self.last_reset
        if result.wal_bytes < WAL_WARN_BYTES or held < PIN_REPORT_SECONDS:
            return
        if result.wal_bytes >= 2 * self._reported:
            self._reported = result.wal_bytes
            logger.warning(
                "expert layout ledger %s: a reader has held one snapshot open for a long time "
                "(%.0f s), so the WAL cannot be reset; it is %d MiB and grows with every commit "
                "(close long-running sqlite3 sessions on this file; commits are not slowed)",
                self.path,
                held,
                result.wal_bytes // (1024 * 1024),
            )


class Maintenance:
    """The background thread of one ledger; ``note_append`` after each journal append.

    Woken every ``CHECKPOINT_EVERY`` appends (sooner while the WAL is large, and when a prune is
    due), it prunes once ``prune_every`` commits have passed; runs a PASSIVE checkpoint on its
    own connection, which never waits for anyone; and past ``WAL_RESTART_BYTES``, when that one
    completed, a RESTART checkpoint under the writer's own (Python) lock, so that no commit is
    mid-flight, with SQLite's busy timeout at 0 (a reader holding an old snapshot makes it give
    up at once). The writer connection's automatic checkpoint is off, so no commit pays for one.
    """

    def __init__(
        self,
        path: Path,
        prune: Callable[[], None],
        prune_every: int | None,
        writer_lock: AbstractContextManager[object],
    ) -> None:
        self.path = path
        self._writer_lock = writer_lock
        self._prune = prune
        self._prune_every = prune_every
        self._appends = 0
        self._appends_at_wake = 0
        self._commits = 0
        self._commits_at_prune = 0
        self.pin = WalPin(path)
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(
            target=self._run, name="layout-ledger-maintenance", daemon=True
        )
        self._thread.start()

    def note_append(self, *, commit: bool = False) -> None:
        self._appends += 1
        self._commits += commit
        since = self._appends - self._appends_at_wake
        large = since >= WAKE_EVERY_WHEN_LARGE and wal_bytes(self.path) > WAL_WAKE_BYTES
        if since >= CHECKPOINT_EVERY or large or self._prune_due():
            self._appends_at_wake = self._appends
            self._idle.clear()
            self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        """True once the thread has handled every wake-up so far (for tests and shutdown)."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def stopping(self) -> bool:
        """True once ``stop`` was called: long work (retention's steps) ends early."""
        return self._stopping

    def _prune_due(self) -> bool:
        """True every ``prune_every`` commits (never without a retention)."""
        if self._prune_every is None:
            return False
        return self._commits - self._commits_at_prune >= self._prune_every

    def _run(self) -> None:
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            while not self._stopping:
                self._wake.wait(IDLE_WAKE_SECONDS)
                self._wake.clear()
                if self._stopping:
                    break
                self._once(conn)
                if not self._wake.is_set():
                    self._idle.set()
        finally:
            conn.close()
            self._idle.set()

    def _once(self, conn: sqlite3.Connection) -> None:
        try:
            if self._prune_due():
                self._commits_at_prune = self._commits
                self._prune()
            result = checkpoint(conn, self.path)
            if result.wal_bytes > WAL_RESTART_BYTES and result.complete:
                # Under the writer's own lock: no commit is mid-flight, and the PASSIVE pass
                # just above (complete: no reader holds an older snapshot) left only the frames
                # of commits made since to copy. While a reader pins the WAL the writer's lock
                # is never taken: with a WAL of gigabytes, even a RESTART that gives up at once
                # holds commits back.
                with self._writer_lock:
                    result = checkpoint(conn, self.path, "RESTART")
            self.pin.observe(result)
        except LedgerError as exc:
            # Commits are durable already; retention only bounds the file. Never fail a request.
            logger.warning("expert layout ledger %s: maintenance failed: %s", self.path, exc)
