"""What a ledger file and its companions must be before SQLite opens anything.

SQLite reads a ledger's ``-wal`` (and ``-shm``, ``-journal``) by path and trusts it, so someone
else's ``-wal`` in a shared directory would be content injected into the ledger. Every opener
checks each companion that exists (``check_companions``); a writer also checks the ledger itself
(``check_writable``) and tightens looser modes to 0600 (``tighten_modes``); the default ledger
directory is private (``ensure_private_directory``). A refusal names the file and what to do.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from layout_ledger.core.errors import LedgerFileError

logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
# SQLite's files beside a ledger, and the writer's own lock-holder note.
COMPANION_SUFFIXES = ("-wal", "-shm", "-journal", ".lock")
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def companion(path: Path, suffix: str) -> Path:
    """The file beside ``path`` named ``path`` + ``suffix`` (``-wal``, ``.lock``, ...)."""
    return path.with_name(path.name + suffix)


def companions(path: Path) -> list[Path]:
    """The companion files of ``path`` that exist now."""
    return [
        candidate
        for suffix in COMPANION_SUFFIXES
        if os.path.lexists(candidate := companion(path, suffix))
    ]


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_companions(path: Path, owner: int) -> None:
    """Refuse any companion of ``path`` that SQLite must not read: one that is not a regular
    file (a link), is not ``owner``'s, or that others may write."""
    for file in companions(path):
        info = os.lstat(file)
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise LedgerFileError(
                f"{file} is {what}; SQLite would read it as part of the ledger {path.name}. "
                f"Remove it (the daemon that owns the ledger writes its own) and retry"
            )
        if info.st_uid != owner:
            raise LedgerFileError(
                f"{file} is owned by uid {info.st_uid}, not by the ledger's owner (uid {owner}); "
                f"someone else's file would be read as part of the ledger. Check who made it, "
                f"remove it, and retry"
            )
        if info.st_mode & _OTHERS_WRITE:
            raise LedgerFileError(
                f"{file} has mode {stat.S_IMODE(info.st_mode):04o}: others may write it, and "
                f"SQLite would read what they write as part of the ledger. If its content is "
                f"yours, `chmod 600 {file}`; else remove it; then retry"
            )


def check_writable(path: Path) -> None:
    """The ledger a writer may open (or create at ``path``): a regular file, not a link, of
    this process's user, one name only, that no one else may write; companions checked too."""
    info = _lstat(path)
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise LedgerFileError(
                f"ledger {path} is a symlink; refusing to follow it. Pass the real path of the "
                f"file (or a path where a new ledger may be created)"
            )
        if not stat.S_ISREG(info.st_mode):
            raise LedgerFileError(f"ledger {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise LedgerFileError(
                f"ledger {path} is owned by uid {info.st_uid} but this process runs as uid "
                f"{os.geteuid()}; run the daemon as the file's owner or give it its own ledger "
                f"path"
            )
        check_single_name(path, info)
        if info.st_mode & _OTHERS_WRITE:
            raise LedgerFileError(
                f"ledger {path} has mode {stat.S_IMODE(info.st_mode):04o}: others may have "
                f"written it. Check it (`layout-ledger verify {path}`), then `chmod 600 {path}` "
                f"and retry"
            )
    check_companions(path, os.geteuid())


def check_single_name(path: Path, info: os.stat_result) -> None:
    """One name per ledger: SQLite keeps a WAL per path, so two names could each get one."""
    if info.st_nlink > 1:
        raise LedgerFileError(
            f"ledger {path} has {info.st_nlink} hard links. SQLite keeps a ledger's WAL beside "
            f"the name it was opened by, so a daemon on another name of this file would write "
            f"a WAL of its own and commits could be lost. Remove the other names (find them "
            f"with `find / -xdev -samefile {path}`) and open the ledger by one path"
        )


def tighten_modes(path: Path) -> None:
    """Make the ledger and its companions 0600; warn once, naming every old mode."""
    loosened = []
    for file in [path, *companions(path)]:
        mode = stat.S_IMODE(os.lstat(file).st_mode)
        if mode & ~FILE_MODE:
            os.chmod(file, FILE_MODE, follow_symlinks=False)
            loosened.append(f"{file.name} was {mode:04o}")
    if loosened:
        logger.warning(
            "expert layout ledger %s: tightened to mode 0600 (%s)", path, ", ".join(loosened)
        )


def ensure_private_directory(directory: Path) -> None:
    """A directory only this user may enter: created 0700 (with any missing parent, 0700 too,
    as XDG asks of a state home it creates), else it must be ours and 0700."""
    missing = [parent for parent in directory.parents if not os.path.lexists(parent)]
    for parent in reversed(missing):
        try:
            os.mkdir(parent, DIRECTORY_MODE)
        except FileExistsError:
            pass
        except OSError as exc:
            raise LedgerFileError(
                f"cannot create the ledger directory {directory} ({parent}: {exc.strerror}); "
                f"create it, or pass a ledger path in a directory of your own"
            ) from exc
    try:
        os.mkdir(directory, DIRECTORY_MODE)
        os.chmod(directory, DIRECTORY_MODE)  # whatever the umask
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise LedgerFileError(
            f"cannot create the ledger directory {directory}: {exc.strerror}"
        ) from exc
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise LedgerFileError(
            f"the ledger directory {directory} is not a directory (or is a symlink); remove it "
            f"or pass another ledger path"
        )
    if info.st_uid != os.geteuid():
        raise LedgerFileError(
            f"the ledger directory {directory} belongs to uid {info.st_uid}, not to this daemon's "
            f"user (uid {os.geteuid()}); someone else could replace the ledgers in it. Remove "
            f"it, or pass a ledger path in a directory of your own"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise LedgerFileError(
            f"the ledger directory {directory} has mode {mode:04o}; it must be 0700 so that no "
            f"one else can add files beside the ledgers. `chmod 700 {directory}` and retry"
        )
