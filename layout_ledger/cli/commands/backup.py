"""``layout-ledger backup``: a consistent single-file copy of a ledger, also while its daemon runs.

A plain ``cp`` of the main file misses the commits still in its ``-wal``; SQLite's online backup
API, in one step from a read-only connection, copies the ledger as it stood at one moment. The
copy (one file, mode 0600) is linked into place, so it never replaces a file. Many ledgers (the
PATH... forms ``fleet`` takes) go into one directory, one file each under its ledger's name.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sqlite3
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from layout_ledger.cli import exit_codes
from layout_ledger.cli.json_shape import JsonShaped
from layout_ledger.cli.output import emit, print_error
from layout_ledger.cli.path_expansion import expand_ledger_paths, names_many
from layout_ledger.core.errors import (
    LedgerError,
    LedgerFileError,
    LedgerStorageError,
    SchemaOutdated,
    SchemaTooNew,
)
from layout_ledger.store.connections import open_reader_engine
from layout_ledger.store.files import FILE_MODE
from layout_ledger.store.migrate import file_revision, refuse_newer


def run(args: argparse.Namespace) -> int:
    if not names_many(args.ledger):
        result = backup_ledger(args.ledger[0], args.destination)
        # --json has one shape whatever names the ledgers: one copy is a list of one.
        one = BackupsResult(str(Path(result.output).parent), (result,), ())
        emit(args, one.to_json(), render_backup(result))
        return exit_codes.OK
    many = backup_ledgers(expand_ledger_paths(args.ledger), args.destination)
    emit(args, many.to_json(), render_backups(many))
    for failed in many.failures:
        print_error("backup", f"cannot back up {failed.path}: {failed.problem}")
    return many.exit_code


@dataclass(frozen=True)
class BackupResult(JsonShaped):
    path: str
    output: str
    schema_revision: str
    bytes: int
    incarnations: int
    events: int
    chain_head: str | None  # the last event's chain value (compare with the daemon's log)


def backup_output(source: Path, destination: str | os.PathLike[str]) -> Path:
    """The file a backup writes: ``destination``, or the source's name inside it when it is a
    directory (a name ending in ``/`` must be one); it must not exist yet, and its directory
    must."""
    spelled = os.fspath(destination)
    named_directory = spelled.endswith(("/", os.sep))
    destination = Path(spelled)
    if named_directory and not destination.is_dir():
        raise LedgerError(
            f"cannot write into {spelled}: no such directory (a DEST ending in / names a "
            f"directory to write the copy into); create it, or name the copy without the /"
        )
    output = destination / source.name if destination.is_dir() else destination
    if os.path.lexists(output):
        raise LedgerError(
            f"{output} already exists; a backup never replaces a file: remove it or name another"
        )
    if not output.parent.is_dir():
        raise LedgerError(
            f"cannot write {output}: the directory {output.parent} does not exist; create it, "
            f"or name a file in an existing directory"
        )
    return output


def backup_ledger(
    source: str | os.PathLike[str], destination: str | os.PathLike[str]
) -> BackupResult:
    """Copy the ledger at ``source`` into ``destination`` (see the module docstring)."""
    source = Path(source)
    output = backup_output(source, destination)
    engine = open_reader_engine(source)
    try:
        with engine.connect() as conn:
            revision = _revision(conn, source)
            driver = conn.connection.dbapi_connection
            if not isinstance(driver, sqlite3.Connection):
                raise LedgerFileError(f"{source} was not opened through sqlite3")
            if conn.in_transaction():
                conn.rollback()
            temporary = _copy(driver, output)
    finally:
        engine.dispose()
    try:
        os.link(temporary, output)  # fails, instead of replacing, when output appeared meanwhile
    except FileExistsError as exc:
        raise LedgerError(
            f"{output} appeared while the backup was written; nothing replaced"
        ) from exc
    except OSError as exc:
        raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    _sync_directory(output.parent)
    return _describe(source, output, revision)


def _revision(conn: Connection, source: Path) -> str:
    """The ledger's schema revision (any: a backup copies bytes); refuse what is no ledger."""
    try:
        revision = file_revision(conn)
    except DBAPIError as exc:
        message = str(exc.orig)
        if "not a database" in message or "file is encrypted" in message:
            raise LedgerFileError(f"{source} is not an SQLite database") from exc
        raise LedgerStorageError(f"reading ledger {source} failed: {message}") from exc
    if revision is None:
        raise LedgerFileError(f"{source} is an empty SQLite file, not an expert layout ledger")
    refuse_newer(revision, source)
    return revision


def _copy(source: sqlite3.Connection, output: Path) -> Path:
    """The whole database, in one backup step, into a new private file beside ``output``."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    except OSError as exc:  # a read-only or unwritable directory: one line, exit 1
        raise LedgerError(f"cannot write the backup {output}: {exc.strerror}") from exc
    os.close(fd)
    temporary = Path(name)
    try:
        os.chmod(temporary, FILE_MODE)
        copy = sqlite3.connect(temporary, isolation_level=None)
        try:
            source.backup(copy)  # pages=-1: every page in one step, one read snapshot
            copy.execute("PRAGMA journal_mode=DELETE")  # one file: no -wal to lose
        finally:
            copy.close()
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        if isinstance(exc, (OSError, sqlite3.Error)):
            raise LedgerError(f"cannot write the backup {output}: {exc}") from exc
        raise
    return temporary


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(source: Path, output: Path, revision: str) -> BackupResult:
    """What the copy holds, read back from it."""
    with contextlib.closing(sqlite3.connect(f"file:{output}?mode=ro", uri=True)) as copy:
        incarnations = copy.execute("SELECT count(*) FROM incarnations").fetchone()[0]
        events = copy.execute("SELECT count(*) FROM events").fetchone()[0]
        columns = {row[1] for row in copy.execute("PRAGMA table_info(events)")}
        head = None
        if "chain" in columns:
            row = copy.execute("SELECT chain FROM events ORDER BY event_id DESC LIMIT 1").fetchone()
            head = None if row is None else row[0]
    return BackupResult(
        path=str(source),
        output=str(output),
        schema_revision=revision,
        bytes=output.stat().st_size,
        incarnations=int(incarnations),
        events=int(events),
        chain_head=head,
    )


@dataclass(frozen=True)
class FailedBackup(JsonShaped):
    """A ledger among many that could not be backed up, and why."""

    path: str
    problem: str
    unusable: bool  # the ledger could not be read (else the copy could not be written)


@dataclass(frozen=True)
class BackupsResult(JsonShaped):
    """Many ledgers backed up into one directory: each copy, or why it was not made."""

    directory: str
    backups: tuple[BackupResult, ...]
    failures: tuple[FailedBackup, ...]

    @property
    def exit_code(self) -> int:
        """2 when a ledger could not be read, else 1 when a copy could not be written, else 0."""
        if any(item.unusable for item in self.failures):
            return exit_codes.UNUSABLE
        return exit_codes.FAILED if self.failures else exit_codes.OK


def backup_ledgers(paths: Sequence[Path], destination: str | os.PathLike[str]) -> BackupsResult:
    """Each ledger into the directory ``destination`` under its own name; one that fails does
    not stop the others. Two ledgers of one name would need one file: refused before any copy."""
    directory = Path(destination)
    if not directory.is_dir():
        raise LedgerError(
            f"backing up {len(paths)} ledgers needs DEST to be a directory to write one copy of "
            f"each into; {os.fspath(destination)} is not one"
        )
    by_name: dict[str, Path] = {}
    for path in paths:
        if path.name in by_name:
            raise LedgerError(
                f"{by_name[path.name]} and {path} have the same name, so their copies would be "
                f"one file in {directory}; back them up into different directories"
            )
        by_name[path.name] = path
    made, failures = [], []
    for path in paths:
        try:
            made.append(backup_ledger(path, directory))
        except (LedgerFileError, LedgerStorageError, SchemaOutdated, SchemaTooNew) as exc:
            failures.append(FailedBackup(str(path), str(exc), unusable=True))
        except LedgerError as exc:
            failures.append(FailedBackup(str(path), str(exc), unusable=False))
    return BackupsResult(str(directory), tuple(made), tuple(failures))


def render_backups(result: BackupsResult) -> list[str]:
    lines = [line for made in result.backups for line in render_backup(made)[:1]]
    lines.append(
        f"backed up {len(result.backups)} of {len(result.backups) + len(result.failures)} "
        f"ledgers into {result.directory}"
        + (f" ({len(result.failures)} failed, see below)" if result.failures else "")
    )
    lines.append(f"check them: layout-ledger fleet --verify {result.directory}")
    return lines


def render_backup(result: BackupResult) -> list[str]:
    head = "" if result.chain_head is None else f", event chain head {result.chain_head}"
    return [
        f"backed up {result.path} to {result.output}: {result.bytes} bytes, schema "
        f"{result.schema_revision}, {result.incarnations} incarnations, {result.events} "
        f"events{head}",
        f"check it: layout-ledger verify {result.output}",
    ]
