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
from collections.abc import Callable, Sequence
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
    paths: Sequence[Path],
    read_new: Callable[[list[int]], None],
    poll_seconds: float = POLL_SECONDS,
) -> int:
    """Call ``read_new`` with every index of ``paths`` now, then with the indices of those
    whose file or WAL changed, until interrupted (exit 0). ``read_new`` reads, in one snapshot
    per ledger, what came after what it read last."""
    try:
        # The signatures before the read: a commit after them shows in the next comparison.
        seen = [file_signature(path) for path in paths]
        read_new(list(range(len(paths))))
        while True:
            time.sleep(poll_seconds)
            now = [file_signature(path) for path in paths]
            changed = [
                index for index, (old, new) in enumerate(zip(seen, now, strict=True)) if old != new
            ]
            if changed:
                seen = now
                read_new(changed)
    except KeyboardInterrupt:
        return exit_codes.OK
