"""The writing commands (prune, upgrade) work on a ledger that exists: neither creates one."""

from __future__ import annotations

from pathlib import Path

from layout_ledger.core.errors import LedgerFileError


def require_existing(path: Path) -> None:
    """A missing path, or one that is no regular file, is an error, never a new ledger."""
    if not path.exists():
        raise LedgerFileError(f"ledger {path} does not exist")
    if not path.is_file():
        raise LedgerFileError(f"ledger {path} is not a regular file")
