"""``history --follow``: the matching events, then each new one as the daemon commits it.

No busy reading of the ledger: every ``POLL_SECONDS`` it compares the size and modification
time of the ledger file and of its WAL (two ``stat`` calls) with the last seen; only when they
changed does it open the ledger read-only, as every read command does (safe while the daemon
writes: WAL readers never block it), and read the events whose ``event_id`` is above the last
one read (``--after-event``), in one snapshot. An event is printed once: a row of counted
refusals whose count grows later is not printed again (``history`` shows its count).
Interrupted (Ctrl-C), it stops and exits 0; a reader that goes away (``| head``) ends it too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from layout_ledger.cli import exit_codes
from layout_ledger.store import files

POLL_SECONDS = 0.25

Signature = tuple[tuple[int, int, int] | None, ...]


def file_signature(path: Path) -> Signature:
    """What changes whenever a transaction commits or a checkpoint moves pages: the inode,
    size and modification time of the ledger and of its WAL (None: the file is absent)."""
    real = path.resolve()
    found: list[tuple[int, int, int] | None] = []
    for name in (real, files.companion(real, "-wal")):
        try:
            info = os.stat(name)
        except FileNotFoundError:
            found.append(None)
        else:
            found.append((info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(found)


def follow_changes(
    path: Path, read_new: Callable[[], None], poll_seconds: float = POLL_SECONDS
) -> int:
    """Call ``read_new`` now and again each time ``path`` or its WAL changed, until interrupted
    (exit 0). ``read_new`` reads, in one snapshot, what came after what it read last."""
    try:
        # The signature before the read: a commit after it shows in the next comparison.
        seen = file_signature(path)
        read_new()
        while True:
            time.sleep(poll_seconds)
            now = file_signature(path)
            if now != seen:
                seen = now
                read_new()
    except KeyboardInterrupt:
        return exit_codes.OK
