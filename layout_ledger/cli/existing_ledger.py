"""The writing commands (prune, upgrade) work on a ledger that exists, and no daemon runs on it.

Neither creates a ledger; both take the ledger's one-writer lock as a daemon does, and a running
daemon's lock makes them fail at once with what the person at the CLI can do instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from layout_ledger.core.errors import LedgerFileError, LedgerLocked
from layout_ledger.store import locations


def require_existing(path: Path) -> None:
    """A missing path, or one that is no regular file, is an error, never a new ledger."""
    if not path.exists():
        raise LedgerFileError(f"ledger {path} does not exist; {locations.FIND_LEDGERS}")
    if not path.is_file():
        raise LedgerFileError(f"ledger {path} is not a regular file")


@contextmanager
def while_no_daemon_runs(verb: str, instead: str) -> Iterator[None]:
    """Run a writing command's body; a daemon holding the ledger's writer lock fails it with a
    message for the person at the CLI (``instead``: what they can do), not the daemon's."""
    try:
        yield
    except LedgerLocked as exc:
        raise LedgerLocked(
            f"{verb} refused: the ledger {exc.ledger_path} is in use by its running daemon (its "
            f"writer lock: {exc.holder}), and {verb} writes the file only while no daemon "
            f"does; {instead}",
            ledger_path=exc.ledger_path,
            holder=exc.holder,
        ) from exc
