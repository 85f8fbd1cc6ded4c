"""Opening a ledger file: the one-writer lock, and SQLite connections for a writer or a reader.

Every opener goes through here after ``store.files`` checked the file and its companions. A
writer (``open_writer``) holds an exclusive open-file-description lock on the ledger's inode
(``WriterLock``: one writer per file whatever path names it, released by the kernel however the
process dies) and runs WAL mode, ``synchronous=FULL`` and ``BEGIN IMMEDIATE``; a reader
(``open_reader_engine``) opens ``mode=ro`` and never blocks the writer, also on read-only media.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sqlite3
import struct
import tempfile
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.pool import StaticPool

from layout_ledger.core.errors import LedgerFileError, LedgerLocked
from layout_ledger.core.state import utc_now
from layout_ledger.store import files, locations

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 5000
FILE_MODE = files.FILE_MODE
# WAL bytes kept after a checkpoint resets the log; bounds the -wal file on disk. Above the
# maintenance's RESTART threshold (2 MiB), so a steady stream never pays for a truncation; a WAL
# that grew while a reader pinned it is cut back to this when the log next starts over.
JOURNAL_SIZE_LIMIT = 8 * 1024 * 1024


def lock_path_for(path: Path) -> Path:
    """The writer lock holder's note beside the ledger (``<ledger>.lock``)."""
    return files.companion(path, ".lock")


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


# struct flock on Linux x86-64/aarch64: l_type, l_whence, l_start, l_len, l_pid (+ padding).
_FLOCK = "hhqqi4x"
# The byte the writer locks: SQLite's own locks sit at 1 GiB and above, never here.
_LOCK_BYTE = 0


def _ofd(fd: int, command: int, lock_type: int) -> int:
    """One open-file-description lock call on the lock byte; returns the l_type it reports."""
    request = struct.pack(_FLOCK, lock_type, os.SEEK_SET, _LOCK_BYTE, 1, 0)
    answer = fcntl.fcntl(fd, command, request)
    return int(struct.unpack(_FLOCK, answer)[0])


class WriterLock:
    """The exclusive, kernel-released claim of one process on one ledger file for writing.

    An ``F_OFD_SETLK`` lock on one byte of the ledger's own inode: it holds whatever path names
    the file (a bind mount), SQLite's own locks never touch it, and ``writer_lock_held`` sees it
    without taking it. The holder writes who it is into ``<ledger>.lock`` for error messages.
    """

    def __init__(self, ledger_path: Path) -> None:
        self.path = lock_path_for(ledger_path)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd: int | None = os.open(ledger_path, flags)
        except OSError as exc:
            raise LedgerFileError(f"cannot open ledger {ledger_path}: {exc.strerror}") from exc
        try:
            files.check_single_name(ledger_path, os.fstat(self._fd))
            _ofd(self._fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
        except OSError as exc:
            self.release()
            holder = _read_note(self.path)
            raise LedgerLocked(
                f"ledger {ledger_path} is owned by another daemon (it holds the ledger's writer "
                f"lock; {self.path}: {holder}); stop that daemon, or give this one its own "
                f"ledger path",
                ledger_path=str(ledger_path),
                holder=holder,
            ) from exc
        except BaseException:
            self.release()
            raise
        _write_note(self.path, f"pid={os.getpid()} since={utc_now()}\n")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_note(path: Path) -> str:
    try:
        with open(path, "rb") as note:
            return note.read(256).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def lock_holder_pid(ledger_path: str | os.PathLike[str]) -> int | None:
    """The pid the writer lock's holder wrote into ``<ledger>.lock``; None when unknown."""
    note = _read_note(lock_path_for(Path(ledger_path)))
    for part in note.split():
        key, _, value = part.partition("=")
        if key == "pid" and value.isdigit():
            return int(value)
    return None


def _write_note(path: Path, text: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        logger.warning("could not write the ledger's lock note %s: %s", path, exc.strerror)
        return
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def writer_lock_held(path: str | os.PathLike[str]) -> bool | None:
    """Whether a process holds ``path``'s writer lock, probed without taking it (None: cannot
    tell, e.g. the file cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _ofd(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK
    except OSError:
        return None
    finally:
        os.close(fd)


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
            raise LedgerFileError(f"ledger {path} does not exist; {locations.FIND_LEDGERS}")
        if not path.parent.is_dir():
            raise LedgerFileError(
                f"cannot open ledger {path}: its directory {path.parent} does not exist; "
                f"create it or pass another ledger path"
            )
        files.check_writable(path)
        _check_ledger_or_empty(path)
        _create_private(path)
        self._lock = WriterLock(path)
        try:
            files.tighten_modes(path)
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
    """A read-only engine; never creates or modifies the file or anything beside it.

    WAL lets any number of readers (engines, the CLI, the ``sqlite3`` shell) read while the
    daemon writes. Where SQLite would have to create the ``-shm`` (and ``-wal``) a WAL reader
    needs, beside a file whose daemon does not run (evidence: read without changing its
    directory), or on read-only media, where it cannot, it uses SQLite's ``immutable`` mode when
    no WAL content is present, else (read-only media) a private in-memory copy of the file and
    its WAL. A symbolic link is read as the file it names, its companions beside that file."""
    if not path.exists():
        raise LedgerFileError(f"ledger {path} does not exist; {locations.FIND_LEDGERS}")
    if not path.is_file():
        raise LedgerFileError(f"ledger {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise LedgerFileError(f"ledger {path} is not readable by this user")
    real = path.resolve()
    files.check_companions(real, os.stat(real).st_uid)
    uri = f"file:{quote(str(real))}?mode=ro"
    if os.access(real.parent, os.W_OK):
        if _no_wal_content(real) and writer_lock_held(real) is False:
            # No daemon writes it, and nothing is in a WAL: the main file is the whole ledger.
            # (A daemon that starts meanwhile writes into a new WAL, which this read ignores.)
            return _engine(path, uri + "&immutable=1", writer=False)
        return _engine(path, uri, writer=False)
    # Read-only media: SQLite cannot create the -shm a WAL reader needs beside the file.
    if _no_wal_content(real):
        return _engine(path, uri + "&immutable=1", writer=False)
    return _memory_copy_engine(real)


def _no_wal_content(path: Path) -> bool:
    wal = files.companion(path, "-wal")
    return not wal.exists() or wal.stat().st_size == 0


def _memory_copy_engine(path: Path, attempts: int = 5) -> Engine:
    """A private in-memory copy of the ledger and its WAL, through SQLite's backup API."""
    wal = files.companion(path, "-wal")
    for _ in range(attempts):
        before = [_signature(path), _signature(wal)]
        with tempfile.TemporaryDirectory(prefix="layout-ledger-") as scratch:
            copy = Path(scratch) / path.name
            shutil.copyfile(path, copy)
            shutil.copyfile(wal, files.companion(copy, "-wal"))
            if [_signature(path), _signature(wal)] != before:
                continue  # a writer changed the files while they were copied
            memory = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            with contextlib.closing(sqlite3.connect(copy)) as source:
                source.backup(memory)
        return _engine_on(path, memory)
    raise LedgerFileError(
        f"ledger {path} kept changing while it was copied from its read-only directory; retry"
    )


def _signature(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def _engine_on(path: Path, conn: sqlite3.Connection) -> Engine:
    """A reader's engine over one connection that is already open (an in-memory copy)."""
    _apply_pragmas(conn, writer=False)
    engine = create_engine("sqlite://", creator=lambda: conn, poolclass=StaticPool)

    @event.listens_for(engine, "begin")
    def _begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine
