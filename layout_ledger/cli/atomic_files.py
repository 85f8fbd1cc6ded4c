"""Writing an output file so a reader sees the old file or the new one, never half of one.

``export``, ``plot``, ``metrics -o`` and ``retire`` write through ``write_atomically``: a
temporary file in the output's directory, synced, renamed into place, then the directory
synced. ``export`` never replaces a file unless told to (``replace=False``: the temporary file
is linked into place, which fails instead of replacing a file that appeared meanwhile).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from layout_ledger.core.errors import LedgerError


def write_atomically(
    output: Path,
    data: bytes,
    accept: Callable[[Path], bool] | None = None,
    *,
    temporary_suffix: str | None = None,
    mode: int = 0o644,
    replace: bool = True,
    refusal: str = "",
) -> bool:
    """Write ``data`` to ``output`` through a temporary file in its directory (same suffix, or
    ``temporary_suffix``), synced to disk, then a rename, then a sync of the directory.
    ``accept`` sees the complete temporary file first: when it returns False or raises, the
    temporary file is removed and ``output`` stays as it was. Returns whether ``output`` was
    written. With ``replace`` False an existing ``output`` is an error (``refusal`` says what to
    do instead), never replaced."""
    if not replace:
        _refuse_existing(output, refusal)
    directory = output.parent
    if not directory.is_dir():
        raise LedgerError(
            f"cannot write {output}: the directory {directory} does not exist; create it, or "
            f"name a file in an existing directory"
        )
    try:
        suffix = output.suffix if temporary_suffix is None else temporary_suffix
        fd, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=suffix, dir=directory)
    except OSError as exc:
        raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.chmod(mode)
        if accept is not None and not accept(temporary):
            temporary.unlink()
            return False
        if replace:
            os.replace(temporary, output)
        else:
            try:
                os.link(temporary, output)  # fails, instead of replacing, if output appeared
            except FileExistsError as exc:
                raise LedgerError(
                    f"{output} appeared while it was written; nothing was replaced: {refusal}"
                ) from exc
            temporary.unlink()
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        if isinstance(exc, OSError):
            raise LedgerError(f"cannot write {output}: {exc.strerror}") from exc
        raise
    _sync_directory(output)
    return True


def _refuse_existing(output: Path, refusal: str) -> None:
    if os.path.lexists(output):
        raise LedgerError(f"{output} already exists; nothing was written: {refusal}")


def _sync_directory(output: Path) -> None:
    try:
        fd = os.open(output.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise LedgerError(
            f"wrote {output} but could not sync its directory to disk: {exc.strerror}"
        ) from exc
