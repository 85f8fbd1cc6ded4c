"""The ledgers a PATH names, for the commands that read many at once (``fleet``, ``metrics``,
``status``, ``backup``, ``cordon``, ``retire``).

A PATH is a ledger file (itself, even when missing: its reader then says why), a directory (the
SQLite files directly in it, not their companions, symbolic links to ledger files included), or
the daemons' ledger path template with ``{device_uuid}`` (the files it matches). One that names
no ledger is an error; the same file named twice is read once.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from layout_ledger.core.errors import LedgerFileError
from layout_ledger.store.files import COMPANION_SUFFIXES

PLACEHOLDER = "{device_uuid}"
_SQLITE_HEADER = b"SQLite format 3\x00"


def expand_ledger_paths(specs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The ledger files ``specs`` name, in order, each once (see the module docstring)."""
    found: list[Path] = []
    seen: set[str] = set()
    for spec in specs:
        for path in _expand_one(os.fspath(spec)):
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                found.append(path)
    return found


def names_many(specs: Sequence[str | os.PathLike[str]]) -> bool:
    """Whether ``specs`` ask for the many-ledger form of a command's human output: more than
    one PATH, or a directory or a template (which may match any number of files, one included).
    Machine output (``--json``) has one shape either way: one ledger is a list of one."""
    if len(specs) != 1:
        return True
    spec = os.fspath(specs[0])
    return PLACEHOLDER in spec or os.path.isdir(spec)


def _expand_one(spec: str) -> list[Path]:
    if PLACEHOLDER in spec:
        pattern = glob.escape(spec).replace(glob.escape(PLACEHOLDER), "*")
        matches = [Path(name) for name in sorted(glob.glob(pattern)) if _is_ledger_file(name)]
        if not matches:
            raise LedgerFileError(
                f"no ledger file matches the template {spec}; give the template the daemons "
                f"were given (--expert-layout-ledger), or no PATH for the default location"
            )
        return matches
    path = Path(spec)
    if not path.is_dir():
        return [path]
    ledgers = sorted(entry for entry in path.iterdir() if _is_ledger_file(entry))
    if not ledgers:
        raise LedgerFileError(
            f"{spec} is not a regular file, and the directory holds no ledger (no SQLite file "
            f"in it); name a ledger file or the directory the daemons write their ledgers into"
        )
    return ledgers


def _is_ledger_file(path: str | Path) -> bool:
    """A regular file (or a symbolic link to one: its reader resolves it) with SQLite's header,
    and not a ledger's companion."""
    name = os.fspath(path)
    if name.endswith(COMPANION_SUFFIXES) or not os.path.isfile(name):
        return False
    try:
        with open(name, "rb") as file:
            return file.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return False
