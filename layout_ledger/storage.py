"""Opening a ledger file: file checks, the one-writer lock, and SQLite connections.

Writers: WAL journal, ``synchronous=FULL`` (a commit is on disk when it returns), foreign keys,
a busy timeout, and ``BEGIN IMMEDIATE`` so a writer takes the write lock when its transaction
starts instead of failing half-way through it. New files are created mode 0600; a symlink or a
file owned by another user is refused. Exactly one writer process per ledger: it holds an
exclusive ``flock`` on ``<ledger>.lock``, which the kernel releases however the process dies.

Readers open the file read-only (``mode=ro``) and never block the writer; WAL lets any number
of them (engines, the CLI, the ``sqlite3`` shell) read while the daemon writes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import stat
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import StaticPool

from layout_ledger.errors import LedgerFileError, LedgerLocked
from layout_ledger.state import utc_now

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000
FILE_MODE = 0o600
# WAL bytes kept after a checkpoint resets the log; bounds the -wal file on disk.
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024


def lock_path_for(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _check_owned_regular_file(path: Path, what: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise LedgerFileError(
            f"{what} {path} is a symlink; refusing to follow it. Pass the real path of the "
            f"file (or a path where a new ledger may be created)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise LedgerFileError(f"{what} {path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise LedgerFileError(
            f"{what} {path} is owned by uid {info.st_uid} but this process runs as uid "
            f"{os.geteuid()}; run the daemon as the file's owner or give it its own ledger path"
        )


def _create_private(path: Path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except FileExistsError:
        return
    except FileNotFoundError as exc:
        raise LedgerFileError(
            f"cannot create ledger {path}: its directory {path.parent} does not exist"
        ) from exc
    except PermissionError as exc:
        raise LedgerFileError(f"cannot create ledger {path}: {exc.strerror}") from exc
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


class WriterLock:
    """The exclusive, kernel-released claim of one process on one ledger for writing."""

    def __init__(self, ledger_path: Path) -> None:
        self.path = lock_path_for(ledger_path)
        if not ledger_path.parent.is_dir():
            raise LedgerFileError(
                f"cannot open ledger {ledger_path}: its directory {ledger_path.parent} does not "
                f"exist; create it or pass another ledger path"
            )
        _check_owned_regular_file(self.path, "ledger lock file")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd: int | None = os.open(self.path, flags, FILE_MODE)
        except OSError as exc:
            raise LedgerFileError(
                f"cannot open ledger lock file {self.path}: {exc.strerror}"
            ) from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise LedgerLocked(
                f"ledger {ledger_path} is owned by another daemon (it holds {self.path}: "
                f"{holder}); stop that daemon, or give this one its own ledger path"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid={os.getpid()} since={utc_now()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _apply_pragmas(conn: sqlite3.Connection, *, writer: bool) -> None:
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA foreign_keys=ON")
    if writer:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise LedgerFileError(f"could not switch the ledger to WAL mode (got {mode!r})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
    else:
        conn.execute("PRAGMA query_only=ON")


def _engine(path: Path, target: str, *, writer: bool) -> Engine:
    """An engine whose one connection opens ``target`` with the writer's or a reader's settings."""

    def creator() -> sqlite3.Connection:
        conn = sqlite3.connect(
            target,
            uri=not writer,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT_MS / 1000,
        )
        try:
            _apply_pragmas(conn, writer=writer)
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise LedgerFileError(f"{path} is not a usable SQLite database: {exc}") from exc
        return conn

    engine = create_engine("sqlite://", creator=creator, poolclass=StaticPool)
    begin_sql = "BEGIN IMMEDIATE" if writer else "BEGIN"

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql(begin_sql)

    return engine


class Writer:
    """One process's write access to one ledger: the writer lock and the writer connection.

    ``open_writer`` is the only way in, for the daemon (``Ledger``), ``layout-ledger prune`` and
    ``upgrade``, and Alembic's environment: each refuses, read-only and before anything is
    created or locked, a file that is no ledger; then takes the one-writer lock (failing at once
    while a daemon owns the file); then opens the file (created 0600 when missing) in WAL mode.
    """

    def __init__(self, path: Path, *, create: bool) -> None:
        self.path = path
        if not create and not path.exists():
            raise LedgerFileError(f"ledger {path} does not exist")
        _check_owned_regular_file(path, "ledger")
        _check_ledger_or_empty(path)
        self._lock = WriterLock(path)
        try:
            _create_private(path)
            self.engine = _engine(path, str(path), writer=True)
            self.connection: Connection = self.engine.connect()
        except BaseException:
            self._lock.release()
            raise

    def driver(self) -> sqlite3.Connection:
        """The sqlite3 connection under ``connection`` (the same transaction)."""
        driver = self.connection.connection.dbapi_connection
        if driver is None:
            raise LedgerFileError(f"ledger {self.path} is closed")
        return driver  # type: ignore[return-value]

    def close(self) -> None:
        try:
            self.connection.close()
            self.engine.dispose()
        finally:
            self._lock.release()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_writer(path: str | os.PathLike[str], *, create: bool = True) -> Writer:
    """Write access to the ledger at ``path`` (see ``Writer``); ``create=False`` never makes one."""
    return Writer(Path(path), create=create)


def _check_ledger_or_empty(path: Path) -> None:
    """Before a writer touches ``path``: refuse, read-only, any file that is not a ledger.

    A writer connection switches the file to WAL mode as it opens, so another application's
    SQLite file (or any other file) must be refused before that, without changing it.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise LedgerFileError(f"{path} is not a usable SQLite database: {exc}") from exc
    try:
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
    except sqlite3.DatabaseError as exc:
        raise LedgerFileError(f"{path} is not a usable SQLite database: {exc}") from exc
    finally:
        conn.close()
    if tables and "alembic_version" not in tables:
        raise LedgerFileError(
            f"{path} holds tables ({', '.join(sorted(tables))}) but is not an expert layout "
            f"ledger (no alembic_version); pass the path of a ledger or of a new file"
        )


def open_reader_engine(path: Path) -> Engine:
    """A read-only engine; never creates or modifies the file."""
    if not path.exists():
        raise LedgerFileError(f"ledger {path} does not exist")
    if not path.is_file():
        raise LedgerFileError(f"ledger {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise LedgerFileError(f"ledger {path} is not readable by this user")
    return _engine(path, f"file:{quote(str(path.resolve()))}?mode=ro", writer=False)
