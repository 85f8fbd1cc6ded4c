"""Keeping a daemon's ledger bounded off the request path: WAL checkpoints and retention.

A commit's durability is its own fsync of the WAL; copying the WAL back into the database
(a checkpoint) and pruning old rows are bookkeeping that must not add to a commit's latency.
One background thread per ledger does both, woken after commits:

- a PASSIVE checkpoint on the thread's own connection, which runs alongside the writer;
- every ``Retention.prune_every`` commits, ``Ledger.prune`` to the last
  ``Retention.keep_versions`` versions (a short write transaction of its own).

The writer connection's automatic checkpoint is switched off while the thread runs, so no
commit ever pays for one. A checkpoint that cannot reset a large WAL logs a warning that a
reader holds an old snapshot.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from layout_ledger.errors import LedgerError, LedgerStorageError
from layout_ledger.storage import BUSY_TIMEOUT_MS

logger = logging.getLogger(__name__)

# A checkpoint that cannot reset the WAL past this size means a reader holds an old snapshot.
WAL_WARN_BYTES = 32 * 1024 * 1024
# Past this size, a PASSIVE checkpoint is followed by a TRUNCATE one, which briefly waits for
# the writer: under a steady stream of commits the writer is always mid-transaction when a
# PASSIVE checkpoint finishes, so it never restarts the log and the file would only grow.
WAL_TRUNCATE_BYTES = 16 * 1024 * 1024
# Wake the thread for a checkpoint every this many commits (an all-layer commit of a
# DeepSeek-V3-sized map is ~25 WAL pages, so this keeps the WAL near SQLite's own 1000 pages).
CHECKPOINT_EVERY = 32
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


def wal_path(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def wal_bytes(path: Path) -> int:
    wal = wal_path(path)
    return wal.stat().st_size if wal.exists() else 0


def checkpoint(conn: sqlite3.Connection, path: Path, *, truncate: bool = False) -> CheckpointResult:
    """Run a checkpoint on ``conn`` (outside any transaction) and warn if a reader starves it."""
    mode = "TRUNCATE" if truncate else "PASSIVE"
    try:
        # fetchall: a statement left unfinished would hold a read lock on the WAL and keep the
        # next writer from restarting it, so the file would grow however often we checkpoint.
        (row,) = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
    except sqlite3.Error as exc:
        raise LedgerStorageError(f"checkpointing ledger {path} failed: {exc}") from exc
    size = wal_bytes(path)
    result = CheckpointResult(bool(row[0]), int(row[1]), int(row[2]), size)
    if size > WAL_WARN_BYTES and not result.complete:
        logger.warning(
            "expert layout ledger %s: the WAL is %d MiB and a checkpoint could not reset it; "
            "a reader has held one snapshot open for a long time (close long-running sqlite3 "
            "sessions on this file)",
            path,
            size // (1024 * 1024),
        )
    return result


class Maintenance:
    """The background thread of one ledger; ``note_commit`` after each commit."""

    def __init__(
        self,
        path: Path,
        prune: Callable[[], None],
        prune_every: int,
        writer_lock: AbstractContextManager[object],
    ) -> None:
        self.path = path
        self._writer_lock = writer_lock
        self._prune = prune
        self._prune_every = prune_every
        self._commits = 0
        self._commits_at_prune = 0
        self._wake = threading.Event()
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(
            target=self._run, name="layout-ledger-maintenance", daemon=True
        )
        self._thread.start()

    def note_commit(self) -> None:
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0 or self._prune_due():
            self._idle.clear()
            self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        """True once the thread has handled every wake-up so far (for tests and shutdown)."""
        return self._idle.wait(timeout)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _prune_due(self) -> bool:
        return self._commits - self._commits_at_prune >= self._prune_every

    def _run(self) -> None:
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
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
            checkpoint(conn, self.path)
            if wal_bytes(self.path) > WAL_TRUNCATE_BYTES:
                # Under the writer's own lock: no commit is mid-flight, so SQLite never makes
                # one sleep in its busy handler, and the PASSIVE pass just above left only a
                # few frames to copy.
                with self._writer_lock:
                    checkpoint(conn, self.path, truncate=True)
        except LedgerError as exc:
            # Commits are durable already; retention only bounds the file. Never fail a request.
            logger.warning("expert layout ledger %s: maintenance failed: %s", self.path, exc)
