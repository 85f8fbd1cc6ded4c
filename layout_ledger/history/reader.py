"""A read-only handle on a ledger file for the tools: safe while a daemon writes it.

``LedgerReader`` opens the file read-only (``store.connections.open_reader_engine``: the file
checks, WAL reads that never block the writer, read-only media), refuses a schema it cannot read,
and gives one read transaction per ``connect`` so that every query inside sees one snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from layout_ledger.core.errors import LedgerFileError, LedgerStorageError
from layout_ledger.core.state import LayoutState
from layout_ledger.store.connections import open_reader_engine
from layout_ledger.store.migrate import check_readable
from layout_ledger.store.replay import read_state


class LedgerReader:
    """A read-only handle on a ledger file; safe while a daemon writes it."""

    def __init__(self, path: str | Path) -> None:

        self.path = Path(path)
        self._engine: Engine = open_reader_engine(self.path)
        try:
            with self.connect() as conn:
                check_readable(conn, self.path)
        except BaseException:
            self._engine.dispose()
            raise

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """One read transaction: every query inside sees the same snapshot."""
        try:
            with self._engine.connect() as conn, conn.begin():
                yield conn
        except DBAPIError as exc:
            message = str(exc.orig)
            if "not a database" in message or "file is encrypted" in message:
                raise LedgerFileError(f"{self.path} is not an SQLite database") from exc
            raise LedgerStorageError(f"reading ledger {self.path} failed: {message}") from exc

    def state(self, incarnation_id: int | None = None) -> LayoutState:
        """An incarnation's state (the latest when None), replayed from its rows."""
        with self.connect() as conn:
            return read_state(conn, incarnation_id)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> LedgerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
